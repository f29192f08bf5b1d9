"""What is live at a training step's memory peak: one step of a train_throughput.py variant under the CUDA
allocator's history, replayed to its peak; the live blocks there, largest first, with the frames that made them.

    python benchmarks/memory_peak.py ours_fp8_air_experts_1x4096_packed_ac --layers 4 [--eager]

Prints the step's peak (allocated) and the top blocks (MiB, shape guesses are the reader's: sizes in bytes are
given), grouped by the innermost frame of this repository or of Inductor's generated code (its source line
included), and the total per group. Each variant runs in its own process (a compile cache and an allocator of its
own); results to $OUT/memory_peak_<variant>.json. BENCH_CPU=1: the code path on the CPU (no allocator history).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))

import train_throughput as tt  # noqa: E402
from moetune.train.memory_snapshot import summarize  # noqa: E402

CPU = tt.CPU_DRY_RUN


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variant")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    stack, B, S, targets, extra = tt.VARIANTS[a.variant]
    extra = dict(extra)
    if a.layers:
        extra["layers"] = a.layers
    if a.eager:
        extra["compile"] = False
    tt.VARIANTS[a.variant] = (stack, B, S, targets, extra)
    if CPU:
        print(json.dumps(tt.worker(a.variant))[:300])
        return
    from moetune.model.config import BUILTIN

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    cfg = tt.air8(extra.get("layers", 8), extra.get("experts"))
    if "model" in extra:
        cfg = dict(BUILTIN[extra["model"]], **({"num_hidden_layers": a.layers} if a.layers else {}))
    model = tt.build_ours(cfg, targets, extra, dev)
    step = tt.ours_step_fn(model, targets is None)
    batch = tt.make_batch(B, S, cfg["vocab_size"], min(extra.get("docs", 1), S // 8), dev)
    for _ in range(3):
        step(*batch)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    step(*batch)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak_step = torch.cuda.max_memory_allocated()
    res = dict(variant=a.variant, layers=cfg["num_hidden_layers"], compiled=bool(extra.get("compile")),
               resident_before_step_gib=round(base / 2**30, 3), peak_allocated_gib=round(peak_step / 2**30, 3),
               **summarize(snap, a.top))
    print(f"{a.variant} layers={res['layers']} compiled={res['compiled']}: resident {res['resident_before_step_gib']} "
          f"GiB, step peak {res['peak_allocated_gib']} GiB, allocated during the step and live at its peak "
          f"{res['traced_above_start_gib']} GiB")
    for g in res["groups"]:
        print(f"  {g['gib']:8.3f} GiB {g['blocks']:5d} blocks  {g['where']}")
    print("  largest blocks:")
    for b in res["largest"][:15]:
        print(f"  {b['mib']:9.1f} MiB ({b['bytes']} B)  {b['where']}")
    out = os.environ.get("OUT")
    if out:
        tag = a.variant + ("_eager" if a.eager else "") + (f"_L{a.layers}" if a.layers else "")
        with open(os.path.join(out, f"memory_peak_{tag}.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
