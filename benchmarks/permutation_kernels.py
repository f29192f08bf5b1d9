"""The MoE layer's permutation on one GPU, apart from the GEMMs: each token's row copied once per routed expert and
sorted by expert (`experts.permute_rows`), each token's k rows summed back (`experts.unpermute`), forward and
backward, two ways:

- `autograd`: x[token_idx] and a [T, k, H] gather summed over k, backward by autograd (scatters into zeros) — what
  `model/experts.py` ran until the twelfth session (BENCHMARKS.md);
- `ours`: `model/experts.py` — both backwards gathers, every compiled sum of k rows written as k gathers added;
and, for the forward's sum alone, the Triton `bag_sum` kernel (`model/kernels.py`, the eager path).

    python benchmarks/permutation_kernels.py            # GPU: Air (EP-8 rank and AIR-8: 4,096 tokens × top-8,
                                                        # hidden 4096) and GLM-4.7-Flash (top-4, hidden 2048)
    BENCH_CPU=1 python benchmarks/permutation_kernels.py   # the same code on tiny shapes (a rehearsal)

Each case is compiled alone (torch.compile of the function, fullgraph), timed with CUDA events over 50 calls after
warm-up, and its host time per call measured beside it; results to $OUT/permutation_kernels.json after each case.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

from moetune.model import experts  # noqa: E402
from moetune.model.kernels import bag_sum  # noqa: E402

CPU = bool(os.environ.get("BENCH_CPU"))
DEV = torch.device("cpu" if CPU else "cuda")
OUT = os.environ.get("OUT", "/tmp")
SHAPES = {"air": dict(T=4096, k=8, H=4096, E=16), "flash": dict(T=4096, k=4, H=2048, E=64)}
if CPU:
    SHAPES = {"air": dict(T=64, k=8, H=64, E=16), "flash": dict(T=64, k=4, H=32, E=8)}


def autograd_permute_rows(x, perm):
    return x[perm.token_idx]


def autograd_unpermute(rows, perm, T):
    picked = rows[perm.inverse]
    return picked.view(T, -1, picked.shape[-1]).sum(dim=1)


MODES = {"autograd": (autograd_permute_rows, autograd_unpermute), "ours": (experts.permute_rows, experts.unpermute)}


def timed(fn, iters=50):
    """(GPU ms per call, host ms per call) after warm-up."""
    for _ in range(5):
        fn()
    if CPU:
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        ms = (time.perf_counter() - t0) / 3 * 1e3
        return ms, ms
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    host = (time.perf_counter() - t0) / iters * 1e3
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters, host


def routing(T, k, E):
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(T, E, generator=g) + torch.linspace(0, 0.3, E)  # mildly skewed, as trained routers are
    return experts.permute(scores.topk(k, dim=-1).indices.to(DEV), E)


def main():
    results = []
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "permutation_kernels.json")
    for name, s in SHAPES.items():
        T, k, H, E = s["T"], s["k"], s["H"], s["E"]
        perm = routing(T, k, E)
        x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        w = torch.rand(T * k, 1, device=DEV, dtype=torch.bfloat16)
        g = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
        rows = torch.randn(T * k, H, device=DEV, dtype=torch.bfloat16)
        ref = rows.float()[perm.inverse].view(T, k, H).sum(1)
        for mode, (permute_rows, unpermute) in MODES.items():
            torch._dynamo.reset()

            def f(x):
                return unpermute(permute_rows(x, perm) * w, perm, T)
            fc = torch.compile(f, fullgraph=True)
            summed = torch.compile(lambda r: unpermute(r, perm, T), fullgraph=True)

            def fwd_bwd():
                x.grad = None
                fc(x).backward(g)
            err = ((summed(rows).float() - ref).norm() / ref.norm()).item()
            for case, fn in (("sum_forward", lambda: summed(rows)), ("permute_unpermute_fwd_bwd", fwd_bwd)):
                gpu_ms, host_ms = timed(fn)
                bytes_moved = T * k * H * 2 * (1 if case == "sum_forward" else 4)  # the [T·k, H] passes, roughly
                results.append(dict(shape=name, mode=mode, case=case, gpu_ms=round(gpu_ms, 4),
                                    host_ms=round(host_ms, 4), tb_per_s=round(bytes_moved / gpu_ms / 1e9, 2),
                                    rel_err_sum=err))
                print(json.dumps(results[-1]), flush=True)
                json.dump(results, open(path, "w"), indent=1)
        if not CPU:
            gpu_ms, host_ms = timed(lambda: bag_sum(rows, perm.inverse.view(T, k)))
            results.append(dict(shape=name, mode="bag_sum", case="sum_forward", gpu_ms=round(gpu_ms, 4),
                                host_ms=round(host_ms, 4), tb_per_s=round(T * k * H * 2 / gpu_ms / 1e9, 2)))
            print(json.dumps(results[-1]), flush=True)
            json.dump(results, open(path, "w"), indent=1)


if __name__ == "__main__":
    main()
