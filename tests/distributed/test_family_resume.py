"""Exact resume for GLM-4.7-Flash (MLA; LoRA on every MLA projection and the experts) and GLM-5 (MLA + DSA with the
indexer selecting; full fine-tuning): a run interrupted after its step-N/2 checkpoint and resumed equals the
uninterrupted run bit for bit — losses, eval losses, and the adapter or every weight. One process each (the
2-process exact resume and resharding are test_resume.py's, on GLM-4.5: the checkpoint code is shared)."""

import json
import os

import torch
from safetensors.torch import load_file

from helpers import run_inprocess, small_run_args
from test_resume import EXACT, N, _assert_bit_identical_run, _assert_identical, interrupted_copy
from moetune.run_dir import load_model_state

LITE = dict(model_type="glm4_moe_lite", vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
            num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8,
            v_head_dim=20, pad_token_id=0, eos_token_id=0)
# index_topk 16 < data.seq_len 64: the indexer selects; layer 1 reuses layer 0's top-k
DSA = dict(LITE, model_type="glm_moe_dsa", num_hidden_layers=3, index_topk=16, index_head_dim=16, index_n_heads=4,
           indexer_types=["full", "shared", "full"], first_k_dense_replace=1)


def _straight_and_resumed(tmp_path, config, **over):
    over = {**EXACT, "model.config": json.dumps(config), "model.num_hidden_layers": config["num_hidden_layers"],
            "train.micro_batch_size": 2, **over}
    run_inprocess(small_run_args(tmp_path, "straight", **over))
    straight = tmp_path / "runs" / "straight"
    resumed = interrupted_copy(straight, tmp_path / "runs" / "resumed", N // 2)
    run_inprocess(small_run_args(tmp_path, "resumed", **over, resume="auto"))
    _assert_bit_identical_run(straight, resumed)
    return straight, resumed


def test_glm47_flash_lora_resumes_exactly(tmp_path):
    straight, resumed = _straight_and_resumed(tmp_path, LITE, **{"lora.targets": "[mla_all]"})
    a, b = (load_file(os.path.join(run, "adapter", "adapter_model.safetensors")) for run in (straight, resumed))
    assert any(".q_a_proj." in k for k in a) and any(".experts." in k for k in a)
    _assert_identical(a, b)


def test_glm5_full_finetune_resumes_exactly(tmp_path):
    straight, resumed = _straight_and_resumed(tmp_path, DSA, **{"finetune.mode": "full", "optim.lr": 1e-3})
    a, b = (load_model_state(run / "checkpoints" / f"step_{N:06d}") for run in (straight, resumed))
    assert "model.layers.2.self_attn.indexer.wq_b.weight" in a and any(k.endswith("experts.gate_up_proj") for k in a)
    _assert_identical(a, b)
    start = load_model_state(straight / "checkpoints" / f"step_{N // 2:06d}")
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    assert not torch.equal(start[name], a[name])  # it trained after the checkpoint it resumed from
