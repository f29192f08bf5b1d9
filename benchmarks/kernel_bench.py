"""What a kernel benchmark sets up before it imports Triton: with BENCH_CPU=1 a rehearsal on the CPU under Triton's
interpreter (which must be chosen before triton is imported), moetune's kernels let run there, and where results go.

    from kernel_bench import CPU, DEV, OUT   # first, in benchmarks/<name>.py run as a script
"""

from __future__ import annotations

import os
import sys

CPU = bool(os.environ.get("BENCH_CPU"))
if CPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from moetune.model import grouped_gemm_tiles  # noqa: E402

DEV = torch.device("cpu" if CPU else "cuda")
grouped_gemm_tiles.KERNEL_ON_CPU = CPU  # the rehearsal runs the kernels under the interpreter
OUT = os.environ.get("OUT", "/tmp")
