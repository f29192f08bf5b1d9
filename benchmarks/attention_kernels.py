"""Attention kernels on the shapes our models train at: forward + backward per backend, one process.

    python benchmarks/attention_kernels.py            # writes $OUT/attention_kernels.json after every case
    BENCH_CPU=1 python benchmarks/attention_kernels.py  # a CPU rehearsal of the code paths on tiny shapes

Cases: GLM-4.7-Flash's MLA (20 heads, q·k over 256 dims = 192 nope + 64 rope, v 256) at 1 × 4096, one document and
4 packed documents; GLM-4.5-Air's GQA (96 query heads, 8 KV heads, head dim 128) at 4 × 1024 and 1 × 4096 packed.
Backends: SDPA as it chooses by itself, SDPA forced to flash / cuDNN / memory-efficient, FlexAttention (compiled,
causal or document-causal block mask). A backend that refuses a shape is a result ("error"), not a failure.
TFLOP/s counts the causal half: fwd 2·2·(S²/2)·H·(Dqk + Dv)/2 per row, backward 2.5× the forward.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.nn.functional as F

CPU = bool(os.environ.get("BENCH_CPU"))
DEV = "cpu" if CPU else "cuda"
OUT = os.environ.get("OUT", "/tmp")

# name: (batch, q heads, kv heads, seq, d_qk, d_v, documents per row)
CASES = {
    "flash_mla_1x4096": (1, 20, 20, 4096, 256, 256, 1),
    "flash_mla_1x4096_packed": (1, 20, 20, 4096, 256, 256, 4),
    "air_gqa_4x1024": (4, 96, 8, 1024, 128, 128, 1),
    "air_gqa_1x4096_packed": (1, 96, 8, 4096, 128, 128, 4),
}
if CPU:
    CASES = {k: (b, max(h // 10, 2), max(kv // 10, 1) if kv != h else max(h // 10, 2), 128, d // 8, dv // 8, docs)
             for k, (b, h, kv, s, d, dv, docs) in CASES.items()}


def flops(B, H, S, dqk, dv, docs):
    per_doc = S // docs
    pairs = docs * per_doc * (per_doc + 1) / 2  # causal (q, k) pairs per row
    fwd = 2 * B * H * pairs * (dqk + dv)
    return fwd, 2.5 * fwd


def run(fn, q, k, v, iters):
    def once():
        q.grad = k.grad = v.grad = None
        o = fn(q, k, v)
        o.backward(grad)

    with torch.no_grad():
        grad = torch.randn_like(fn(q, k, v))
    for _ in range(3):
        once()
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        once()
    sync()
    total = (time.perf_counter() - t) / iters
    for _ in range(2):
        with torch.no_grad():
            fn(q, k, v)
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        with torch.no_grad():
            fn(q, k, v)
    sync()
    return (time.perf_counter() - t) / iters, total


def sync():
    if not CPU:
        torch.cuda.synchronize()


def backends(B, H, KV, S, docs):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = KV != H

    def sdpa(backend=None):
        def f(q, k, v):
            if gqa and backend not in (None, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
                # these kernels take equal head counts: repeat K/V (what a caller would have to do)
                k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
                extra = {}
            else:
                extra = {"enable_gqa": gqa}
            if backend is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, **extra)
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, **extra)
        return f

    out = {}
    if docs == 1:
        out["sdpa_auto"] = sdpa()
        if not CPU:
            out["sdpa_flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
            out["sdpa_cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
            out["sdpa_efficient"] = sdpa(SDPBackend.EFFICIENT_ATTENTION)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    pos = torch.arange(S, device=DEV) % (S // docs)
    doc = (pos == 0).cumsum(0).expand(B, S)

    def doc_causal(b, h, q, kv):
        return (doc[b, q] == doc[b, kv]) & (q >= kv)

    mask = create_block_mask(doc_causal, B, None, S, S, device=DEV)
    flex = flex_attention if CPU else torch.compile(flex_attention, dynamic=False)
    out["flex"] = lambda q, k, v: flex(q, k, v, block_mask=mask, enable_gqa=gqa)
    if not CPU:
        for bm, bn in ((64, 64), (128, 64)):
            opts = {"BLOCK_M": bm, "BLOCK_N": bn}
            out[f"flex_{bm}x{bn}"] = (lambda o: lambda q, k, v: flex(q, k, v, block_mask=mask, enable_gqa=gqa,
                                                                     kernel_options=o))(opts)
    return out


def main():
    results = []
    iters = 2 if CPU else 10
    for name, (B, H, KV, S, dqk, dv, docs) in CASES.items():
        g = torch.Generator(device="cpu").manual_seed(0)
        mk = lambda h, d: (torch.randn(B, h, S, d, generator=g) * 0.5).to(DEV, torch.bfloat16).requires_grad_()
        q, k, v = mk(H, dqk), mk(KV, dqk), mk(KV, dv)
        fwd_flop, bwd_flop = flops(B, H, S, dqk, dv, docs)
        for bname, fn in backends(B, H, KV, S, docs).items():
            r = {"case": name, "backend": bname, "shape": [B, H, KV, S, dqk, dv, docs]}
            try:
                fwd_s, total_s = run(fn, q, k, v, iters)
                r.update(fwd_ms=round(fwd_s * 1e3, 3), fwd_bwd_ms=round(total_s * 1e3, 3),
                         fwd_tflops=round(fwd_flop / fwd_s / 1e12, 1),
                         fwd_bwd_tflops=round((fwd_flop + bwd_flop) / total_s / 1e12, 1))
            except Exception as e:  # a backend that refuses the shape
                r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            results.append(r)
            print(json.dumps(r), flush=True)
            with open(os.path.join(OUT, "attention_kernels.json"), "w") as f:
                json.dump({"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                           "device": "cpu" if CPU else torch.cuda.get_device_name(0), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
