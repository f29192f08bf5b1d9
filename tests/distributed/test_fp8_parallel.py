"""An fp8 frozen base under expert parallelism (2 gloo processes): the fp8 expert stacks and their scales are
sharded by expert like bf16 ones, and a run equals one process; FSDP over an fp8 base is refused before anything
is built (this version)."""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from helpers import eval_losses, free_port, read_metrics, run_inprocess, run_torchrun, small_run_args, step_losses


def test_fp8_base_ep2_equals_one_process(tmp_path):
    over = {"model.quantize": "fp8", "eval.every": 2}
    one = run_inprocess(small_run_args(tmp_path, "one", **over, **{"train.micro_batch_size": 2}))
    run_torchrun(small_run_args(tmp_path, "ep", **over, **{"parallel.ep": 2, "train.micro_batch_size": 1}))
    ep = tmp_path / "runs" / "ep"
    la, lb = step_losses(one), step_losses(ep)
    assert len(la) == 5 and la == pytest.approx(lb, rel=1e-4, abs=1e-5) and la[-1] < la[0]
    norms = [[r["grad_norm"] for r in read_metrics(run) if "grad_norm" in r] for run in (one, ep)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-4, abs=1e-6)
    assert eval_losses(one) == pytest.approx(eval_losses(ep), rel=1e-4, abs=1e-5)
    a, b = (load_file(os.path.join(run, "adapter", "adapter_model.safetensors")) for run in (one, ep))
    assert any(".experts." in k for k in a) and a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-5)


def test_fp8_base_under_fsdp_is_refused_before_anything_is_built(tmp_path):
    args = small_run_args(tmp_path, "fsdp", **{"model.quantize": "fp8"})  # layout manual: FSDP over both
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), "-m", "moetune", "train", *args], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    out = proc.stdout + proc.stderr
    # each rank prints the one line (torchrun adds its own summary of the failed children after it)
    assert proc.returncode != 0 and out.count("moetune: error: an fp8 base") == 2, out[-3000:]
    assert not os.path.exists(tmp_path / "runs" / "fsdp" / "checkpoints")
