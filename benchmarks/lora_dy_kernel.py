"""LoRA's backward products of dy (model/lora_dy.py): the one-read Triton kernel at each launch config against
torch's two GEMMs (cuBLAS), on the dense shapes of Air's attention and GLM-4.7-Flash's MLA projections whose branch is
added (4,096 rows, rank 16): GPU ms per call (benchmarks/lora_linear_kernels.py's profiler timing) and the error of
both products against torch's. Results to $OUT/lora_dy_kernel.json; the fastest config over all shapes is printed
last as JSON (what the harness's DY_CONFIG takes).

    python benchmarks/lora_dy_kernel.py            (one GPU)
    BENCH_CPU=1 python benchmarks/lora_dy_kernel.py   (a CPU rehearsal: tiny shapes under Triton's interpreter)
"""

from __future__ import annotations

import json
import os
import sys

CPU = os.environ.get("BENCH_CPU") == "1"
if CPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from lora_linear_kernels import rel_err, timed  # noqa: E402

from moetune.model import grouped_gemm_tiles, lora_dy  # noqa: E402

ROWS, RANK = (40, 16) if CPU else (4096, 16)
SHAPES = {"air_q": 12288, "air_kv": 1024, "air_o": 4096, "flash_q_a": 768, "flash_kv_a": 576, "flash_o": 2048}
if CPU:
    SHAPES = {"tiny": 70}
# (BM, BN, num_warps, num_stages) x the programs the columns are split for
TILES = [(64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3), (256, 64, 8, 3), (128, 32, 4, 4), (256, 128, 8, 2)]
PROGRAMS = [132, 264, 528]
if CPU:
    TILES, PROGRAMS = [(16, 16, 1, 1)], [1, 264]


def main():
    out_dir = os.environ.get("OUT", "/tmp")
    grouped_gemm_tiles.KERNEL_ON_CPU = CPU
    device = "cpu" if CPU else "cuda"
    results = []
    for name, n in SHAPES.items():
        g = torch.Generator(device=device).manual_seed(0)
        dy = torch.randn(ROWS, n, device=device, generator=g).bfloat16()
        B = (torch.randn(n, RANK, device=device, generator=g) / RANK).bfloat16()
        h = torch.randn(ROWS, RANK, device=device, generator=g).bfloat16()
        want = lora_dy.dy_products_torch(dy, B, h, 2.0)
        results.append(dict(shape=name, n=n, form="torch", ms=timed(lambda: lora_dy.dy_products_torch(dy, B, h, 2.0),
                                                                     20)))
        print(json.dumps(results[-1]), flush=True)
        for (bm, bn, warps, stages) in TILES:
            for programs in PROGRAMS:
                lora_dy._CONFIG = dict(BM=bm, BN=bn, num_warps=warps, num_stages=stages)
                lora_dy._INTERPRETER_CONFIG = lora_dy._CONFIG
                lora_dy._TARGET_PROGRAMS = programs
                got = lora_dy.dy_products(dy, B, h, 2.0)
                results.append(dict(shape=name, n=n, form="kernel", BM=bm, BN=bn, num_warps=warps, num_stages=stages,
                                    programs=programs, err_h=rel_err(got[0], want[0]), err_b=rel_err(got[1], want[1]),
                                    ms=timed(lambda: lora_dy.dy_products(dy, B, h, 2.0), 20)))
                print(json.dumps(results[-1]), flush=True)
    with open(os.path.join(out_dir, "lora_dy_kernel.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name() if not CPU else "cpu", torch=torch.__version__, rows=ROWS,
                       rank=RANK, results=results), f, indent=1)
    torch_ms = {r["shape"]: r["ms"] for r in results if r["form"] == "torch"}
    totals = {}
    for r in results:
        if r["form"] == "kernel":
            assert max(r["err_h"], r["err_b"]) < 2e-2, f"the kernel's products differ from torch's: {r}"
            key = (r["BM"], r["BN"], r["num_warps"], r["num_stages"], r["programs"])
            totals[key] = totals.get(key, 0.0) + r["ms"]
    print(f"{'shape':11} {'torch ms':>9} {'best kernel ms':>15}  config")
    for name in SHAPES:
        best = min((r for r in results if r["shape"] == name and r["form"] == "kernel"), key=lambda r: r["ms"])
        print(f"{name:11} {torch_ms[name]:9.4f} {best['ms']:15.4f}  BM={best['BM']} BN={best['BN']} "
              f"warps={best['num_warps']} stages={best['num_stages']} programs={best['programs']}")
    key = min(totals, key=totals.get)
    print(f"all shapes: torch {sum(torch_ms.values()):.4f} ms, best one config {totals[key]:.4f} ms")
    print(json.dumps(dict(BM=key[0], BN=key[1], num_warps=key[2], num_stages=key[3], programs=key[4])))


if __name__ == "__main__":
    main()
