"""Attention kernels on the shapes our models train at: forward + backward per backend, one process.

    python benchmarks/attention_kernels.py            # writes $OUT/attention_kernels.json after every case
    BENCH_CPU=1 python benchmarks/attention_kernels.py  # a CPU rehearsal of the code paths on tiny shapes

    ATTN_CASES="air_gqa_1x4096_packed air_gqa_1x4096_mixed" python benchmarks/attention_kernels.py  # some cases

Cases: GLM-4.7-Flash's MLA (20 heads, q·k over 256 dims = 192 nope + 64 rope, v 256) at 1 × 4096, one document, 4
packed documents and the demo's ~32-token documents; GLM-4.5-Air's GQA (96 query heads, 8 KV heads, head dim 128) at
4 × 1024 and 1 × 4096 packed (4 documents of 1,024, four unequal ones, 16 of 256).
Backends: one document: SDPA as it chooses by itself, SDPA forced to flash / cuDNN / memory-efficient. Packed rows:
FlexAttention (compiled; with Inductor's autotuning; and on the model's layout: q, k, v transposed views of
[B, S, heads, D] projections, the output transposed back — as is and made contiguous first), FlashAttention-2's
varlen kernel (with the documents' bound at the row's length, what the compiled model passes, and at the longest
document; and through the model's path), SDPA with the dense mask; with equal documents also cuDNN on the documents
as a batch (the bound a ragged kernel would have to match). Both: FlashAttention-4 (`flash-attn-4`) where installed
(packed rows: its varlen entry point, and through the model's path, `model_varlen_fa4`).
cuDNN's own ragged layout (aten._cudnn_attention_forward with cumulative lengths) was measured on 2026-12-02 and
dropped: 50-90 ms a call and wrong query gradients in torch 2.11. Every backend's output and query gradient are
compared with the dense document mask in fp32 (`err_out`, `err_dq`: relative L2; NaN fails).
A backend that refuses a shape is a result ("error"), not a failure.
TFLOP/s counts the causal half: fwd 2·2·(L²/2)·H·(Dqk + Dv)/2 per document, backward 2.5× the forward.
"""

from __future__ import annotations

import itertools
import json
import os
import time

import torch
import torch.nn.functional as F

CPU = bool(os.environ.get("BENCH_CPU"))
DEV = "cpu" if CPU else "cuda"
OUT = os.environ.get("OUT", "/tmp")

