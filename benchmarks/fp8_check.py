"""The FP8 frozen base on one GPU: kernels against their torch references, their speed against bf16, the logits
error against fp32 truth, and loss curves of a bf16 and an fp8 base.

    python benchmarks/fp8_check.py kernels      # GPU kernels vs references (incl. unaligned expert groups)
    python benchmarks/fp8_check.py speed        # fp8 linear / grouped GEMM fwd+dgrad vs bf16 at Air's shapes
    python benchmarks/fp8_check.py numerics     # logits error vs fp32 truth, AIR shapes, 3 layers, same weights
    python benchmarks/fp8_check.py curves       # 200 LoRA steps, bf16 vs fp8 base, AIR-8 shapes, fixed data
    python benchmarks/fp8_check.py transformers # whether transformers' own FP8 path can run here
Each part writes $OUT/fp8_<part>.json. BENCH_CPU=1: the same code on tiny shapes (a rehearsal).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

CPU = bool(os.environ.get("BENCH_CPU"))
DEV = torch.device("cpu" if CPU else "cuda")
OUT = os.environ.get("OUT", "/tmp")


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def save(part, obj):
    obj = dict(obj, date=time.strftime("%Y-%m-%d"), device=("cpu" if CPU else torch.cuda.get_device_name(0)),
               torch=torch.__version__)
    with open(os.path.join(OUT, f"fp8_{part}.json"), "w") as f:
        json.dump(obj, f, indent=1)
    print(part, json.dumps(obj), flush=True)


def kernels():
    from moetune.model.quant.fp8 import ROWWISE, quantize_rows
    from moetune.model.quant.matmul import (fp8_grouped_linear, fp8_linear, reference_fp8_dgrad,
                                            reference_fp8_grouped_linear, reference_fp8_linear, expert_of_rows)

    torch.manual_seed(0)
    M, K, N, E = (64, 64, 96, 4) if CPU else (2048, 1024, 1536, 8)
    res = {}
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w8, s = quantize_rows(torch.randn(N, K, device=DEV) * 0.02)
    bias = torch.randn(N, device=DEV, dtype=torch.bfloat16)
    y = fp8_linear(x, w8, s, ROWWISE, bias)
    g = torch.randn_like(y)
    y.backward(g)
    res["linear_fwd_vs_reference"] = rel(y, reference_fp8_linear(x.detach(), w8, s, bias))
    res["linear_dgrad_vs_reference"] = rel(x.grad, reference_fp8_dgrad(g, w8, s))
    w = w8.float() * s
    res["linear_fwd_vs_dequantised_fp32"] = rel(y, x.detach().float() @ w.t() + bias.float())
    res["linear_dgrad_vs_dequantised_fp32"] = rel(x.grad, g.float() @ w)
    # expert groups of every size, empty and unaligned ones included
    counts = torch.randint(0, 2 * M // E, (E,))
    counts[1] = 0
    counts[2] = 1
    offs = counts.cumsum(0).to(torch.int32).to(DEV)
    R = int(counts.sum())
    xr = torch.randn(R, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    we8, se = quantize_rows(torch.randn(E, N, K, device=DEV) * 0.02)
    yr = fp8_grouped_linear(xr, we8, se, offs, ROWWISE)
    gr = torch.randn_like(yr)
    yr.backward(gr)
    e = expert_of_rows(offs, R)
    wr = (we8.float() * se)[e]
    res["grouped_fwd_vs_reference"] = rel(yr, reference_fp8_grouped_linear(xr.detach(), we8, se, offs))
    res["grouped_fwd_vs_dequantised_fp32"] = rel(yr, torch.einsum("nk,nok->no", xr.detach().float(), wr))
    res["grouped_dgrad_vs_dequantised_fp32"] = rel(xr.grad, torch.einsum("no,nok->nk", gr.float(), wr))
    res["nan"] = any(v != v for v in res.values())
    # block-scaled GEMM through torch's scaled_mm (BlockWise1x128 activations, BlockWise128x128 weights), if it runs
    try:
        import torch.nn.functional as F

        from moetune.model.quant.fp8 import quantize_blocks

        wb8, sb = quantize_blocks(torch.randn(N, K, device=DEV) * 0.02, (128, 128))
        xq = x.detach().float().view(M, K // 128, 128)
        sx = (xq.abs().amax(-1) / 448).clamp(min=1e-12)
        x8 = (xq / sx.unsqueeze(-1)).to(torch.float8_e4m3fn).view(M, K)
        wbd = (wb8.float().view(N // 128, 128, K // 128, 128) * sb[:, None, :, None]).view(N, K)
        want = (x8.float().view(M, K // 128, 128) * sx.unsqueeze(-1)).view(M, K) @ wbd.t()
        layouts = {"a_outer_major,b_t": (sx.t().contiguous().t(), sb.t()),
                   "a_outer_major,b_t_contig": (sx.t().contiguous().t(), sb.t().contiguous()),
                   "a_contig,b_t": (sx.contiguous(), sb.t())}
        for lname, (sa_, sb_) in layouts.items():
            try:
                yb = F.scaled_mm(x8, wb8.t(), sa_, F.ScalingType.BlockWise1x128, sb_, F.ScalingType.BlockWise128x128,
                                 output_dtype=torch.bfloat16)
                res[f"block_scaled_mm[{lname}]_vs_dequantised"] = rel(yb, want)
            except Exception as ex:  # noqa: BLE001
                res[f"block_scaled_mm[{lname}]"] = f"{type(ex).__name__}: {str(ex)[:200]}"
    except Exception as ex:  # noqa: BLE001  (a probe: record why not)
        res["block_scaled_mm_error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
    save("kernels", res)


def _time(fn, n=20):
    for _ in range(3):
        fn()
    if not CPU:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    if not CPU:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / n


def _time_each(cands: dict) -> dict:
    """ms per call of each candidate, or why it did not run."""
    out = {}
    for k, f in cands.items():
        try:
            out[k] = round(_time(f) * 1e3, 4)
        except Exception as ex:  # noqa: BLE001  (a candidate that does not run is a finding, not a crash)
            out[k] = f"{type(ex).__name__}: {str(ex)[:120]}"
    return out


def speed():
    """Each GEMM of a frozen layer (forward, input gradient) at Air's shapes, every candidate compiled (so the
    activation quantisation fuses as in the compiled model): bf16, fp8 (dgrad with and without fast accumulation),
    and the just-in-time dequantised bf16 product; the weight transpose alone."""
    from moetune.model.experts import _grouped_mm
    from moetune.model.quant.fp8 import quantize_rows
    from moetune.model.quant.matmul import _gmm_dgrad, _gmm_fwd, _mm_dgrad, _mm_fwd

    cc = (lambda f: f) if CPU else (lambda f: torch.compile(f, dynamic=False))
    bf = torch.bfloat16
    res = {}
    shapes = {"q_proj 4096x4096->12288": (4096, 4096, 12288), "o_proj 4096x12288->4096": (4096, 12288, 4096),
              "shared gate 4096x4096->1408": (4096, 4096, 1408)}
    if CPU:
        shapes = {"tiny": (64, 64, 96)}
    for name, (M, K, N) in shapes.items():
        x = torch.randn(M, K, device=DEV, dtype=bf)
        w = torch.randn(N, K, device=DEV, dtype=bf) * 0.02
        w8, s = quantize_rows(w)
        g = torch.randn(M, N, device=DEV, dtype=bf)
        cands = {"bf16_fwd": cc(lambda: x @ w.t()), "bf16_dgrad": cc(lambda: g @ w),
                 "fp8_fwd": cc(lambda: _mm_fwd(x, w8, s, None)),
                 "fp8_dgrad_exact_accum": cc(lambda: _mm_dgrad(g, w8, s, False)),
                 "fp8_dgrad_fast_accum": cc(lambda: _mm_dgrad(g, w8, s, True)),
                 "dequant_bf16_dgrad": cc(lambda: g @ (w8.to(bf) * s.to(bf))),
                 "weight_transpose": cc(lambda: w8.t().contiguous())}
        if CPU:
            cands.pop("fp8_dgrad_fast_accum")
        res[name] = _time_each(cands)
    E, H, I, R = (8, 64, 32, 256) if CPU else (128, 4096, 1408, 32768)
    offs = torch.full((E,), R // E).cumsum(0).to(torch.int32).to(DEV)
    for name, (N, K) in {"experts gate_up": (2 * I, H), "experts down": (H, I)}.items():
        if CPU:
            break  # no fp8 grouped GEMM on the CPU
        x = torch.randn(R, K, device=DEV, dtype=bf)
        w = torch.randn(E, N, K, device=DEV, dtype=bf) * 0.02
        w8, s = quantize_rows(w)
        g = torch.randn(R, N, device=DEV, dtype=bf)
        cands = {"bf16_fwd": cc(lambda: _grouped_mm(x, w.transpose(-2, -1), offs=offs)),
                 "bf16_dgrad": cc(lambda: _grouped_mm(g, w, offs=offs)),
                 "fp8_fwd": cc(lambda: _gmm_fwd(x, w8, s, offs)),
                 "fp8_dgrad_exact_accum": cc(lambda: _gmm_dgrad(g, w8, s, offs, False)),
                 "fp8_dgrad_fast_accum": cc(lambda: _gmm_dgrad(g, w8, s, offs, True)),
                 "dequant_bf16_dgrad": cc(lambda: _grouped_mm(g, w8.to(bf) * s.to(bf), offs=offs)),
                 "weight_transpose": cc(lambda: w8.transpose(-2, -1).contiguous())}
        res[name] = _time_each(cands)
        del w, w8, x, g
    save("speed", res)


def _model(cfg, dtype, quantize=None, compile=False):
    from moetune.model.config import ModelConfig
    from moetune.model.hf_io import build_model, cast_model, init_weights
    from moetune.model.quant.fp8 import scheme_named
    from moetune.model.quant.modules import quantize_model
    from moetune.parallel.apply import apply_compile

    model = build_model(ModelConfig.from_hf_dict(cfg), "meta")
    cast_model(model, dtype)
    if quantize:
        quantize_model(model, scheme_named(quantize))
    if compile:
        apply_compile(model)
    model.to_empty(device=DEV)
    init_weights(model, 0.02, seed=0)
    return model


def _cfg(layers):
    from moetune.model.config import BUILTIN

    if CPU:
        return dict(BUILTIN["tiny"], num_hidden_layers=min(layers, 3))
    return dict(BUILTIN["glm45-air"], num_hidden_layers=layers)


def numerics():
    """Relative logits error against fp32 truth on the same random weights (AIR shapes, 3 layers: one dense, two
    MoE): our bf16 base, the fp8-stored weights dequantised (weight error alone), and the fp8 kernels (weights and
    activations in fp8), row-wise and 128x128 blocks."""
    cfg = _cfg(3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (2, 64 if CPU else 2048), generator=g).to(DEV)
    res = {}
    with torch.no_grad():
        truth = _model(cfg, torch.float32)(ids).float()
        torch.cuda.empty_cache() if not CPU else None
        for name, dtype, q in (("bf16", torch.bfloat16, None), ("fp8_rowwise", torch.bfloat16, "fp8"),
                               ("fp8_block_dequantised", torch.bfloat16, "fp8_block"),
                               ("fp8_rowwise_weights_only_fp32", torch.float32, "fp8")):
            m = _model(cfg, dtype, q)
            res[name] = rel(m(ids).float(), truth)
            del m
            if not CPU:
                torch.cuda.empty_cache()
    res["nan"] = any(v != v for v in res.values())
    save("numerics", res)


def curves():
    """200 LoRA (q,k,v,o) steps on 16 fixed packed sequences of random tokens (memorisation: the loss falls), AIR-8
    shapes, bf16 and fp8 base of the same random draw; AdamW lr 1e-3."""
    from moetune.model.lora import apply_lora
    from moetune.train.setup import init_lora

    cfg = _cfg(8)
    steps = 20 if CPU else 200
    g = torch.Generator().manual_seed(1)
    S = 64 if CPU else 1024
    data = torch.randint(0, min(1000, cfg["vocab_size"]), (16, S), generator=g).to(DEV)
    res = {}
    for name, q, dgrad in (("bf16", None, None), ("fp8", "fp8", "fp8"), ("fp8_dgrad_dequant", "fp8", "dequant")):
        from moetune.model.config import ModelConfig
        from moetune.model.hf_io import build_model, cast_model, init_weights
        from moetune.model.quant.fp8 import scheme_named
        from moetune.model.quant.modules import quantize_model
        from moetune.parallel.apply import apply_compile
        import moetune.model.quant.matmul as fp8_matmul

        if dgrad:
            fp8_matmul.DGRAD = dgrad
        torch._dynamo.reset()
        model = build_model(ModelConfig.from_hf_dict(cfg), "meta")
        cast_model(model, torch.bfloat16)
        if q:
            quantize_model(model, scheme_named(q))
        apply_lora(model, ["q_proj", "k_proj", "v_proj", "o_proj"], 16, 32)
        if not CPU:
            apply_compile(model)
        model.to_empty(device=DEV)
        init_weights(model, 0.02, seed=0)
        init_lora(model, seed=0)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-3)
        losses = []
        t = time.perf_counter()
        for step in range(steps):
            ids = data[(step % 4) * 4:(step % 4) * 4 + 4]
            labels = torch.roll(ids, -1, 1)
            labels[:, -1] = -100
            loss = model(ids, labels=labels) / (labels != -100).sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(round(float(loss), 5))
        res[name] = {"losses": losses, "final_mean_last10": sum(losses[-10:]) / 10, "mean_last50": sum(losses[-50:]) / len(losses[-50:]), "s": round(time.perf_counter() - t, 1)}
        del model, opt
        if not CPU:
            torch.cuda.empty_cache()
    for k in ("fp8", "fp8_dgrad_dequant"):
        res[f"final_ratio_{k}_over_bf16"] = res[k]["final_mean_last10"] / res["bf16"]["final_mean_last10"]
    save("curves", res)


def transformers_fp8():
    res = {}
    try:
        from transformers.utils import is_kernels_available

        res["kernels_package"] = bool(is_kernels_available())
        from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel

        load_finegrained_fp8_kernel()
        res["finegrained_fp8_kernel"] = "loaded"
    except Exception as ex:  # noqa: BLE001  (a probe: record why not)
        res["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
    save("transformers", res)


if __name__ == "__main__":
    parts = sys.argv[1:] or ["kernels", "speed", "numerics", "curves", "transformers"]
    fns = {"kernels": kernels, "speed": speed, "numerics": numerics, "curves": curves, "transformers": transformers_fp8}
    for p in parts:
        try:
            fns[p]()
        except Exception as ex:  # noqa: BLE001  one part's failure keeps the others' numbers
            import traceback

            traceback.print_exc()
            save(p, {"error": f"{type(ex).__name__}: {str(ex)[:500]}"})
