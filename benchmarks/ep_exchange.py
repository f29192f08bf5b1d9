"""The expert-parallel exchange on its own (2 GPUs, torchrun): all-to-all bandwidth for GLM-4.5-Air rows, the
grouped expert GEMMs of the rows a rank receives, and how much of the exchange hides under that compute when both
are issued together (the dispatcher's pipelining relies on it).

    torchrun --nproc-per-node 2 benchmarks/ep_exchange.py        # writes $OUT/ep_exchange.json on rank 0
    RESERVED_SMS=16 torchrun ...                                  # the experts' persistent GEMM leaves 16 SMs free

Rows: T tokens per rank × top-8 slots × hidden 4096 bf16, routed uniformly, so half of each rank's rows cross to
the other GPU. Bandwidth = bytes that leave the GPU / time. overlap = (t_comm + t_compute − t_both) / t_comm:
1.0 means the transfer is completely hidden by the GEMMs running beside it.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

H, I, K, E = 4096, 1408, 8, 128


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    from moetune.model import grouped_gemm_tma
    from moetune.model.experts import experts_forward

    grouped_gemm_tma.RESERVED_SMS = int(os.environ.get("RESERVED_SMS", 0))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(dev)
    n_local = E // world
    gate_up = torch.randn(n_local, 2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02
    down = torch.randn(n_local, H, I, device=dev, dtype=torch.bfloat16) * 0.02
    results = []
    for T in (1024, 4096, 16384):
        N = T * K
        rows = torch.randn(N, H, device=dev, dtype=torch.bfloat16)
        out = torch.empty_like(rows)
        splits = [N // world] * world
        counts = torch.full((n_local,), N // n_local, device=dev)
        offs = counts.cumsum(0).to(torch.int32)
        w = torch.rand(N, device=dev)

        def comm():
            dist.all_to_all_single(out, rows, splits, splits)

        def compute():
            experts_forward(rows, offs, w, gate_up, down)

        def both():
            work = dist.all_to_all_single(out, rows, splits, splits, async_op=True)
            experts_forward(rows, offs, w, gate_up, down)
            work.wait()

        t_comm, t_comp, t_both = timed(comm), timed(compute), timed(both)
        crossing = rows.numel() * rows.element_size() * (world - 1) / world
        results.append({"tokens_per_rank": T, "rows": N, "comm_ms": round(1e3 * t_comm, 3),
                        "bandwidth_GBps": round(crossing / t_comm / 1e9, 1), "compute_ms": round(1e3 * t_comp, 3),
                        "both_ms": round(1e3 * t_both, 3),
                        "overlap": round((t_comm + t_comp - t_both) / t_comm, 3)})
        if rank == 0:
            print(json.dumps(results[-1]), flush=True)
    if rank == 0 and os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "ep_exchange.json"), "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(dev),
                       "reserved_sms": grouped_gemm_tma.RESERVED_SMS,
                       "torch": torch.__version__, "results": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
