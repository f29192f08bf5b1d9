"""An fp8 frozen base on 2 gloo processes: under expert parallelism the fp8 expert stacks and their scales are
sharded by expert like bf16 ones; under FSDP2 they are sharded and gathered as stored, also with CPU offload (the
shards kept in host memory as stored). Each run equals one process.

CPU offload on the CPU: the layout refuses it on a CPU run (nothing to offload to), so these runs state a GPU's memory
(parallel.gpu_memory_gib), which makes the layout a GPU's; FSDP2's CPUOffloadPolicy then runs its offload code on the
CPU device, without pinned memory and with the host-to-device copy a no-op. What only a GPU shows (pinned fp8
shards, their copies to the GPU, NCCL beside the CPU backend): benchmarks/fp8_offload_check.py."""

import os
import shutil

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


OFFLOAD = {"parallel.cpu_offload": "true", "parallel.gpu_memory_gib": 80}  # as on a GPU: see the module's docstring


def test_fp8_base_fsdp2_with_cpu_offload_equals_one_process_and_resumes(tmp_path):
    """FSDP2 with CPU offload over 2 processes keeps the fp8 shards and their scales in host memory as stored and
    gathers them as stored: the same losses, gradient norms and adapter as one process without offload. Its step-3
    checkpoint (the LoRA state only: the frozen base is rebuilt from its source) resumes offloaded to the same
    last two steps."""
    over = {"model.quantize": "fp8", "eval.every": 2, "checkpoint.every": 3}
    one = run_inprocess(small_run_args(tmp_path, "one", **over, **{"train.micro_batch_size": 2}))
    args = small_run_args(tmp_path, "offload", **over, **OFFLOAD, **{"train.micro_batch_size": 1})
    run_torchrun(args)
    offloaded = tmp_path / "runs" / "offload"
    _assert_same_run(one, offloaded)

    resumed = tmp_path / "runs" / "resumed"
    os.makedirs(resumed / "checkpoints")
    shutil.copytree(offloaded / "checkpoints" / "step_000003", resumed / "checkpoints" / "step_000003")
    shutil.copy(offloaded / "config.yaml", resumed / "config.yaml")
    run_torchrun(small_run_args(tmp_path, "resumed", **over, **OFFLOAD, **{"train.micro_batch_size": 1,
                                                                           "resume": "auto"}))
    tail = {r["step"]: r["loss"] for r in read_metrics(resumed) if "loss" in r}
    want = {r["step"]: r["loss"] for r in read_metrics(offloaded) if "loss" in r and r["step"] > 3}
    assert sorted(tail) == [4, 5] and [tail[s] for s in (4, 5)] == pytest.approx([want[4], want[5]], rel=1e-5)


def test_fp8_base_with_cpu_offload_is_taken_and_offered():
    """cpu_offload written with an fp8 base is taken as written, and auto offers it for an fp8 base as for a bf16 one:
    last, when nothing else fits the GPU."""
    from moetune.config import load_config
    from moetune.errors import ConfigError
    from moetune.parallel.estimate import build_meta_model, count_params, estimate_memory
    from moetune.parallel.layout import MemoryLimit, make_layout, resolve_layout
    from moetune.model.config import model_config_for

    fp8 = ["--model.quantize", "fp8"]
    gpu = MemoryLimit(80.0, "GPU memory")
    layout = resolve_layout(load_config(None, fp8 + ["--parallel.cpu_offload", "true"]), 1, gpu)
    assert (layout.cpu_offload, layout.fsdp) == (True, True)
    # a GPU on which the tiny fp8 run fits only offloaded: between the offloaded and the resident estimates
    cfg = load_config(None, fp8)
    m = model_config_for(cfg)
    counts = count_params(build_meta_model(cfg, m))
    assert counts.frozen.stored > 0  # the base is fp8

    def peak(offload, ac):
        layout = make_layout(1, 1, -1, ac, offload, n_layers=m.num_hidden_layers)
        return estimate_memory(cfg, m, counts, layout).total_gib

    assert peak(True, "full") < peak(False, "full")
    between = MemoryLimit((peak(True, "full") + peak(False, "full")) / 2 / 0.95, "GPU memory")
    chosen = resolve_layout(cfg, 1, between)
    assert chosen.cpu_offload and chosen.estimate_gib <= 0.95 * between.gib, chosen.describe()
    assert any("live in host memory" in r for r in chosen.reasons)
    tiny = MemoryLimit(0.001, "GPU memory")  # nothing fits: the smallest layout tried is named, offloaded
    for over in ([], fp8):
        with pytest.raises(ConfigError, match=r"cpu_offload true\)"):
            resolve_layout(load_config(None, over), 1, tiny)
