"""The frozen expert stacks' grouped GEMMs on one GPU: torch._grouped_mm (bf16) against the Triton kernel of
model/grouped_gemm.py (bf16), torch._scaled_grouped_mm row-wise fp8 (model/quant/matmul.py's path) and the Triton
kernel on the fp8 stack (W8A16) — forward and input gradient of gate_up and down, a sweep of tile configs.

    python benchmarks/grouped_gemm.py [flash] [air8] [air_ep8]    # default: all three, in that order
    SWEEP=full python benchmarks/grouped_gemm.py flash           # every BM/BN/BK/stages/warps combination that fits
    GG_KINDS=fp8,w8a8 python benchmarks/grouped_gemm.py air8     # only these Triton kinds (bf16 | fp8 W8A16 | w8a8)

Shapes: flash = GLM-4.7-Flash (64 experts, hidden 2048, moe_intermediate 1536, 4096 tokens × top-4 = 16,384 rows);
air8 = GLM-4.5-Air on one GPU (128 experts, hidden 4096, 1408, 4096 tokens × top-8 = 32,768 rows); air_ep8 = one
expert-parallel rank of 8 of Air (its 16 experts, the ~32,768 rows they get from 32,768 tokens × top-8 over 128).
Routing: top-k of random scores with a mild per-expert skew, rows sorted by expert (as the router gives).
Every result goes to $OUT/grouped_gemm.json as soon as it is measured (a run cut short keeps what it had).
BENCH_CPU=1: the same code on tiny shapes under Triton's interpreter (a rehearsal), plus a compile of the kernel for
sm_90 (wgmma, cp.async pipelining) when this Triton has the NVIDIA backend.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

from kernel_bench import CPU, DEV, OUT  # first: it chooses Triton's interpreter for BENCH_CPU=1

import torch  # noqa: E402

from moetune.model import grouped_gemm as gg  # noqa: E402
from moetune.model import grouped_gemm_tma as tma  # noqa: E402
from moetune.model.quant import matmul  # noqa: E402
from moetune.model.quant.fp8 import quantize_rows  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SWEEP = os.environ.get("SWEEP", "quick")
# which Triton kinds to sweep (torch's always run): bf16 | fp8 (W8A16) | w8a8 (pointer loads), tma | tma_w8a8 (TMA);
# tma_persistent: the TMA kinds asked for, again through the persistent kernel; copy: the K-major copies of the stacks;
# tma_rows: A's rows gathered in the kernel's loads against the gather written out first (run_rows)
KINDS = os.environ.get("GG_KINDS", "bf16,fp8,w8a8,tma,tma_w8a8,copy").split(",")

SHAPES = {  # experts here, all experts (routing), hidden, moe_intermediate, tokens, top-k
    "flash": dict(E=64, E_all=64, H=2048, I=1536, tokens=4096, k=4),
    "air8": dict(E=128, E_all=128, H=4096, I=1408, tokens=4096, k=8),
    "air_ep8": dict(E=16, E_all=128, H=4096, I=1408, tokens=32768, k=8),
}
CPU_SHAPES = {
    "flash": dict(E=4, E_all=4, H=64, I=48, tokens=24, k=2),
    "air_ep8": dict(E=3, E_all=8, H=32, I=40, tokens=20, k=3),
}

# (BM, BN, BK, stages, warps)
QUICK = gg.AUTOTUNE + [(128, 256, 64, 4, 8), (64, 256, 128, 3, 8)]
FULL = list(itertools.product((64, 128), (128, 256), (64, 128), (3, 4), (4, 8)))
CPU_CONFIGS = [(16, 16, 16, 1, 1), (32, 16, 32, 1, 1)]
SMEM_LIMIT = 227 * 1024  # an H100/H200's shared memory per block


def configs(kind: str, transpose: bool = True):
    """kind: bf16 | fp8 (W8A16) | w8a8; the W8A8 input gradient tries both operand orders (SWAP)."""
    fp8, w8a8 = kind == "fp8", kind == "w8a8"
    base = (CPU_CONFIGS if CPU else gg.AUTOTUNE_FP8[:4] if w8a8 and not transpose else gg.AUTOTUNE_FP8 if w8a8
            else {"quick": QUICK, "full": FULL}[SWEEP])
    out = []
    for BM, BN, BK, stages, warps in base:
        # an fp8 weight tile is converted to bf16 in registers and staged again in shared memory for the MMA
        extra = BK * BN * 2 if fp8 else 0
        smem = stages * BK * (BM + BN) if w8a8 else gg.smem_bytes(BM, BN, BK, stages, 1 if fp8 else 2) + extra
        if smem > SMEM_LIMIT:
            continue
        w8a8_dgrad = w8a8 and not transpose
        for swap in ((False, True) if fp8 or w8a8_dgrad else (False,)):
            for prefetch in ((False, True) if w8a8_dgrad else (False,)):
                out.append(dict(BM=BM, BN=BN, BK=BK, GROUP_M=8 if not CPU else 2, SWAP=swap, PREFETCH=prefetch,
                                num_warps=warps, num_stages=stages))
    return out


# ------------------------------------------------------------------------------------------------ helpers
def bench(fn) -> float:
    """Milliseconds per call (median)."""
    if CPU:
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    try:
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    except TypeError:  # older do_bench without return_mode
        return float(triton.testing.do_bench(fn, warmup=25, rep=100))


def errors(y: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (y.double() - ref.double())
    finite = bool(torch.isfinite(y).all())
    rel = (d.norm() / ref.double().norm().clamp(min=1e-30)).item()
    max_rel = (d.abs().max() / ref.double().abs().max().clamp(min=1e-30)).item()
    return dict(rel_err=rel if finite else float("nan"), max_rel_err=max_rel if finite else float("nan"),
                finite=finite)


def routing(E, E_all, tokens, k, seed=0):
    """offs over this GPU's E experts (the first E of E_all) for top-k of random scores with a mild skew."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    scores = torch.randn(tokens, E_all, generator=g) + 0.3 * torch.randn(E_all, generator=g)
    flat = scores.topk(k, dim=-1).indices.reshape(-1)
    flat = flat[flat < E]
    flat = flat[torch.argsort(flat, stable=True)]
    counts = torch.zeros(E, dtype=torch.long).scatter_add_(0, flat, torch.ones_like(flat))
    return counts.cumsum(0).to(torch.int32).to(DEV), counts


