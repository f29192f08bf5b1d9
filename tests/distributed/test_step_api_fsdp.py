"""The step API under torchrun: 2 FSDP ranks, each stepping its half of the sequences with a custom loss and
per-token weights, train the adapter 1 process trains on all of them (the loss is Σ w·loss / Σ w over every rank,
not a mean of the ranks' means: the halves here have unequal weight sums)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from helpers import free_port, small_run_args

WORKER = Path(__file__).resolve().parent / "step_api_worker.py"


def _run(tmp_path, name, nproc):
    args = small_run_args(tmp_path, name, **{"train.steps": 2, "lora.dropout": 0.0})
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                                                  str(nproc), "--master-port", str(free_port())]
    p = subprocess.run(launch + [str(WORKER), json.dumps({"args": args})], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    losses = json.loads(next(line for line in p.stdout.splitlines() if line.startswith("RESULT "))[7:])["losses"]
    return losses, load_file(tmp_path / "runs" / name / "adapter" / "adapter_model.safetensors")


def test_two_ranks_with_a_custom_loss_equal_one(tmp_path):
    one_losses, one = _run(tmp_path, "one", 1)
    two_losses, two = _run(tmp_path, "two", 2)
    assert abs(two_losses[0] - one_losses[0]) <= 1e-6
    assert abs(two_losses[1] - one_losses[1]) <= 1e-5
    assert set(one) == set(two)
    for k in one:
        assert (two[k] - one[k]).norm() <= 1e-4 * one[k].norm() + 1e-7, k
