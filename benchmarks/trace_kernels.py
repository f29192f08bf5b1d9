"""GPU time by kernel in Chrome traces written by train_throughput.py (BENCH_TRACE): two traces side by side, kernel by
kernel (Inductor's numbered kernels merged by name), with a coarse split by kind; or one layer's kernels in order.

    python3 benchmarks/trace_kernels.py A.json.gz B.json.gz [--top 60]     # totals, A beside B
    python3 benchmarks/trace_kernels.py A.json.gz --layer 10 [--min-us 8]   # layer 10's forward and backward in order

A layer's forward runs from its attention's forward kernel to the next layer's; its backward likewise between two
attention backward kernels (--fwd / --bwd name the kernels that mark them: cuDNN's by default)."""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import Counter, defaultdict

KINDS = (  # first match wins: Inductor's kernels are named after what they fuse ("..._grouped_mm_...")
    ("Inductor", ("triton_",)),
    ("attention", ("cudnn", "sdpa", "flash_attn", "flex_attention")),
    ("experts GEMM", ("_grouped_gemm", "grouped_mm", "GroupProblemShape")),
    ("dense GEMM", ("nvjet", "cublas", "gemm", "xmma", "cutlass")),
    ("Triton (ours)", ("_swiglu", "_gathered_rows", "_scaled_rows", "_bag_sum", "_k_major")),
    ("routing, sort", ("radix", "topk", "TopK", "scatter_gather", "fill_reverse")),
    ("memcpy, memset", ("Memcpy", "Memset")),
)


def kind(name: str) -> str:
    return next((k for k, keys in KINDS if any(s in name for s in keys)), "other")


def kernels(path: str) -> list[dict]:
    with gzip.open(path) if path.endswith(".gz") else open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                  key=lambda e: e["ts"])


def totals(events: list[dict]) -> tuple[dict, Counter]:
    ms, calls = defaultdict(float), Counter()
    for e in events:
        name = re.sub(r"_\d+$", "", e["name"])  # Inductor numbers each graph's kernels
        ms[name] += e["dur"] / 1e3
        calls[name] += 1
    return ms, calls


def side_by_side(a: str, b: str | None, top: int) -> None:
    runs = [totals(kernels(p)) for p in ([a, b] if b else [a])]
    for path, (ms, _) in zip([a, b], runs):
        by_kind = defaultdict(float)
        for name, t in ms.items():
            by_kind[kind(name)] += t
        print(f"{path}: {sum(ms.values()):.1f} ms busy;",
              ", ".join(f"{k} {v:.1f}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])))
    names = sorted(set().union(*(ms for ms, _ in runs)), key=lambda n: -max(ms.get(n, 0.0) for ms, _ in runs))
    for name in names[:top]:
        print(" | ".join(f"{ms.get(name, 0.0):8.2f} ms {calls.get(name, 0):5d}x" for ms, calls in runs), " ", name[:140])


def layer(path: str, index: int, fwd: str, bwd: str, min_us: float) -> None:
    events = kernels(path)
    for label, mark in (("forward", fwd), ("backward", bwd)):
        at = [i for i, e in enumerate(events) if mark in e["name"]]
        if len(at) < index + 2:
            raise SystemExit(f"{path}: {len(at)} kernels named like {mark!r}, fewer than layer {index} + 2")
        span = events[at[index]:at[index + 1]]
        print(f"== {label} of layer {index}: {sum(e['dur'] for e in span) / 1e3:.3f} ms in {len(span)} kernels")
        for e in span:
            if e["dur"] >= min_us:
                print(f"{e['dur']:8.1f} us  {e['name'][:120]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("other", nargs="?")
    ap.add_argument("--top", type=int, default=60)
    ap.add_argument("--layer", type=int)
    ap.add_argument("--min-us", type=float, default=0.0)
    ap.add_argument("--fwd", default="flash_fprop")
    ap.add_argument("--bwd", default="flash_bprop")
    args = ap.parse_args()
    if args.layer is not None:
        layer(args.trace, args.layer, args.fwd, args.bwd, args.min_us)
    else:
        side_by_side(args.trace, args.other, args.top)


if __name__ == "__main__":
    main()