def save(results):
    obj = dict(results=results, date=time.strftime("%Y-%m-%d %H:%M"), sweep=SWEEP,
               device=("cpu (interpreter)" if CPU else torch.cuda.get_device_name(0)), torch=torch.__version__,
               triton=getattr(gg.triton, "__version__", None))
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "grouped_gemm.json"), "w") as f:
        json.dump(obj, f, indent=1)


def run_copies(fp8, shape_res):
    """The input gradient's K-major copy of each fp8 stack where none is kept: torch's transpose, Inductor's (as
    quant.matmul.K_MAJOR_COPY "compiled" calls it) and the copy kernel at two tile sizes; GB/s counts read + write."""
    from moetune.model.kernels import compiled_for_eager

    out = shape_res["k_major_copy"] = {}
    for name, (w8, _) in fp8.items():
        want = w8.transpose(-2, -1).contiguous()
        gbytes = 2 * w8.numel() / 1e9
        tiles = (tma.K_MAJOR_TILE, 64) if not CPU else (tma.K_MAJOR_TILE,)
        methods = [("torch", lambda: tma.k_major_copy_reference(w8)),
                   ("compiled", lambda: compiled_for_eager(tma.k_major_copy_reference)(w8))]
        methods += [(f"triton_{t}", lambda t=t: tma.k_major_copy(w8, t)) for t in tiles]
        for method, fn in methods:
            try:
                same = torch.equal(fn().view(torch.uint8), want.view(torch.uint8))
                ms = bench(fn)
                r = dict(ms=ms, gb_per_s=gbytes / ms * 1e3, equal=same)
            except Exception as e:  # noqa: BLE001 — a method that does not run here is a result too
                r = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            out[f"{name}_{method}"] = r
            print(f"    copy {name:8s} {method:12s} " + (f"{r['ms']:.3f} ms {r['gb_per_s']:.0f} GB/s equal={same}"
                                                         if "ms" in r else r["error"]), flush=True)


