"""A torch.profiler trace of one training step (`logging.profile_step`), as torchtitan's profiling: a Chrome trace
(chrome://tracing, https://ui.perfetto.dev) and the kernels and operators that took the step's time, by total.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("moetune")

PHASE = "moetune."  # the prefix of the step's phases in a trace (forward, backward, optimizer, ...)


def phase(name: str):
    """A named range of the step (`moetune.<name>`) in a trace; without a profiler it costs a few microseconds."""
    return torch.profiler.record_function(PHASE + name)


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
        events = prof.key_averages()
        with open(base + "_top.txt", "w") as f:
            f.write(phase_table(events) + "\n\n")
            f.write(events.table(sort_by=by, row_limit=60, max_name_column_width=100))
        log.info("step %d: profiler trace in %s.json.gz, the top operators and kernels in %s_top.txt", step, base, base)


def phase_table(events) -> str:
    """The step's phases: host time (where the host waits, e.g. on a copy or a `.item()`, it is the wall time), the
    time of the kernels each launched, and on a GPU the span of its range on the device's timeline (kernels and the
    idle time between them; a torch.profiler trace has both a host and a device range per phase)."""
    host, kernels, span, calls = {}, {}, {}, {}
    for e in events:
        if not e.key.startswith(PHASE):
            continue
        name = e.key[len(PHASE):]
        device_us = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0))
        if e.cpu_time_total > 0 or name not in host:  # the host range (a device range has no host time)
            host[name], kernels[name], calls[name] = e.cpu_time_total, device_us, e.count
        if e.cpu_time_total == 0 and device_us > 0:
            span[name] = device_us
    lines = [f"{'phase':<24}{'calls':>6}{'host ms':>10}{'kernels ms':>12}{'GPU span ms':>13}"]
    for name in sorted(host, key=lambda n: -host[n]):
        lines.append(f"{name:<24}{calls[name]:>6}{host[name] / 1e3:>10.1f}{kernels[name] / 1e3:>12.1f}"
                     f"{span.get(name, 0.0) / 1e3:>13.1f}")
    return "\n".join(lines)
