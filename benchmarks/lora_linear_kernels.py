"""A LoRA linear on a frozen weight, one op each way (model/lora.py's `lora_linear`), on the dense shapes of
GLM-4.7-Flash's MLA projections and Air's attention (4,096 tokens, rank 16), each way of adding LoRA's branch:
- bf16 base: added in place onto y (cuBLAS's beta = 1) against along the GEMM's reduction (lora.LORA_ALONG_K), and
  against the branch written first with the base GEMM added onto it (lora.LORA_FIRST, `first`);
- fp8 base (row scales, operands by the row kernel): cuBLAS's fp8 GEMM + the in-place add against the TMA kernel
  with the branch in its epilogue (quant.matmul.FP8_LORA_EPILOGUE).
Forward alone and forward + backward, GPU ms per call (the kernels' durations summed by torch.profiler), and the
output's and x's gradient's error against the other form's. Results to $OUT/lora_linear_kernels.json.

The op takes the branch inside the GEMM only where the output is much wider than the input (lora._wide_output);
EVERY_SHAPE=1 takes it there on every shape (how the rule was measured: the twenty-eighth session's call 2).

    python benchmarks/lora_linear_kernels.py            (one GPU)
    BENCH_CPU=1 python benchmarks/lora_linear_kernels.py   (a CPU rehearsal: tiny shapes, no TMA kernel)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from moetune.model import lora  # noqa: E402
from moetune.model.quant import matmul  # noqa: E402
from moetune.model.quant.fp8 import quantize_rows  # noqa: E402

CPU = os.environ.get("BENCH_CPU") == "1"
ROWS, RANK = (64, 16) if CPU else (4096, 16)
SHAPES = {  # name: (in, out)
    "flash_q_a": (2048, 768), "flash_q_b": (768, 5120), "flash_kv_a": (2048, 576), "flash_kv_b": (512, 8960),
    "flash_o": (5120, 2048), "air_q": (4096, 12288), "air_kv": (4096, 1024), "air_o": (12288, 4096),
}
if CPU:
    SHAPES = {"tiny_wide": (16, 256), "tiny_narrow": (128, 32)}


def timed(fn, repeats: int) -> float:
    """GPU time per call, ms: the kernels' own durations summed (torch.profiler), not the host's launches (eager
    launches of these ~10–50 µs kernels take longer than the kernels; in training the layers replay as CUDA graphs)."""
    if CPU:
        fn()
        return 0.0
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:  # the Chrome trace's device events, as benchmarks/trace_kernels.py
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return sum(e["dur"] for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")) / 1000 / repeats


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    assert err == err, "NaN in a comparison"
    return err


def case(name, n_in, n_out, fp8: bool, setting: str, repeats: int) -> dict:
    device = "cpu" if CPU else "cuda"
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(ROWS, n_in, device=device, generator=g).bfloat16().requires_grad_()
    w = torch.randn(n_out, n_in, device=device, generator=g) / n_in ** 0.5
    A = (torch.randn(RANK, n_in, device=device, generator=g) / n_in ** 0.5).bfloat16().requires_grad_()
    B = (torch.randn(n_out, RANK, device=device, generator=g) / RANK).bfloat16().requires_grad_()
    grad = torch.randn(ROWS, n_out, device=device, generator=g).bfloat16()
    lora.LORA_ALONG_K = setting == "along_k"
    lora.LORA_FIRST = setting == "first"
    if fp8:
        w8, scale = quantize_rows(w)
        matmul.FP8_LORA_EPILOGUE = setting == "epilogue"
        args = (w8, None, A, B, 2.0, scale, None)
    else:
        args = (w.bfloat16(), None, A, B, 2.0)

    def forward():
        with torch.no_grad():
            return lora.lora_linear(x, *args)

    def step():
        x.grad = A.grad = B.grad = None
        lora.lora_linear(x, *args).backward(grad)

    y = forward()
    step()
    with torch.no_grad():  # the branch's size beside the output's: a zero branch would make every form agree
        branch = 2.0 * (x.float() @ A.float().t()) @ B.float().t()
    return dict(shape=name, n_in=n_in, n_out=n_out, base="fp8" if fp8 else "bf16", setting=setting,
                y_norm=y.float().norm().item(), branch_norm=branch.norm().item(),
                along_k=lora.LORA_ALONG_K and lora._wide_output(ROWS, w, RANK) if not fp8 else None,
                epilogue=matmul.fp8_mm_lora_fits(x.detach(), w8, RANK, None) and lora._wide_output(ROWS, w, RANK)
                if fp8 else None,
                forward_ms=timed(forward, repeats), step_ms=timed(step, repeats),
                y=y, grads=(x.grad.clone(), A.grad.clone(), B.grad.clone()))


def main():
    out_dir = os.environ.get("OUT", "/tmp")
    matmul.DENSE_QUANT = "kernel"  # the row kernel, as where the layers replay as CUDA graphs (the op runs there)
    if os.environ.get("EVERY_SHAPE") == "1":
        lora._wide_output = lambda *a: True
    results = []
    for name, (n_in, n_out) in SHAPES.items():
        # the CPU rehearsal: torch's own fp8 GEMM, and no TMA kernel (the epilogue form adds its branch in place there)
        for fp8, settings in ((False, ("in_place", "along_k", "first")), (True, ("in_place", "epilogue"))):
            a, *others = (case(name, n_in, n_out, fp8, s, 20) for s in settings)
            for r in (a, *others):  # each against the in-place form (the in-place row: against the next)
                other = others[0] if r is a else a
                r.update(y_err_vs_other=rel_err(r["y"], other["y"]),
                         dx_err_vs_other=rel_err(r["grads"][0], other["grads"][0]),
                         y_differs=(r["y"] != other["y"]).float().mean().item())  # the share of elements
            for r in (a, *others):
                r.pop("y"), r.pop("grads")
                results.append(r)
                print(json.dumps(r), flush=True)
    with open(os.path.join(out_dir, "lora_linear_kernels.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name() if not CPU else "cpu", torch=torch.__version__,
                       rows=ROWS, rank=RANK, results=results), f, indent=1)
    print(f"{'shape':12} {'base':5} {'setting':9} {'fwd ms':>8} {'fwd+bwd ms':>10}  y err")
    for r in results:
        print(f"{r['shape']:12} {r['base']:5} {r['setting']:9} {r['forward_ms']:8.4f} {r['step_ms']:10.4f}  "
              f"{r['y_err_vs_other']:.2e}")


if __name__ == "__main__":
    main()