# ------------------------------------------------------------------------------------------------ one shape
def run_shape(name, p, results):
    torch.manual_seed(0)
    E, H, I = p["E"], p["H"], p["I"]
    offs, counts = routing(E, p["E_all"], p["tokens"], p["k"])
    R = int(counts.sum())
    shape_res = dict(shape=p, rows=R, rows_per_expert_min=int(counts.min()), rows_per_expert_max=int(counts.max()),
                     ops={})
    results[name] = shape_res
    print(f"== {name}: E={E} H={H} I={I} rows={R} (per expert {int(counts.min())}..{int(counts.max())})", flush=True)
    bf16 = torch.bfloat16
    weights = {"gate_up": (torch.randn(E, 2 * I, H, device=DEV) * 0.02).to(bf16),
               "down": (torch.randn(E, H, I, device=DEV) * 0.02).to(bf16)}
    fp8 = {n: quantize_rows(w) for n, w in weights.items()}  # e4m3 [E, out, in], fp32 scales [E, out, 1]
    fp8_kernels = (not CPU and hasattr(torch, "_scaled_grouped_mm")
                   and torch.cuda.get_device_capability() >= (8, 9))
    if "copy" in KINDS:
        run_copies(fp8, shape_res)
    ops = [("gate_up_fwd", "gate_up", True), ("down_fwd", "down", True),
           ("gate_up_dgrad", "gate_up", False), ("down_dgrad", "down", False)]
    for op, wname, transpose in ops:
        W = weights[wname]
        w8, s8 = fp8[wname]
        n_out, n_in = W.shape[1:]
        K, N = (n_in, n_out) if transpose else (n_out, n_in)
        a = torch.randn(R, K, device=DEV, dtype=bf16)
        flop = 2.0 * R * K * N
        ref = gg.grouped_mm_reference(a.float(), W, offs, None, transpose)  # fp32 on the bf16 weight
        ref8 = gg.grouped_mm_reference(a.float(), w8, offs, s8, transpose)  # fp32 on the dequantised fp8 weight
        res = dict(M=R, N=N, K=K, gflop=flop / 1e9, methods={})
        shape_res["ops"][op] = res

        def record(method, fn, reference, **extra):
            try:
                y = fn()
                ms = bench(fn)
                r = dict(ms=ms, tflops=flop / ms / 1e9, **errors(y, reference), **extra)
            except Exception as e:  # noqa: BLE001 — a method that does not run here is a result too
                r = dict(error=f"{type(e).__name__}: {str(e)[:300]}", **extra)
            res["methods"][method] = r
            return r

        # torch: _grouped_mm on the bf16 stack (the input gradient reads the stack as stored, as its autograd does)
        mat2 = W.transpose(-2, -1) if transpose else W
        record("torch_bf16", lambda: torch._grouped_mm(a, mat2, offs=offs), ref)
        # torch row-wise fp8 (activation quantised per row inside; the input gradient folds the weight's scales into
        # dy, quantises it and makes a K-major copy of the stack, as model/quant/matmul.py does)
        if fp8_kernels:
            if transpose:
                record("torch_fp8", lambda: matmul._gmm_fwd(a, w8, s8, offs), ref8)
                aq, sa = quantize_rows(a)
                record("torch_fp8_gemm_only", lambda: torch._scaled_grouped_mm(
                    aq, w8.transpose(-2, -1), scale_a=sa.view(-1), scale_b=matmul._row_scales(s8), offs=offs,
                    out_dtype=bf16, use_fast_accum=matmul.FAST_ACCUM_FORWARD), ref8)
            else:
                record("torch_fp8", lambda: matmul._gmm_dgrad(a, w8, s8, offs), ref8)
        else:
            res["methods"]["torch_fp8"] = dict(error="no torch._scaled_grouped_mm / fp8 tensor cores here")
        # Triton: the sweep, then the module's own (autotuned) path; "w8a8": fp8 activations × the fp8 stack, the
        # activation quantised beforehand (as torch_fp8_gemm_only); for the input gradient dy with the weight's
        # scales folded in, then quantised (as model/quant/matmul.py does), the stack read as stored
        kinds = [("bf16", (W, None, ref)), ("fp8", (w8, s8, ref8))]
        if transpose:
            aq, sa = quantize_rows(a)
            kinds.append(("w8a8", (w8, s8, ref8)))
        else:
            aq, sa = matmul._gmm_dgrad_operand(a, s8, offs)
            kinds.append(("w8a8", (w8, None, ref8)))
        run_tma(res, record, a, W, w8, s8, offs, transpose, ref, ref8)
        if "tma_rows" in KINDS and op in ("gate_up_fwd", "down_dgrad"):
            run_rows(res, record, a, W, offs, transpose, p["k"])
        for kind, (w, s, reference) in [k for k in kinds if k[0] in KINDS]:
            best = None
            w8a8 = dict(x_scale=sa) if kind == "w8a8" else {}
            x_in = aq if kind == "w8a8" else a
            for cfg in configs(kind, transpose):
                tag = "{BM}x{BN}x{BK}_s{num_stages}_w{num_warps}".format(**cfg) + ("_swap" if cfg["SWAP"] else "") \
                    + ("_pf" if cfg["PREFETCH"] else "")
                r = record(f"triton_{kind}[{tag}]", lambda: gg.grouped_gemm(x_in, w, offs, s, transpose, config=cfg,
                                                                             **w8a8),
                           reference, config=cfg)
                if "ms" in r and r["finite"] and (best is None or r["ms"] < best[1]["ms"]):
                    best = (tag, r)
            if best is not None:
                res["methods"][f"triton_{kind}"] = dict(best[1], best_config=best[0])
            if not CPU:
                record(f"triton_{kind}_autotuned", lambda: gg.grouped_gemm(x_in, w, offs, s, transpose, **w8a8),
                       reference)
        save(results)
        line = [f"{op:14s} M={R} N={N} K={K}"]
        for m in ("torch_bf16", "triton_bf16", "triton_bf16_autotuned", "tma_bf16", "tma_bf16_autotuned",
                  "torch_fp8", "torch_fp8_gemm_only", "torch_fp8_on_copy", "triton_fp8", "triton_fp8_autotuned",
                  "triton_w8a8", "triton_w8a8_autotuned", "tma_w8a8", "tma_w8a8_autotuned", "tma_w8a8_nmajor",
                  "tma_w8a8_nmajor_bytes", "tma_bf16_persistent", "tma_w8a8_persistent", "tma_w8a8_nmajor_persistent",
                  "tma_w8a8_nmajor_bytes_persistent", "tma_bf16_rows", "tma_bf16_gather_then_gemm", "gather_only"):
            r = res["methods"].get(m)
            if r and "ms" in r:
                line.append(f"{m} {r['ms']:.3f} ms {r['tflops']:.0f} TF/s err {r['rel_err']:.1e}"
                            + (f" [{r['best_config']}]" if "best_config" in r else ""))
            elif r:
                line.append(f"{m} {r['error'][:80]}")
        print("\n    ".join(line), flush=True)
        del a, ref, ref8
    del weights, fp8
    if not CPU:
        torch.cuda.empty_cache()


