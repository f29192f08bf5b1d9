"""Interruptions: SIGKILL in the middle of a save, and SIGTERM to one of two ranks (with resharding 1→2→1).

Both start the run with pause_hook/ first on PYTHONPATH: its sitecustomize.py makes rank 0 sleep after a
checkpoint's files are written and before it is renamed to its final name, so the test acts at a known point
of a save."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from helpers import free_port, read_metrics, run_inprocess, small_run_args, step_losses
from moetune.run_dir import complete_checkpoints, load_model_state

PAUSE_HOOK = os.path.join(os.path.dirname(__file__), "pause_hook")


def _start(args, nproc=None, pause=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if pause:
        env["MOETUNE_TEST_PAUSE"] = pause
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PAUSE_HOOK, env.get("PYTHONPATH")) if p)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    launcher = [sys.executable]
    if nproc:
        launcher += ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(free_port())]
    return subprocess.Popen(launcher + ["-m", "moetune", "train"] + args, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait_for(path, proc, timeout=120):
    t0 = time.time()
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"the run ended before {path} appeared:\n{proc.stdout.read()[-4000:]}")
        if time.time() - t0 > timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"{path} did not appear in {timeout} s")
        time.sleep(0.02)


def _adapter(run):
    return load_file(os.path.join(run, "adapter", "adapter_model.safetensors"))


def test_sigkill_during_save_leaves_previous_checkpoint(tmp_path):
    kw = {"train.steps": 6, "checkpoint.every": 2, "lora.dropout": 0.1}  # dropout: the RNG state matters
    ref = run_inprocess(small_run_args(tmp_path, "ref", **kw))
    proc = _start(small_run_args(tmp_path, "killed", **kw), pause="step_000004:120")
    run = tmp_path / "runs" / "killed"
    _wait_for(run / "checkpoints" / "step_000004.tmp" / "trainer_state.json", proc)  # all written, not renamed
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert [s for s, _ in complete_checkpoints(run / "checkpoints")] == [2]
    assert (run / "checkpoints" / "step_000004.tmp").is_dir()  # the debris auto-resume must ignore
    run_inprocess(small_run_args(tmp_path, "killed", **kw, resume="auto"))
    assert step_losses(run) == step_losses(ref)
    for k, v in _adapter(ref).items():
        assert torch.equal(_adapter(run)[k], v), k


def test_sigterm_to_one_rank_stops_both_at_a_checkpoint(tmp_path):
    """Full fine-tuning, resharded on the way: 1 process → 2 (then signalled) → 1, against one straight run."""
    kw = {"train.steps": 8, "checkpoint.every": 2, "checkpoint.keep_last": 9, "finetune.mode": "full", "optim.lr": 1e-3}
    ref = run_inprocess(small_run_args(tmp_path, "ref", **kw, **{"train.micro_batch_size": 2}))
    start_from = str(ref / "checkpoints" / "step_000002")
    proc = _start(small_run_args(tmp_path, "sig", **kw, **{"train.micro_batch_size": 1, "resume": start_from}),
                  nproc=2, pause="step_000004:3")
    run = tmp_path / "runs" / "sig"
    _wait_for(run / "checkpoints" / "step_000004.tmp" / "trainer_state.json", proc)
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if "moetune" in " ".join(p.cmdline())]
    rank1 = [p for p in workers if p.environ().get("RANK") == "1"]
    assert len(rank1) == 1, [p.cmdline() for p in workers]
    rank1[0].send_signal(signal.SIGTERM)  # rank 0 is not told: the per-step all-reduce tells it
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-4000:]
    # the signal landed during step 4's save; both ranks stopped at the next step boundary and saved it
    assert [s for s, _ in complete_checkpoints(run / "checkpoints")] == [4, 5]
    want = {r["step"]: r["loss"] for r in read_metrics(ref) if "loss" in r}
    got = {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}
    assert sorted(got) == [3, 4, 5]  # 1 → 2 processes: resumed after step 2
    # and on with 1 process again (2 → 1), to the end
    run_inprocess(small_run_args(tmp_path, "sig", **kw, **{"train.micro_batch_size": 2, "resume": "auto"}))
    got = {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}
    assert sorted(got) == list(range(3, 9))
    assert [got[s] for s in range(3, 9)] == pytest.approx([want[s] for s in range(3, 9)], rel=1e-4, abs=1e-5)
    # AdamW's update is about lr per element whatever the gradient's size, so where a gradient is near zero,
    # fp32-level differences between 1 and 2 processes move a weight by up to ~lr: hence atol ~ lr
    a, b = load_model_state(ref / "checkpoints" / "step_000008"), load_model_state(run / "checkpoints" / "step_000008")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=1e-3, msg=lambda m, k=k: f"{k}: {m}")