# name: (batch, q heads, kv heads, seq, d_qk, d_v, the documents' lengths in each row)
CASES = {
    "flash_mla_1x4096": (1, 20, 20, 4096, 256, 256, [4096]),
    "flash_mla_1x4096_packed": (1, 20, 20, 4096, 256, 256, [1024] * 4),
    "flash_mla_1x4096_demo": (1, 20, 20, 4096, 256, 256, [32] * 128),
    "air_gqa_4x1024": (4, 96, 8, 1024, 128, 128, [1024]),
    "air_gqa_1x4096_packed": (1, 96, 8, 4096, 128, 128, [1024] * 4),
    "air_gqa_1x4096_mixed": (1, 96, 8, 4096, 128, 128, [1536, 512, 1280, 768]),
    "air_gqa_1x4096_16docs": (1, 96, 8, 4096, 128, 128, [256] * 16),
    # where FlexAttention and FlashAttention-4's varlen kernel cross on Flash's heads (FA4 ahead at 1,024 tokens a
    # document, behind at 32: thirty-first session), for what `auto` could pick from a batch's documents
    "flash_mla_1x4096_64docs": (1, 20, 20, 4096, 256, 256, [64] * 64),
    "flash_mla_1x4096_32docs": (1, 20, 20, 4096, 256, 256, [128] * 32),
    "flash_mla_1x4096_16docs": (1, 20, 20, 4096, 256, 256, [256] * 16),
    "flash_mla_1x4096_8docs": (1, 20, 20, 4096, 256, 256, [512] * 8),
    "air_gqa_1x4096_64docs": (1, 96, 8, 4096, 128, 128, [64] * 64),
}
if CPU:
    CASES = {k: (b, max(h // 10, 2), max(kv // 10, 1) if kv != h else max(h // 10, 2), 128, d // 8, dv // 8,
                 [128 * n // s for n in docs]) for k, (b, h, kv, s, d, dv, docs) in CASES.items()}
if os.environ.get("ATTN_CASES"):
    CASES = {k: CASES[k] for k in os.environ["ATTN_CASES"].split()}


def flops(B, H, dqk, dv, docs):
    pairs = sum(n * (n + 1) / 2 for n in docs)  # causal (q, k) pairs per row
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


def position_ids(B, docs):
    return torch.cat([torch.arange(n) for n in docs]).expand(B, -1).to(DEV)


def backends(name, B, H, KV, S, docs):
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
    if len(docs) == 1:
        out["sdpa_auto"] = sdpa()
        if not CPU:
            out["sdpa_flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
            out["sdpa_cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
            out["sdpa_efficient"] = sdpa(SDPBackend.EFFICIENT_ATTENTION)
        out.update(fa4_backends(B, S, docs))
        return out
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from moetune.model.attention import attend, build_attn_meta, dense_document_mask, document_ids, document_starts
    from moetune.model.flash_attention_4 import flash_attention_4_installed

    pos = position_ids(B, docs)
    doc = document_ids(pos)

    def doc_causal(b, h, q, kv):
        return (doc[b, q] == doc[b, kv]) & (q >= kv)

    mask = create_block_mask(doc_causal, B, None, S, S, device=DEV)
    torch._dynamo.reset()  # a fresh compile per case: Dynamo's recompile limit would turn later cases eager
    flex = flex_attention if CPU else torch.compile(flex_attention, dynamic=False)
    out["flex"] = lambda q, k, v: flex(q, k, v, block_mask=mask, enable_gqa=gqa)
    dense = dense_document_mask(pos)  # every (q, k) pair of the row computed, the mask applied
    out["sdpa_dense_mask"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=gqa)
    out.update(fa4_backends(B, S, docs))
    if CPU:
        return out
    if name in os.environ.get("ATTN_AUTOTUNE", "").split():  # minutes of autotuning: the cases named only
        tuned = torch.compile(flex_attention, dynamic=False, mode="max-autotune-no-cudagraphs")
        out["flex_autotune"] = lambda q, k, v: tuned(q, k, v, block_mask=mask, enable_gqa=gqa)

    def flat(t):
        return t.transpose(1, 2).reshape(B * S, t.shape[1], t.shape[-1])

    def unflat(o):
        return o.view(B, S, H, -1).transpose(1, 2)

    cu = document_starts(pos)
    longest = max(docs)
    from torch.nn.attention.varlen import varlen_attn

    for bound, name in ((S, ""), (longest, "_tight")):
        out[f"varlen_fa2{name}"] = (lambda m: lambda q, k, v: unflat(varlen_attn(
            flat(q), flat(k), flat(v), cu, cu, m, m, window_size=(-1, 0))))(bound)
    # the model's paths, compiled as its layers are: padded document starts, the row's length as the bound
    meta = build_attn_meta(pos, "varlen")
    model_attend = torch.compile(attend, dynamic=False)
    out["model_varlen"] = lambda q, k, v: model_attend(q, k, v, meta)
    if flash_attention_4_installed():  # its varlen kernels as the model calls them (varlen_fa4: the custom op)
        fa4_meta = build_attn_meta(pos, "varlen_fa4")
        out["model_varlen_fa4"] = lambda q, k, v: model_attend(q, k, v, fa4_meta)

    # FlexAttention on the attention modules' layout (the projections write [B, S, heads, D]; attend() gets
    # transposed views and the output is transposed back for o_proj): the copies into that layout are paid by both
    # rows, so their difference is what the kernel's layout costs
    def model_layout(contiguous):
        def core(q, k, v):
            if contiguous:
                q, k, v = (t.contiguous() for t in (q, k, v))
            o = flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
            return o.transpose(1, 2).reshape(B, S, -1)
        compiled = torch.compile(core, dynamic=False)

        def f(q, k, v):
            views = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
            return compiled(*views).view(B, S, H, -1).transpose(1, 2)
        return f
    out["flex_model_layout"] = model_layout(False)
    out["flex_model_layout_contiguous"] = model_layout(True)
    if len(set(docs)) == 1:  # the documents as a batch: what a ragged kernel at best matches
        n = len(docs)

        def batched(q, k, v):
            def b(t):
                return t.reshape(B, t.shape[1], n, S // n, t.shape[-1]).transpose(1, 2).reshape(
                    B * n, t.shape[1], S // n, t.shape[-1])
            kk, vv = b(k).repeat_interleave(H // KV, 1), b(v).repeat_interleave(H // KV, 1)
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                o = F.scaled_dot_product_attention(b(q), kk, vv, is_causal=True)
            return o.reshape(B, n, H, S // n, -1).transpose(1, 2).reshape(B, H, S, -1)
        out["cudnn_batched"] = batched
    return out


def fa4_backends(B, S, docs):
    """FlashAttention-4 (`flash-attn-4`, CuTe DSL kernels; SM90 forward and backward up to head dim 256) where it is
    installed: q, k, v as the model's projections lay them out ([B, S, heads, D], here transposed views), one
    document causal, packed rows through its varlen entry point (cumulative starts, the longest document)."""
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except ImportError:
        return {}

    def bshd(t):
        return t.transpose(1, 2)

    if len(docs) == 1:
        return {"fa4": lambda q, k, v: bshd(flash_attn_func(bshd(q), bshd(k), bshd(v), causal=True)[0])}
    starts = torch.tensor([0, *itertools.accumulate(docs)], dtype=torch.int32, device=DEV)
    cu = torch.cat([starts[:-1] + b * S for b in range(B)] + [starts[-1:] + (B - 1) * S])
    longest = max(docs)

    def varlen(q, k, v):
        flat = [bshd(t).reshape(B * S, t.shape[1], t.shape[-1]) for t in (q, k, v)]
        o = flash_attn_varlen_func(*flat, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                   max_seqlen_k=longest, causal=True)[0]
        return o.view(B, S, q.shape[1], -1).transpose(1, 2)
    return {"fa4_varlen": varlen}


def reference(q, k, v, docs):
    """The dense document-causal mask in fp32 (math): output and the query's gradient for one fixed grad."""
    from moetune.model.attention import dense_document_mask

    B = q.shape[0]
    mask = dense_document_mask(position_ids(B, docs))
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, enable_gqa=kf.shape[1] != qf.shape[1])
    g = torch.randn(o.shape, generator=torch.Generator(device="cpu").manual_seed(1)).to(o.device)
    o.backward(g)
    return o.detach(), qf.grad, g


def rel(got, want):
    e = ((got.float() - want).norm() / want.norm()).item()
    return e if e == e else float("nan")


def main():
    results = []
    iters = 2 if CPU else 10
    for name, (B, H, KV, S, dqk, dv, docs) in CASES.items():
        g = torch.Generator(device="cpu").manual_seed(0)
        mk = lambda h, d: (torch.randn(B, h, S, d, generator=g) * 0.5).to(DEV, torch.bfloat16).requires_grad_()
        q, k, v = mk(H, dqk), mk(KV, dqk), mk(KV, dv)
        fwd_flop, bwd_flop = flops(B, H, dqk, dv, docs)
        try:
            ref = reference(q, k, v, docs)
            cands = backends(name, B, H, KV, S, docs)
        except Exception as e:  # the case's setup failed: say so and go on with the next case
            cands, r = {}, {"case": name, "error": f"{type(e).__name__}: {str(e)[:600]}"}
            results.append(r)
            print(json.dumps(r), flush=True)
        for bname, fn in cands.items():
            r = {"case": name, "backend": bname, "shape": [B, H, KV, S, dqk, dv, len(docs)]}
            try:
                if ref is not None:
                    q.grad = None
                    o = fn(q, k, v)
                    o.backward(ref[2].to(o.dtype))
                    r.update(err_out=rel(o, ref[0]), err_dq=rel(q.grad, ref[1]))
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