# (BM, BN, BK, stages, warps)
TMA_QUICK = [(128, 128, 64, 4, 8), (128, 256, 64, 3, 8), (64, 128, 64, 4, 4), (64, 256, 64, 4, 8),
             (128, 64, 64, 4, 4), (128, 128, 64, 3, 4), (128, 256, 64, 4, 8), (256, 128, 64, 3, 8), (64, 64, 64, 4, 4)]
TMA_QUICK_FP8 = [(128, 128, 128, 4, 8), (128, 256, 128, 3, 8), (64, 128, 128, 4, 4), (64, 256, 128, 4, 8),
                 (128, 64, 128, 4, 4), (128, 128, 64, 4, 8), (128, 256, 128, 4, 8), (256, 128, 128, 3, 8),
                 (64, 64, 128, 4, 4)]
CPU_TMA = [(16, 16, 16, 1, 1)]
# the stack as stored runs as the transposed product (the MMA's M is BN, its N the rows' BM): the stack's tile is
# read from shared memory byte by byte into registers, a cost per BN × BK tile that larger row tiles (BM) amortise
TMA_NMAJOR_FP8 = [(128, 256, 128, 3, 8), (128, 128, 128, 3, 8), (256, 128, 128, 3, 8), (256, 128, 128, 4, 8),
                  (256, 128, 64, 4, 8), (256, 64, 128, 3, 4), (256, 64, 128, 4, 4)]
