"""`train.deterministic`: a run that gives the same numbers, bit for bit, when it runs again in another process
(torchtitan's debug.deterministic), at one of two costs.

Without it a compiled run may differ from the same run in another process: Inductor picks some kernels' reduction
block sizes and warp counts, and whether to pad a matmul, by timing candidates on the GPU as it compiles (or reads a
former process's cached pick), and each choice sums in another order. Levels:
- "compile": Inductor's deterministic mode alone (no timing-based choice that changes numerics), for the whole run.
- true: besides, torch's deterministic algorithms (an op that has none warns, naming itself, instead of failing the
  run), cuDNN's deterministic kernels without benchmarking, cuBLAS's fixed workspace.
Our own kernels are deterministic either way (no atomics, fixed launch configs). Measured (BENCHMARKS.md, nineteenth
to twenty-first sessions; GLM-4.7-Flash's shapes on an fp8 base, processes with fresh compile caches): without it the
training steps repeated and the evaluation after them did not (three values in six processes); with "compile", and
with true, both repeated. Full-size GLM-4.7-Flash through `moetune train`, one H200, same call: "compile" −0.1% on a
bf16 base, −1.1% on an fp8 base with CUDA graphs (AIR-8: +0.5%, −0.8%); true −26% on bf16 (18,065 against 13,379
tokens/s).
"""

from __future__ import annotations

import os

import torch

from moetune.config.schema import DETERMINISTIC_COMPILE

CUBLAS_WORKSPACE = ":4096:8"  # what cuBLAS needs to pick the same algorithm every call (CUDA's reproducibility notes)


class Determinism:
    """The settings of `level` (False, DETERMINISTIC_COMPILE or True) on for one trainer's life, the process's former
    ones back at `close`: the step API runs inside longer-lived processes (an RL loop, the tests)."""

    def __init__(self, level: bool | str):
        self.on = level is True or level == DETERMINISTIC_COMPILE
        if not self.on:
            return
        import torch._inductor.config as inductor_config

        cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        self._saved = (torch.are_deterministic_algorithms_enabled(),
                       torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cudnn.deterministic,
                       torch.backends.cudnn.benchmark, inductor_config.deterministic, cublas)
        inductor_config.deterministic = True
        if level is True:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas or CUBLAS_WORKSPACE  # a user's own value is kept
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False

    def close(self) -> None:
        if not self.on:
            return
        import torch._inductor.config as inductor_config

        self.on = False
        algorithms, warn_only, cudnn_deterministic, cudnn_benchmark, inductor, cublas = self._saved
        torch.use_deterministic_algorithms(algorithms, warn_only=warn_only)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_deterministic, cudnn_benchmark
        inductor_config.deterministic = inductor
        if cublas is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas
