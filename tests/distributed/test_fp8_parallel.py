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


def test_fp8_base_with_cpu_offload_is_refused_and_never_chosen():
    """The layout (before anything is built) refuses cpu_offload written with an fp8 base, and auto never offers it
    for one: on a GPU too small for the run it says nothing fits rather than offloading."""
    from moetune.config import load_config
    from moetune.errors import ConfigError
    from moetune.parallel.layout import MemoryLimit, resolve_layout

    gpu = MemoryLimit(1.0, "GPU memory")  # a GPU (not the host): offload would be a candidate for a bf16 base
    with pytest.raises(ConfigError, match="cpu_offload true with an fp8 base"):
        resolve_layout(load_config(None, ["--model.quantize", "fp8", "--parallel.cpu_offload", "true"]), 1, gpu)
    tiny = MemoryLimit(0.001, "GPU memory")  # nothing fits: the smallest layout tried is named
    with pytest.raises(ConfigError, match=r"cpu_offload true\)") :
        resolve_layout(load_config(None, []), 1, tiny)  # a bf16 base: offload is the last resort tried
    with pytest.raises(ConfigError, match=r"cpu_offload false\)"):
        resolve_layout(load_config(None, ["--model.quantize", "fp8"]), 1, tiny)