if os.environ.get("GG_TMA_CONFIGS") == "fixed":  # the module's launch configs only
    _f = lambda c: [(c["BM"], c["BN"], c["BK"], c["num_stages"], c["num_warps"])]  # noqa: E731
    TMA_QUICK, TMA_QUICK_FP8, TMA_NMAJOR_FP8 = _f(tma.TMA_CONFIG), _f(tma.TMA_CONFIG_FP8), _f(tma.TMA_CONFIG_FP8_SWAP)


def run_tma(res, record, a, W, w8, s8, offs, transpose, ref, ref8):
    """The TMA kernel (model/grouped_gemm_tma.py): a bf16 stack (forward, and the input gradient read as stored), and
    fp8 × fp8 (forward; the input gradient on a K-major copy of the stack made beforehand, as torch's
    `_scaled_grouped_mm` on the same copy, "torch_fp8_on_copy"; and on the stack as stored, "tma_w8a8_nmajor").
    A sweep of launch configs (GG_TMA_CONFIGS=fixed: the module's own); `ref`, `ref8`: the fp32 products on the bf16
    and on the dequantised fp8 stack."""
    cands = []
    if "tma" in KINDS and (CPU or tma.tma_supported(a, W, transpose)):
        cands.append(("tma_bf16", a, W, None, transpose, {}, ref, CPU_TMA if CPU else TMA_QUICK))
    if "tma_w8a8" in KINDS and w8 is not None:
        if transpose:
            aq, sa = quantize_rows(a)
            cands.append(("tma_w8a8", aq, w8, s8, True, dict(x_scale=sa), ref8, CPU_TMA if CPU else TMA_QUICK_FP8))
        else:
            gq, sg = matmul._gmm_dgrad_operand(a, s8, offs)
            copy = w8.transpose(-2, -1).contiguous()
            cands.append(("tma_w8a8", gq, copy, None, True, dict(x_scale=sg), ref8,
                          CPU_TMA if CPU else TMA_QUICK_FP8))
            # the stack as stored (N-major: Triton transposes each tile on chip), no copy
            cands.append(("tma_w8a8_nmajor", gq, w8, None, False, dict(x_scale=sg), ref8,
                          CPU_TMA if CPU else TMA_NMAJOR_FP8))
            # the stack's tile moved byte by byte (before grouped_gemm_tma.TMA_SWAP_PAIRS)
            cands.append(("tma_w8a8_nmajor_bytes", gq, w8, None, False, dict(x_scale=sg, pairs=False), ref8,
                          CPU_TMA if CPU else TMA_NMAJOR_FP8))
            if not CPU and hasattr(torch, "_scaled_grouped_mm"):
                ones = torch.ones(copy.shape[0], copy.shape[1], device=DEV, dtype=torch.float32)
                record("torch_fp8_on_copy", lambda: torch._scaled_grouped_mm(
                    gq, copy.transpose(-2, -1), scale_a=sg.view(-1), scale_b=ones, offs=offs,
                    out_dtype=torch.bfloat16, use_fast_accum=matmul.FAST_ACCUM_DGRAD), ref8)
    if "tma_persistent" in KINDS:  # the same GEMMs through the persistent kernel (a program an SM, loops flattened)
        cands += [(kind + "_persistent", x, w, s, tr, dict(extra, persistent=True), reference, base)
                  for kind, x, w, s, tr, extra, reference, base in list(cands)]
    for kind, x, w, s, tr, extra, reference, base in cands:
        best = None
        for BM, BN, BK, stages, warps in base:
            if stages * BK * (BM + BN) * x.element_size() > SMEM_LIMIT:
                continue
            if not tr and w.shape[1] % BK:
                continue
            cfg = dict(BM=BM, BN=BN, BK=BK, GROUP_M=8 if not CPU else 2, num_warps=warps, num_stages=stages)
            tag = f"{BM}x{BN}x{BK}_s{stages}_w{warps}"
            r = record(f"{kind}[{tag}]", lambda: tma.grouped_gemm_tma(x, w, offs, s, tr, config=cfg, **extra),
                       reference, config=cfg)
            if "ms" in r and r["finite"] and (best is None or r["ms"] < best[1]["ms"]):
                best = (tag, r)
        if best is not None:
            res["methods"][kind] = dict(best[1], best_config=best[0])


