"""`train.deterministic`: a run that gives the same numbers, bit for bit, when it runs again (torchtitan's
debug.deterministic).

Without it a compiled run may differ from the same run in another process: Inductor picks some kernels' reduction
block sizes and warp counts, and whether to pad a matmul, by timing candidates on the GPU as it compiles (or reads a
former process's cached pick), and each choice sums in another order. On: torch's deterministic algorithms (an op
that has none warns, naming itself, instead of failing the run), which also hold Inductor to one reduction config;
Inductor's deterministic mode (no timing-based choice that changes numerics); cuDNN's deterministic kernels without
benchmarking; cuBLAS's fixed workspace. Our own kernels are deterministic either way (no atomics, fixed launch
configs). Measured (BENCHMARKS.md, nineteenth and twentieth sessions; GLM-4.7-Flash's shapes on an fp8 base, two
processes with fresh compile caches): without it the training steps were equal bit for bit and the evaluation after
them was not (also with Inductor's deterministic mode on while the evaluation compiles: the per-process choice is
elsewhere); with it both were.
"""

from __future__ import annotations

import os

import torch

CUBLAS_WORKSPACE = ":4096:8"  # what cuBLAS needs to pick the same algorithm every call (CUDA's reproducibility notes)


class Determinism:
    """The settings on for one trainer's life (`on`), the process's former ones back at `close`: the step API runs
    inside longer-lived processes (an RL loop, the tests)."""

    def __init__(self, on: bool):
        self.on = on
        if not on:
            return
        import torch._inductor.config as inductor_config

        cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        self._saved = (torch.are_deterministic_algorithms_enabled(),
                       torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cudnn.deterministic,
                       torch.backends.cudnn.benchmark, inductor_config.deterministic, cublas)
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas or CUBLAS_WORKSPACE  # a user's own value is kept
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        inductor_config.deterministic = True

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
