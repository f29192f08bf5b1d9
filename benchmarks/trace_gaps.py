"""Where the GPU waits: idle gaps of a profiled step's Chrome trace (benchmarks/train_throughput.py with
BENCH_TRACE=<folder>) and the host's ops that ran during them.

    python benchmarks/trace_gaps.py trace_ours_ep1_qkvo_4x1024.json.gz [--min-us 20]

Prints the GPU's busy and idle time over the step, the idle time by the host op (outermost Python-level op, and
the CUDA runtime call) that was running when each gap began, and the host-side synchronisations. `--calls REGEX`:
also each matching kernel's calls (count, total, min / median / max ms): whether a kernel is slow in every layer or
in some.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import statistics

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ", "cudaMemcpy\x00")


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def union(intervals) -> float:
    """Total length covered by (start, end) intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            total += (cur_e - cur_s) if cur_e is not None else 0.0
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + ((cur_e - cur_s) if cur_e is not None else 0.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--min-us", type=float, default=20.0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--calls", default=None, help="a regular expression over kernel names")
    ap.add_argument("--host", action="store_true",
                    help="also the host's time by outermost op, per thread (where a host-bound step spends it)")
    ap.add_argument("--chains", type=int, default=0,
                    help="also the idle time by the N innermost host ops at each gap's start, outer to inner")
    a = ap.parse_args()
    ev = [e for e in load(a.trace) if e.get("ph") == "X"]
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") in GPU_CATS)
    cpu = [e for e in ev if e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    rt = [e for e in ev if e.get("cat") == "cuda_runtime"]
    start, end = gpu[0][0], max(t for _, t in gpu)
    gaps, busy, cur_s, cur_e = [], 0.0, *gpu[0]
    sizes = collections.Counter()  # every gap by its size: the short ones are kernel boundaries, not the host
    bins = ((2, "< 2 us"), (5, "2-5 us"), (20, "5-20 us"), (float("inf"), ">= 20 us"))
    for s, e in gpu[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            if s - cur_e >= a.min_us:
                gaps.append((cur_e, s))
            label = next(name for bound, name in bins if s - cur_e < bound)
            sizes[label, "n"] += 1
            sizes[label, "us"] += s - cur_e
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = end - start
    print(f"GPU span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, idle {(span - busy) / 1e3:.1f} ms; "
          f"{len(gaps)} gaps >= {a.min_us:.0f} us total {sum(e - s for s, e in gaps) / 1e3:.1f} ms")
    print(f"  {len(gpu)} kernels, copies and sets; gaps by size: "
          + ", ".join(f"{name} {sizes[name, 'n']} ({sizes[name, 'us'] / 1e3:.1f} ms)" for _, name in bins))
    # several profiled steps (train_throughput.py's BENCH_PROFILE_STEPS): each one's host time and the GPU's work in it
    for step in sorted((e for e in cpu if e["name"].startswith("profiled step ")), key=lambda e: e["ts"]):
        t0, t1 = step["ts"], step["ts"] + step["dur"]
        inside = [(max(s, t0), min(e, t1)) for s, e in gpu if e > t0 and s < t1]
        print(f"  {step['name']}: host {step['dur'] / 1e3:.1f} ms, GPU busy {union(inside) / 1e3:.1f} ms, "
              f"first kernel after {(min(s for s, _ in inside) - t0) / 1e3 if inside else 0:.1f} ms")

    def covering(events, t):
        return [e for e in events if e["ts"] <= t < e["ts"] + e["dur"]]

    by_outer, by_inner, by_rt = collections.Counter(), collections.Counter(), collections.Counter()
    by_chain = collections.Counter()
    for s, e in gaps:
        ops = sorted(covering(cpu, s), key=lambda x: -x["dur"])
        outer = ops[0]["name"][:80] if ops else "(no host op)"
        inner = ops[-1]["name"][:80] if ops else "(no host op)"
        by_outer[outer] += e - s
        by_inner[inner] += e - s
        if a.chains:  # which compiled region or Python-level op the innermost one ran under
            by_chain[" > ".join(o["name"][:50] for o in ops[-a.chains:]) or "(no host op)"] += e - s
        r = covering(rt, s)
        by_rt[r[0]["name"][:60] if r else "(none)"] += e - s
    tables = [("outermost host op at the gap's start", by_outer), ("innermost host op", by_inner),
              ("CUDA runtime call at the gap's start", by_rt)]
    for title, c in tables + ([(f"{a.chains} innermost host ops, outer to inner", by_chain)] if a.chains else []):
        print(f"\nidle ms by {title}:")
        for name, us in c.most_common(a.top):
            print(f"  {us / 1e3:8.2f}  {name}")
    if a.host:
        host_time(cpu, a.top)
    syncs = collections.Counter(e["name"] for e in rt if e["name"].startswith(SYNCS) or "Synchronize" in e["name"])
    print("\nhost synchronisations:", dict(syncs))
    if a.calls:
        calls = collections.defaultdict(list)
        for e in ev:
            if e.get("cat") == "kernel" and re.search(a.calls, e["name"]):
                calls[e["name"]].append(e["dur"] / 1e3)
        print(f"\nkernels matching {a.calls!r}: calls, total ms, min / median / max ms a call")
        for name, d in sorted(calls.items(), key=lambda kv: -sum(kv[1])):
            print(f"  {len(d):4d} {sum(d):9.2f}  {min(d):.3f} / {statistics.median(d):.3f} / {max(d):.3f}  {name[:90]}")


def host_time(cpu, top: int) -> None:
    """Each thread's time in its outermost ops below the profiled steps (the forward's thread and autograd's)."""
    steps = [e for e in cpu if e["name"].startswith("profiled step ")]
    by_thread = collections.defaultdict(list)
    for e in cpu:
        if not e["name"].startswith("profiled step "):
            by_thread[e.get("tid")].append(e)
    for tid, evs in by_thread.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        outer, end = collections.Counter(), -1.0
        for e in evs:
            if e["ts"] >= end and any(s["ts"] <= e["ts"] < s["ts"] + s["dur"] for s in steps):
                outer[e["name"][:80]] += e["dur"]
                end = e["ts"] + e["dur"]
        total = sum(outer.values())
        if total < 1e3:
            continue
        print(f"\nhost thread {tid}: {total / 1e3:.1f} ms in outermost ops, by op:")
        for name, us in outer.most_common(top):
            print(f"  {us / 1e3:8.2f}  {name}")


if __name__ == "__main__":
    main()
