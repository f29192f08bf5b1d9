"""Exact gradient accumulation and packing without cross-document attention."""

import os

import pytest
import torch
from safetensors.torch import load_file

import moetune
from helpers import hf_model, run_inprocess, save_hf, small_run_args, step_losses


def test_accumulation_equals_one_big_batch(tmp_path):
    """4 micro-batches of 1 == 1 batch of 4, on unpacked documents of unequal length (a mean of the
    micro-batch means would weight short answers more and differ)."""
    common = {"data.pack": False, "train.steps": 3}
    big = run_inprocess(small_run_args(tmp_path, "big", **common, **{"train.micro_batch_size": 4}))
    acc = run_inprocess(small_run_args(tmp_path, "acc", **common, **{"train.micro_batch_size": 1, "train.grad_accum": 4}))
    assert step_losses(big) == pytest.approx(step_losses(acc), rel=1e-5)
    wa = load_file(os.path.join(big, "adapter", "adapter_model.safetensors"))
    wb = load_file(os.path.join(acc, "adapter", "adapter_model.safetensors"))
    # fp32 sums in another order move an element whose gradient is near zero after Adam's division by √v: 1.07e-5 on
    # one of layer 1's expert down_B once q, k and v's input gradients were summed inside one LoRA op; a mean of the
    # micro-batch means (the error this guards against) moves thousands of elements by ~0.04
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=3e-5)


def test_mean_of_means_would_differ(tmp_path):
    """Guards the test above: the token counts of its micro-batches really differ."""
    from moetune.data import build_packs, load_tokenizer

    from helpers import write_chat_jsonl

    path = write_chat_jsonl(tmp_path / "d.jsonl")
    packs, _ = build_packs(path, load_tokenizer(None), 64, pack=False)
    counts = {sum(1 for x in p["labels"] if x != -100) for p in packs[:8]}
    assert len(counts) > 1


def test_packed_documents_get_their_own_logits(tmp_path):
    ref = hf_model(seed=7)
    model = moetune.load_model(save_hf(ref, tmp_path / "ckpt"))
    a, b = torch.randint(0, 96, (1, 11)), torch.randint(0, 96, (1, 17))
    packed = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(11), torch.arange(17)]).unsqueeze(0)
    with torch.no_grad():
        got = model(packed, pos)
        alone_a, alone_b = model(a), model(b)
    torch.testing.assert_close(got[:, :11], alone_a, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[:, 11:], alone_b, rtol=1e-4, atol=1e-5)
    # and without the document boundary the second document would see the first
    with torch.no_grad():
        unmasked = model(packed)
    assert not torch.allclose(unmasked[:, 11:], alone_b, rtol=1e-3, atol=1e-4)


def test_aux_loss_is_logged_and_changes_training(tmp_path):
    """The load-balancing loss enters the objective (the step losses differ once its gradient has acted)
    and its value is logged."""
    from helpers import read_metrics

    base = run_inprocess(small_run_args(tmp_path, "noaux", **{"train.steps": 3}))
    aux = run_inprocess(small_run_args(tmp_path, "aux", **{"train.steps": 3, "train.aux_loss_coef": 1.0}))
    rows = [r for r in read_metrics(aux) if "loss" in r]
    assert all(r["aux_loss"] > 0.5 for r in rows)  # ~1.0 for balanced routing
    la, lb = step_losses(base), step_losses(aux)
    assert la[0] == pytest.approx(lb[0], rel=1e-6)  # the CE before any update is the same
    assert la[-1] != pytest.approx(lb[-1], rel=1e-6)


def test_router_entropy_is_logged_per_layer(tmp_path):
    from helpers import read_metrics

    run = run_inprocess(small_run_args(tmp_path, "ent", **{"train.steps": 2, "logging.expert_stats_every": 2}))
    rec = [r for r in read_metrics(run) if "router_entropy" in r]
    assert len(rec) == 1
    ent = rec[0]["router_entropy"]
    assert len(ent) == len(rec[0]["expert_counts"]) == 1  # 2 layers, the first dense
    assert 0.5 < ent[0] <= 1.0  # sigmoid scores of a random router are close to uniform, never above log E
