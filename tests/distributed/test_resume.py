"""Exact resume on 2 gloo processes (LoRA and full fine-tuning, eval and accumulation on), and resharding
resumes 2→1 processes (1→2: test_resume_signals.py, to spare a launch).

"N/2 + resume + N/2" is made from the straight run itself: its run directory as it stood right after the
step-N/2 checkpoint (that checkpoint, the config, and a metrics.jsonl that already runs past it, as a
killed run's would) is copied and resumed with resume: auto."""

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from helpers import eval_losses, read_metrics, run_inprocess, run_torchrun, small_run_args, step_losses
from moetune.run_dir import load_model_state

N = 6
EXACT = {"train.steps": N, "checkpoint.every": N // 2, "eval.every": 2, "train.grad_accum": 2}


def interrupted_copy(src, dst, step):
    """dst = src's run directory as a run stopped after checkpointing `step` leaves it."""
    os.makedirs(dst / "checkpoints")
    name = f"step_{step:06d}"
    shutil.copytree(src / "checkpoints" / name, dst / "checkpoints" / name)
    shutil.copy(src / "metrics.jsonl", dst / "metrics.jsonl")  # runs past `step`: the resume must cut it
    shutil.copy(src / "config.yaml", dst / "config.yaml")
    return dst


def _adapter(run):
    return load_file(os.path.join(run, "adapter", "adapter_model.safetensors"))


def _final_weights(run):
    return load_model_state(run / "checkpoints" / f"step_{N:06d}")


def _assert_identical(a, b):
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _assert_bit_identical_run(straight, resumed):
    assert step_losses(resumed) == step_losses(straight)  # the values metrics.jsonl holds, unrounded equal
    assert [r["step"] for r in read_metrics(resumed) if "loss" in r] == list(range(1, N + 1))
    assert eval_losses(resumed) == eval_losses(straight)


def _assert_close_tail(straight, resumed_run):
    got = {r["step"]: r["loss"] for r in read_metrics(resumed_run) if "loss" in r}
    want = {r["step"]: r["loss"] for r in read_metrics(straight) if "loss" in r and r["step"] > N // 2}
    assert sorted(got) == sorted(want)
    assert [got[s] for s in sorted(got)] == pytest.approx([want[s] for s in sorted(want)], rel=1e-4, abs=1e-5)


def test_lora_two_processes_exact_and_resharded_to_one(tmp_path):
    straight = tmp_path / "runs" / "straight"
    run_torchrun(small_run_args(tmp_path, "straight", **EXACT, **{"train.micro_batch_size": 1}))
    resumed = interrupted_copy(straight, tmp_path / "runs" / "resumed", N // 2)
    run_torchrun(small_run_args(tmp_path, "resumed", **EXACT, **{"train.micro_batch_size": 1, "resume": "auto"}))
    _assert_bit_identical_run(straight, resumed)
    _assert_identical(_adapter(straight), _adapter(resumed))
    assert sorted(os.listdir(resumed / "checkpoints")) == ["step_000003", "step_000006"]  # keep_last 2
    # 2 → 1 process: one process with micro-batch 2 sees what two with micro-batch 1 saw together
    one = run_inprocess(small_run_args(tmp_path, "one", **EXACT, **{
        "train.micro_batch_size": 2, "resume": str(straight / "checkpoints" / "step_000003")}))
    _assert_close_tail(straight, one)
    for k, v in _adapter(straight).items():
        torch.testing.assert_close(_adapter(one)[k], v, rtol=1e-3, atol=1e-5)


def test_full_finetune_two_processes_exact_async_and_resharded_to_one(tmp_path):
    full = {**EXACT, "finetune.mode": "full", "checkpoint.async_save": True, "optim.lr": 1e-3}
    straight = tmp_path / "runs" / "straight"
    run_torchrun(small_run_args(tmp_path, "straight", **full, **{"train.micro_batch_size": 1}))
    resumed = interrupted_copy(straight, tmp_path / "runs" / "resumed", N // 2)
    run_torchrun(small_run_args(tmp_path, "resumed", **full, **{"train.micro_batch_size": 1, "resume": "auto"}))
    _assert_bit_identical_run(straight, resumed)
    weights = _final_weights(straight)
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in weights)  # everything, not only a few tensors
    _assert_identical(weights, _final_weights(resumed))
    saves = [r for r in read_metrics(straight) if "checkpoint_bytes" in r]
    assert [r["step"] for r in saves] == [3, 6]
    # async: training waits only for the staging copy, a part of the whole save (which also writes and renames)
    assert all(0 < r["checkpoint_blocking_s"] <= r["checkpoint_s"] for r in saves), saves
    one = run_inprocess(small_run_args(tmp_path, "one", **full, **{
        "train.micro_batch_size": 2, "resume": str(straight / "checkpoints" / "step_000003")}))
    _assert_close_tail(straight, one)
