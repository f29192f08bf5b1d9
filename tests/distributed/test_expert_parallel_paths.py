"""Expert parallelism on 2 gloo processes, model level: every execution path of the EP layer computes what the
plain single-process model computes — torch.compile (dynamo traces the layer; the exchange is a graph break) in
training and in evaluation (no_grad), activation checkpointing that keeps the dispatched rows, with and without
the pipelined (overlapped) exchange — for LoRA (attention + shared + routed experts; attention only, where the
exchange frees the rows it received) and full fine-tuning."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import free_port

WORLD = 2
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, partial_rotary_factor=0.5, attention_bias=True)


def _model(full):
    """full: False (LoRA on attention, shared and routed experts), True (full fine-tuning) or "attention" (LoRA
    on attention only: the experts are frozen and the received rows need not be kept)."""
    from moetune.model.config import ModelConfig
    from moetune.model.hf_io import build_model, init_weights
    from moetune.model.lora import apply_lora
    from moetune.train.setup import init_lora

    torch.manual_seed(0)  # the same LoRA B on every rank and for every variant
    model = build_model(ModelConfig.from_hf_dict(TINY), "cpu")
    init_weights(model, 0.1, seed=0)
    if full is not True:
        targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
        targets += [] if full == "attention" else ["shared_experts", "experts"]
        apply_lora(model, targets, 4, 8)
        init_lora(model, seed=0)
        with torch.no_grad():  # B != 0, so expert LoRA changes the output and its A gets gradients
            for name, p in model.named_parameters():
                if name.endswith("_B") or name.endswith("lora_B"):
                    p.normal_(0, 0.1)
    else:
        for name, p in model.named_parameters():
            p.requires_grad_(True)
    return model


def _batch(rank):
    g = torch.Generator().manual_seed(10 + rank)
    ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=g)
    return ids, torch.roll(ids, -1, 1)


def _loss_and_grads(model, ids, labels):
    loss = model(ids, labels=labels)
    loss.backward()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = model(ids)  # evaluation: the exchange under no_grad
    return loss.detach(), grads, logits


def _worker(rank, port, full, variants):
    from moetune.parallel.mesh import shutdown_distributed

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    _check(full, variants)
    # as `moetune train` ends: the EP models (their exchanges ran gloo's async all_to_all) freed while the group
    # exists; destroyed with them still alive, a worker aborted at exit in about 1 run of 40
    shutdown_distributed(finished=True)


def _check(full, variants):
    from torch.distributed.device_mesh import init_device_mesh

    from moetune.parallel.apply import apply_ac, apply_compile, apply_ep

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
    ids, labels = _batch(rank)
    ref_loss, ref_grads, ref_logits = _loss_and_grads(_model(full), ids, labels)
    for chunks, ac, compile_backend in variants:
        model = _model(full)
        apply_ep(model, mesh, overlap_chunks=chunks)
        apply_ac(model, ac)
        if compile_backend:
            apply_compile(model, backend=compile_backend)
        loss, grads, logits = _loss_and_grads(model, ids, labels)
        what = f"chunks={chunks} ac={ac} compile={compile_backend}"
        torch.testing.assert_close(loss, ref_loss, msg=what)
        torch.testing.assert_close(logits, ref_logits, msg=what)
        # each rank's gradient is that of its own tokens only: the expert gradients of the EP model are the sum
        # over both ranks' tokens, the rest this rank's; compare the sum over ranks on both sides
        for name in ref_grads:
            mine, ref = grads[name].clone(), ref_grads[name].clone()
            dist.all_reduce(ref)
            if ".experts." not in name:
                dist.all_reduce(mine)
            torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-6, msg=f"{what}: {name}")
        assert grads.keys() == ref_grads.keys(), what


PLAIN = [(1, "none", None), (2, "none", None), (2, "full", None), (3, "selective", None)]
# "aot_eager" traces forward and backward as Inductor would (without its code generation, minutes on 2 CPU
# cores); "eager" stops after dynamo, where the DTensor-into-grouped_mm crash of d05efb6 happened
COMPILED = [(2, "none", "aot_eager"), (2, "full", "eager")]


@pytest.mark.parametrize("full,variants", [(False, PLAIN + COMPILED), (True, PLAIN + COMPILED[1:]),
                                           ("attention", PLAIN[:3])], ids=["lora", "full_ft", "lora_attention"])
def test_ep_paths_equal_plain_model(full, variants):
    mp.spawn(_worker, args=(free_port(), full, variants), nprocs=WORLD)
