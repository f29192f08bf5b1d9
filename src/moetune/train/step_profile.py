"""A torch.profiler trace of one training step (`logging.profile_step`), as torchtitan's profiling: a Chrome trace
(chrome://tracing, https://ui.perfetto.dev) and the kernels and operators that took the step's time, by total.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("moetune")


class StepProfile:
    """Profiles step `step` (0: never) and writes its trace and tables to `folder` when it ends."""

    def __init__(self, device: torch.device, step: int, folder: str, rank: int):
        self.device, self.step, self.folder, self.rank = device, step, folder, rank
        self.prof = None

    def begin(self, step: int) -> None:
        if self.step <= 0 or step != self.step:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
        self.prof.__enter__()

    def end(self, step: int) -> None:
        if self.prof is None or step != self.step:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.prof.__exit__(None, None, None)
        prof, self.prof = self.prof, None
        os.makedirs(self.folder, exist_ok=True)
        base = os.path.join(self.folder, f"step{step}_rank{self.rank}")
        prof.export_chrome_trace(base + ".json.gz")  # torch gzips a .gz path itself
        by = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        with open(base + "_top.txt", "w") as f:
            f.write(prof.key_averages().table(sort_by=by, row_limit=60, max_name_column_width=100))
        log.info("step %d: profiler trace in %s.json.gz, the top operators and kernels in %s_top.txt", step, base, base)
