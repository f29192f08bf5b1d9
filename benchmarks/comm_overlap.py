"""Whether an exchange's transfer can run beside the experts' persistent grouped GEMM on one GPU, and what leaving
SMs free for it costs the GEMM (model/grouped_gemm_tma.py's RESERVED_SMS).

    python benchmarks/comm_overlap.py        # one GPU; writes $OUT/comm_overlap.json after every case

On 2 × H200 an all-to-all issued beside torch's CUTLASS grouped GEMM did not run until the GEMM ended (BENCHMARKS.md,
"Several GPUs": overlap 0), presumably because the GEMM held every SM. NCCL moves an all-to-all's rows with copy
kernels of a few CTAs per peer (its channels), so a kernel of that shape stands in for it here, on a second stream: C
programs copying the bytes of one pipeline chunk of an EP-8 rank of GLM-4.5-Air (its rows leaving for the other
ranks). Its duration on one GPU is not NVLink's; what the case shows is whether it runs at the same time as the GEMM
(overlap = (t_gemm + t_copy − t_both) / t_copy: 1.0 completely hidden, 0 serialised), issued before the GEMM (a
chunk's dispatch while the previous chunk computes) and after it (a chunk's results going back while the next one
computes).

The GEMM: gate_up's forward of one chunk on an EP-8 rank of Air (16 experts, 2 × 1,408 × 4,096, the chunk's rows in
equal groups) through the persistent TMA kernel with RESERVED_SMS programs fewer than SMs.
BENCH_CPU=1: a rehearsal of the code on tiny shapes (Triton's interpreter; timings meaningless).
"""

from __future__ import annotations

import json
import os
import statistics
import time

from kernel_bench import CPU, DEV, OUT  # first: it chooses Triton's interpreter for BENCH_CPU=1

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from moetune.model import grouped_gemm_tma as tma  # noqa: E402
# an EP-8 rank of Air: 16 local experts; a chunk of 2: half of the ~32,768 (row, expert) pairs it receives; its sent
# rows: 4,096 tokens x 4.67 other ranks a token / 2 chunks, hidden 4,096 bf16 (~78 MB)
E, H, N2, PAIRS, SENT_ROWS = (3, 32, 48, 24, 16) if CPU else (16, 4096, 2816, 16384, 9564)
RESERVE = (0, 1) if CPU else (0, 16, 32)
COPY_PROGRAMS = (2,) if CPU else (16, 32)
# the stand-in's warps a program: 4 fits on an SM beside a GEMM program's registers; 16 (512 threads, NCCL's default
# thread count a channel) does not, as NCCL's kernels do not
COPY_WARPS = (4,) if CPU else (4, 16)
REPS = 2 if CPU else 60


@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
    """PROGRAMS programs striding over n elements: a copy of the shape NCCL's channel kernels have."""
    for start in range(tl.program_id(0) * BLOCK, n, PROGRAMS * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def copy(src, dst, programs: int, warps: int):
    _copy_kernel[(programs,)](src, dst, src.numel(), BLOCK=4096 if not CPU else 64, PROGRAMS=programs,
                              num_warps=warps)


def timed(*fns) -> list[float]:
    """Median ms of each fn over REPS rounds, the fns taking turns within a round (the clock's drift under the
    power limit falls on all of them alike); each call timed alone with CUDA events on the current stream (a fn joins
    its streams)."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(REPS):
        for fn, t in zip(fns, times):
            if CPU:
                start = time.perf_counter()
                fn()
                t.append(1e3 * (time.perf_counter() - start))
                continue
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            t.append(a.elapsed_time(b))
    return [statistics.median(t) for t in times]


def main():
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(PAIRS, H, generator=g) * 0.5).to(DEV, torch.bfloat16)
    w = (torch.randn(E, N2, H, generator=g) * 0.02).to(DEV, torch.bfloat16)
    offs = torch.tensor([PAIRS * (e + 1) // E for e in range(E)], dtype=torch.int32, device=DEV)
    src = torch.randn(SENT_ROWS, H, generator=g).to(DEV, torch.bfloat16)
    dst = torch.empty_like(src)
    side = torch.cuda.Stream() if not CPU else None
    results = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if not CPU else "cpu",
               "torch": torch.__version__, "experts": E, "pairs": PAIRS, "copy_MB": src.numel() * 2 / 1e6,
               "cases": []}

    def gemm():
        return tma.grouped_gemm_tma(x, w, offs, transpose=True, persistent=True)

    def both(first, second):
        """first() then second() on the host, the copy on the side stream; the current stream waits for both."""
        if CPU:
            return first(), second()
        side.wait_stream(torch.cuda.current_stream())
        for fn in (first, second):
            if fn is gemm:
                fn()
            else:
                with torch.cuda.stream(side):
                    fn()
        torch.cuda.current_stream().wait_stream(side)

    reference = gemm()
    for reserve in RESERVE:
        tma.RESERVED_SMS = reserve  # (the interpreter runs its own program count)
        assert torch.equal(gemm(), reference), reserve  # fewer programs, the same tiles: the same product
        for programs, warps in [(p, w) for p in COPY_PROGRAMS for w in COPY_WARPS]:
            def send():
                copy(src, dst, programs, warps)

            t_gemm, t_copy, t_copy_first, t_gemm_first = timed(gemm, lambda: both(send, lambda: None),
                                                               lambda: both(send, gemm), lambda: both(gemm, send))
            case = {"reserved_sms": reserve, "copy_programs": programs, "copy_warps": warps,
                    "gemm_ms": round(t_gemm, 4), "copy_ms": round(t_copy, 4)}
            for name, t_both in (("copy_first", t_copy_first), ("gemm_first", t_gemm_first)):
                case[f"{name}_ms"] = round(t_both, 4)
                case[f"{name}_overlap"] = round((t_gemm + t_copy - t_both) / t_copy, 3)
            results["cases"].append(case)
            print(json.dumps(case), flush=True)
            with open(os.path.join(OUT, "comm_overlap.json"), "w") as f:
                json.dump(results, f, indent=1)
    tma.RESERVED_SMS = 0


if __name__ == "__main__":
    main()
