"""An fp8 frozen base on 2 gloo processes: under expert parallelism the fp8 expert stacks and their scales are
sharded by expert like bf16 ones; under FSDP2 they are sharded and gathered as stored. Either run equals one
process. CPU offload with an fp8 base is refused before anything is built (this version)."""

import os
import pytest
import torch
from safetensors.torch import load_file

from helpers import eval_losses, read_metrics, run_inprocess, run_torchrun, small_run_args, step_losses


def _assert_same_run(one, other):
    la, lb = step_losses(one), step_losses(other)
    assert len(la) == 5 and la == pytest.approx(lb, rel=1e-4, abs=1e-5) and la[-1] < la[0]
    norms = [[r["grad_norm"] for r in read_metrics(run) if "grad_norm" in r] for run in (one, other)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-4, abs=1e-6)
    assert eval_losses(one) == pytest.approx(eval_losses(other), rel=1e-4, abs=1e-5)
    a, b = (load_file(os.path.join(run, "adapter", "adapter_model.safetensors")) for run in (one, other))
    assert any(".experts." in k for k in a) and a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-5)


def test_fp8_base_ep2_equals_one_process(tmp_path):
    over = {"model.quantize": "fp8", "eval.every": 2}
    one = run_inprocess(small_run_args(tmp_path, "one", **over, **{"train.micro_batch_size": 2}))
    run_torchrun(small_run_args(tmp_path, "ep", **over, **{"parallel.ep": 2, "train.micro_batch_size": 1}))
    _assert_same_run(one, tmp_path / "runs" / "ep")


def test_fp8_base_fsdp2_equals_one_process(tmp_path):
    """FSDP2 over 2 processes gathers the fp8 weights and their scales as stored (no cast to the compute dtype):
    the same losses, gradient norms and adapter as one process with twice the micro-batch."""
    over = {"model.quantize": "fp8", "eval.every": 2}
    one = run_inprocess(small_run_args(tmp_path, "one", **over, **{"train.micro_batch_size": 2}))
    run_torchrun(small_run_args(tmp_path, "fsdp", **over, **{"train.micro_batch_size": 1}))
    _assert_same_run(one, tmp_path / "runs" / "fsdp")


def test_fp8_base_with_cpu_offload_is_refused_before_anything_is_built(tmp_path):
    from moetune.errors import ConfigError

    with pytest.raises(ConfigError, match="an fp8 base .*cpu_offload"):
        run_inprocess(small_run_args(tmp_path, "offload", **{"model.quantize": "fp8", "parallel.cpu_offload": True}))
    assert not os.path.exists(tmp_path / "runs" / "offload" / "checkpoints")
