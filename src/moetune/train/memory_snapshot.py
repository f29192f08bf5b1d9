"""The CUDA caching allocator's history over one training step (`logging.memory_snapshot_step`), as torchtitan's
memory snapshot: a pickle that https://pytorch.org/memory_viz draws, and beside it what was live at the step's peak,
grouped by the code that allocated it (JSON) — where an estimate that misses the measured peak finds the tensors.
"""

from __future__ import annotations

import collections
import json
import linecache
import logging
import os
import pickle

import torch

log = logging.getLogger("moetune")

MAX_ENTRIES = 2_000_000  # allocator events kept; one step of a 46-layer model makes ~1e5


def frame_key(frames) -> str:
    """The innermost frame that says something: moetune's source, or Inductor's generated code (with its line)."""
    for f in frames:
        name = f.get("filename", "")
        if "/moetune/" in name or "torchinductor" in name or "/benchmarks/" in name:
            line = linecache.getline(name, f.get("line", 0)).strip()[:140]
            return f"{os.path.basename(name)}:{f.get('line')} {f.get('name')} | {line}"
    f = frames[0] if frames else {}
    return f"{os.path.basename(f.get('filename', '?'))}:{f.get('line')} {f.get('name')}"


def live_at_peak(snapshot) -> tuple[int, list]:
    """Replay the allocator's trace: (the peak of what was allocated during it, [(size, frames)] live at that peak).
    Counts a block freed when its free is requested, as torch.cuda.memory_allocated does."""
    events = [ev for trace in snapshot["device_traces"] for ev in trace]
    cur = peak = 0
    peak_at = -1
    sizes = {}
    for i, ev in enumerate(events):  # first pass: where the peak is
        if ev["action"] == "alloc":
            sizes[ev["addr"]] = ev.get("size", 0)
            cur += sizes[ev["addr"]]
            if cur > peak:
                peak, peak_at = cur, i
        elif ev["action"] == "free_requested" and ev["addr"] in sizes:
            cur -= sizes.pop(ev["addr"])
    live = {}
    for ev in events[:peak_at + 1]:  # second pass: what is live there
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev.get("size", 0), ev.get("frames", []))
        elif ev["action"] == "free_requested":
            live.pop(ev["addr"], None)
    return peak, list(live.values())


def summarize(snapshot, top: int = 30) -> dict:
    """What was allocated during the recorded span and live at its peak: totals per allocating line, largest blocks."""
    peak, blocks = live_at_peak(snapshot)
    groups = collections.defaultdict(lambda: [0, 0])
    for size, frames in blocks:
        g = groups[frame_key(frames)]
        g[0] += size
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    big = sorted(blocks, key=lambda b: -b[0])[:top]
    return dict(traced_above_start_gib=round(peak / 2**30, 3),
                groups=[dict(gib=round(v[0] / 2**30, 3), blocks=v[1], where=k) for k, v in ranked],
                largest=[dict(mib=round(s / 2**20, 1), bytes=s, where=frame_key(f)) for s, f in big])


class MemorySnapshot:
    """Records the allocator's history during step `step` (0: never) and writes it to `folder` when it ends."""

    def __init__(self, device: torch.device, step: int, folder: str, rank: int):
        self.on = device.type == "cuda" and step > 0
        self.device, self.step, self.folder, self.rank = device, step, folder, rank

    def begin(self, step: int) -> None:
        if self.on and step == self.step:
            torch.cuda.synchronize(self.device)
            self.start_gib = torch.cuda.memory_allocated(self.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")

    def end(self, step: int) -> None:
        if not (self.on and step == self.step):
            return
        torch.cuda.synchronize(self.device)
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        os.makedirs(self.folder, exist_ok=True)
        base = os.path.join(self.folder, f"memory_snapshot_step{step}_rank{self.rank}")
        with open(base + ".pickle", "wb") as f:
            pickle.dump(snap, f)
        summary = dict(step=step, allocated_at_start_gib=round(self.start_gib, 3),
                       step_peak_allocated_gib=round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3),
                       **summarize(snap))
        with open(base + ".json", "w") as f:
            json.dump(summary, f, indent=1)
        log.info("step %d: allocator history in %s.pickle (https://pytorch.org/memory_viz), live at the step's peak "
                 "(%.2f GiB over the %.2f allocated at its start) in %s.json", step, base,
                 summary["traced_above_start_gib"], summary["allocated_at_start_gib"], base)