def run_rows(res, record, a, W, offs, transpose, k):
    """The permutation's gather inside the TMA kernel's loads (`a_rows`, experts.GATHER_IN_GEMM: gate_up's forward
    reads the tokens, down's input gradient the tokens' gradient) against the gather written out and then the kernel
    (as the model runs it without), and the gather alone: the module's launch config, persistent. Each of R/k tokens
    is read by ~k rows at random, as a top-k routing reads them."""
    if not (CPU or tma.tma_supported(a, W, transpose)):
        return
    tokens = max(1, a.shape[0] // k)
    idx = torch.randint(0, tokens, (a.shape[0],), generator=torch.Generator().manual_seed(1)).to(DEV)
    src = a[:tokens].contiguous()
    reference = gg.grouped_mm_reference(src[idx].float(), W, offs, None, transpose)
    cfg = dict(tma.TMA_CONFIG) if not CPU else None
    record("tma_bf16_rows", lambda: tma.grouped_gemm_tma(src, W, offs, None, transpose, config=cfg, persistent=True,
                                                         a_rows=idx), reference)
    record("tma_bf16_gather_then_gemm", lambda: tma.grouped_gemm_tma(src[idx], W, offs, None, transpose, config=cfg,
                                                                     persistent=True), reference)
    record("gather_only", lambda: src[idx], src[idx])


# ------------------------------------------------------------------------------------------------ CPU: sm_90 compile
def compile_check() -> dict:
    """Compile the kernel for sm_90 without a GPU (this Triton's NVIDIA backend and ptxas): that it lowers to wgmma
    with cp.async pipelining for each variant, and the shared memory it takes. Specialisations as the launcher gets
    them on a GPU (16-divisible pointers/strides, unit inner strides)."""
    import subprocess

    code = r'''
import json, os
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moetune.model.grouped_gemm import _grouped_gemm_kernel as k
out = {}
for wdt, scale, transpose, swap, prefetch in [
        ("bf16", 0, True, False, False), ("bf16", 0, False, False, False), ("fp8e4nv", 1, True, False, False),
        ("fp8e4nv", 2, False, False, False), ("fp8e4nv", 1, True, True, False), ("fp8e4nv", 2, False, True, False),
        ("fp8e4nv", 3, True, False, False), ("fp8e4nv", 4, False, False, False), ("fp8e4nv", 4, False, True, False),
        ("fp8e4nv", 4, False, False, True)]:
    ones = ["stride_ak", "stride_cn", "stride_ss", "stride_bk" if transpose else "stride_bn"]
    const = dict({n: 1 for n in ones}, E_POW2=128, SCALE=scale, DOT_FP32=False, BM=128, BN=128,
                 BK=128 if scale >= 3 else 64, GROUP_M=8, SWAP=swap,
                 PREFETCH=prefetch)
    sig = {}
    for n in k.arg_names:
        sig[n] = ("constexpr" if n in const else {"a_ptr": "*fp8e4nv" if scale >= 3 else "*bf16", "b_ptr": "*" + wdt,
                  "c_ptr": "*bf16", "scale_ptr": "*fp32", "ascale_ptr": "*fp32", "offs_ptr": "*i32"}.get(n, "i32"))
    div16 = ["a_ptr", "b_ptr", "c_ptr", "scale_ptr", "ascale_ptr", "offs_ptr", "N", "K", "stride_am", "stride_be",
             "stride_bk", "stride_bn", "stride_cm", "stride_se"]
    src = ASTSource(k, sig, constexprs={(k.arg_names.index(n),): v for n, v in const.items()},
                    attrs={(k.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16 if n not in const})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=4))
    ttgir = c.asm["ttgir"]
    kind = "fwd" if transpose else "dgrad"
    out[f"{wdt} scale={scale} {kind}{' swap' if swap else ''}{' prefetch' if prefetch else ''}"] = dict(
        shared_bytes=c.metadata.shared, wgmma=ttgir.count("warp_group_dot "),
        async_copies=ttgir.count("async_copy_global_to_local"))
import re
from moetune.model import grouped_gemm_tma as tma
P = tma._grouped_gemm_tma_persistent_kernel
for name, k, stored, pairs, rows in [("fp8 fwd tma", tma._grouped_gemm_tma_kernel, False, False, False),
                                     ("fp8 fwd tma_persistent", P, False, False, False),
                                     ("fp8 dgrad as stored tma", tma._grouped_gemm_tma_kernel, True, True, False),
                                     ("fp8 dgrad as stored tma_persistent", P, True, True, False),
                                     ("fp8 dgrad as stored, bytes, tma_persistent", P, True, False, False),
                                     ("bf16 fwd tma_persistent", P, False, False, False),
                                     ("bf16 fwd rows tma_persistent", P, False, False, True),
                                     ("bf16 dgrad tma_persistent", P, True, False, False),
                                     ("bf16 dgrad rows tma_persistent", P, True, False, True)]:
    fp8 = name.startswith("fp8")
    cfg = (tma.TMA_CONFIG_FP8_SWAP if stored else tma.TMA_CONFIG_FP8) if fp8 else tma.TMA_CONFIG
    const = dict(E_POW2=128, B_KMAJOR=not stored, SCALE_A=fp8, SCALE_B=fp8 and not stored, DOT_FP32=False,
                 BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], GROUP_M=8, SWAP=stored and fp8, PAIRS=pairs, l_ptr=None,
                 p_ptr=None, stride_pe=0, stride_pr=0, stride_pn=0, LORA=False, RANK=16, A_ROWS=rows,
                 **({} if rows else {"rows_ptr": None}), **({"FLATTEN": True} if "persistent" in name else {}))
    dt = "*fp8e4nv" if fp8 else "*bf16"
    ptrs = {"a_ptr": dt, "b_ptr": "*i16" if pairs else dt, "c_ptr": "*bf16", "scale_ptr": "*fp32",
            "ascale_ptr": "*fp32", "offs_ptr": "*i32", **({"rows_ptr": "*i64"} if rows else {})}
    sig = {n: "constexpr" if n in const else ptrs.get(n, "i32") for n in k.arg_names}
    div16 = [n for n in k.arg_names if n in ptrs or n in ("N", "K", "stride_am", "stride_cm", "stride_se")]
    src = ASTSource(k, sig, constexprs={(k.arg_names.index(n),): v for n, v in const.items()},
                    attrs={(k.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cfg["num_warps"],
                                                                           num_stages=cfg["num_stages"]))
    ttgir = c.asm["ttgir"]
    # a persistent loop that Triton flattened runs one loop of unit step over tiles × K tiles (the K loop's step is
    # BK); the stack as stored (SWAP): its tile the MMA's A operand from registers ("tensor"), the MMAs asynchronous
    # (a wait that leaves one in flight) and no byte-wise transpose written back to shared memory
    out[name] = dict(shared_bytes=c.metadata.shared, wgmma=ttgir.count("warp_group_dot "),
                              tma_loads=ttgir.count("async_tma_copy_global_to_local"),
                              async_copies=ttgir.count("async_copy_global_to_local"),
                              loop_steps=re.findall(r"scf\.for %\S+ = \S+ to \S+ step (%\S+)", ttgir),
                              a_operand=sorted(set(re.findall(r"warp_group_dot %\S+, %\S+, %\S+ \{[^}]*\} : "
                                                              r"(tensor|!ttg\.memdesc)", ttgir))),
                              waits_pending=sorted(set(re.findall(r"pendings = (\d+)", ttgir))),
                              byte_stores_to_shared=c.asm["ptx"].count("st.shared.b8"),
                              byte_loads_from_shared=c.asm["ptx"].count("ld.shared.b8"),
                              shared_loads=len(re.findall(r"ld\.shared\.", c.asm["ptx"])),
                              shared_stores=len(re.findall(r"st\.shared\.", c.asm["ptx"])),
                              # pointer loads into shared memory by size in bytes (16: one vector a thread a chunk)
                              cp_async_bytes=sorted(set(re.findall(r"cp\.async\.c[ag]\.shared\.global\S*\s+"
                                                                   r"\[[^\]]+\],\s*\[[^\]]+\],\s*(0x[0-9a-f]+|\d+)",
                                                                   c.asm["ptx"]))))
# expert LoRA's thin products (model/grouped_lora_kernels.py), their rows read as stored or through an index
from moetune.model import grouped_lora_kernels as lk
for name, k, cfg, const, ptrs, div16 in [
        *[(f"lora_rows{' rows' if rows else ''}", lk._lora_rows_kernel, lk._THIN,
           dict(E_POW2=128, R=16, BM=lk._THIN["BM"], BK=lk._THIN["BK"], DOT_FP32=False, X_ROWS=rows),
           {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "offs_ptr": "*i32"},
           ["K", "stride_xm", "stride_we", "stride_wk"]) for rows in (False, True)],
        *[(f"ragged_outer{' p_rows' if pr else ''}{' q_rows' if qr else ''}", lk._ragged_outer_kernel, lk._OUTER,
           dict(BP=16, BQ=lk._OUTER["BT"], BK=lk._OUTER["BK"], DOT_FP32=False, P_ROWS=pr, Q_ROWS=qr),
           {"p_ptr": "*bf16", "q_ptr": "*bf16", "c_ptr": "*bf16", "offs_ptr": "*i32"},
           ["stride_pm", "stride_qm", "stride_ce", "stride_cp"]) for pr, qr in ((0, 0), (1, 0), (0, 1))]]:
    gathered = any(v for n, v in const.items() if n.endswith("ROWS"))
    if gathered:
        ptrs = dict(ptrs, rows_ptr="*i64")
    else:
        const = dict(const, rows_ptr=None)
    sig = {n: "constexpr" if n in const else ptrs.get(n, "fp32" if n == "scale" else "i32") for n in k.arg_names}
    src = ASTSource(k, sig, constexprs={(k.arg_names.index(n),): v for n, v in const.items()},
                    attrs={(k.arg_names.index(n),): [["tt.divisibility", 16]] for n in [*ptrs, *div16]})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cfg["num_warps"],
                                                                           num_stages=cfg["num_stages"]))
    ttgir = c.asm["ttgir"]
    out[name] = dict(shared_bytes=c.metadata.shared, wgmma=ttgir.count("warp_group_dot "),
                     mma=ttgir.count("tt.dot "), async_copies=ttgir.count("async_copy_global_to_local"))
print("RESULT" + json.dumps(out))
'''
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # COMPILE_TRITON_PATH: another Triton unpacked beside this one (the device's version, compiled here)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("COMPILE_TRITON_PATH"),
                                                      os.path.join(HERE, "..", "src")]))
    try:
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
        return json.loads(line[0][6:]) if line else dict(error=p.stderr[-1500:])
    except Exception as e:  # noqa: BLE001
        return dict(error=f"{type(e).__name__}: {e}")


def main():
    names = sys.argv[1:] or list(CPU_SHAPES if CPU else SHAPES)
    results = {}
    t0 = time.time()
    for name in names:
        run_shape(name, (CPU_SHAPES if CPU else SHAPES)[name], results)
        print(f"   ({time.time() - t0:.0f} s so far)", flush=True)
    if CPU:
        results["sm90_compile_check"] = compile_check()
        print("sm90 compile check:", json.dumps(results["sm90_compile_check"]), flush=True)
        save(results)
    bad = [(n, op, m) for n, r in results.items() if "ops" in r for op, o in r["ops"].items()
           for m, v in o["methods"].items() if m.startswith("triton") and v.get("finite") is False]
    print(f"done in {time.time() - t0:.0f} s; results in {os.path.join(OUT, 'grouped_gemm.json')}"
          + (f"; NON-FINITE: {bad}" if bad else ""), flush=True)


if __name__ == "__main__":
    main()
