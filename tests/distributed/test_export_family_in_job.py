"""`export_merged_from_model` on every rank of a 2-process (gloo) job, GLM-5's architecture (MLA + DSA indexer)
sharded by EP and FSDP2: transformers' GlmMoeDsaForCausalLM loads what it writes as the 1-process moetune model with
the same LoRA on every MLA projection, shared and routed experts."""

import os

import torch
import torch.multiprocessing as mp

from family_models import hf_dsa
from helpers import random_adapter, save_hf
from test_export_merged_in_job import _worker

TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "dense_mlp", "shared_experts",
           "experts"]


def test_in_job_merged_export_of_glm5_matches_one_process(tmp_path):
    from transformers import AutoModelForCausalLM

    base = save_hf(hf_dsa(seed=6), tmp_path / "base")
    ours = random_adapter(base, tmp_path / "adapter", TARGETS, rank=4, alpha=8.0).eval()
    out = tmp_path / "merged"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), base, str(tmp_path / "adapter"), str(out), True), nprocs=2)
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))  # 20 > index_topk 8
    with torch.no_grad():
        want = ours(ids)
        got = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()(input_ids=ids).logits
    assert ((got - want).norm() / want.norm()).item() < 1e-4
