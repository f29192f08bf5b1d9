"""The FP8 frozen base on one GPU: kernels against their torch references, their speed against bf16, the logits
error against fp32 truth, and LoRA loss curves of bf16, dequantised-fp8 and fp8 bases of one random draw.

    python benchmarks/fp8_check.py kernels      # GPU kernels vs references (incl. unaligned expert groups)
    python benchmarks/fp8_check.py speed        # fp8 linear / grouped GEMM fwd+dgrad vs bf16 at Air's shapes
    python benchmarks/fp8_check.py numerics     # logits error vs fp32 truth, AIR shapes, 3 layers, same weights
    python benchmarks/fp8_check.py curves       # 200 LoRA steps per base, AIR-8 shapes, same data for each base
    python benchmarks/fp8_check.py transformers # whether transformers' fp8 (block) path can run here (a hub kernel)
    python benchmarks/fp8_check.py numerics_transformers  # logits error: ours beside transformers' own FP8 paths
        (compressed-tensors; BENCH_CPU=wide: Air's widths on the CPU, where both stacks' fp8 GEMMs have CPU kernels)
    python benchmarks/fp8_check.py curves --task markov --steps 200 --bases bf16,fp8_dequant_bf16,fp8,fp8_dgrad_dequant
        (--task markov, the default: fresh batches of a fixed random Markov chain, a curve that flattens at its entropy;
         --task memorise: the 16 fixed sequences; --states N: the chain's size; bases: see CURVE_BASES)
Each part writes $OUT/fp8_<part>.json. BENCH_CPU=1: the same code on tiny shapes (a rehearsal); BENCH_CPU=wide: curves
on a wider CPU proxy (see _curve_cfg).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

CPU = bool(os.environ.get("BENCH_CPU"))
WIDE = os.environ.get("BENCH_CPU") == "wide"  # curves on the CPU: a wider proxy whose logits can get sharp
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
    from moetune.model.quant.matmul import _gmm_dgrad, _gmm_fwd, fp8_mm_dgrad, fp8_mm

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
                 "fp8_fwd": cc(lambda: fp8_mm(x, w8, s, None)),
                 "fp8_dgrad_exact_accum": cc(lambda: fp8_mm_dgrad(g, w8, s, False)),
                 "fp8_dgrad_fast_accum": cc(lambda: fp8_mm_dgrad(g, w8, s, True)),
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


@contextlib.contextmanager
def _fp8_kernels_on_cpu():
    """Our fp8 tensor-core path taken on the CPU too: torch._scaled_mm has a CPU kernel, the grouped one its fp32
    reference (on a GPU: nothing changes)."""
    from moetune.model.grouped_gemm import scaled_grouped_mm_reference
    from moetune.model.quant import matmul

    chooser, grouped = matmul._fp8_kernels, torch._scaled_grouped_mm
    if CPU:
        matmul._fp8_kernels = lambda x, w8, scheme: (scheme.block is None and x.dtype == torch.bfloat16
                                                     and w8.shape[-1] % 16 == 0 and w8.shape[-2] % 16 == 0)
        torch._scaled_grouped_mm = scaled_grouped_mm_reference
    try:
        yield
    finally:
        matmul._fp8_kernels, torch._scaled_grouped_mm = chooser, grouped


@contextlib.contextmanager
def _fp8_kernels_off():
    """The just-in-time dequantised path (what GPUs without fp8 and the CPU run)."""
    from moetune.model.quant import matmul

    chooser = matmul._fp8_kernels
    matmul._fp8_kernels = lambda x, w8, scheme: False
    try:
        yield
    finally:
        matmul._fp8_kernels = chooser


def numerics_transformers():
    """Logits error against fp32 truth on one random draw, for transformers' own FP8 path and ours, reading the same
    compressed-tensors FP8 checkpoint (the GLM-4.5-Air FP8 release's format: per-row weight scales, dynamic
    per-token activations). AIR's widths, 3 layers (1 dense, 2 MoE); on the CPU 16 experts (top 8) and a 32k
    vocabulary, so that every model fits 24 GiB: the per-product error depends on the widths, not the expert count.
    transformers' paths: its compressed-tensors route (weights dequantised at load, activations fake-quantised per
    token; routed experts dequantised to bf16) and `use_optimized_inference` (row-wise fp8 F.scaled_mm for the
    linears, as on a Hopper GPU; F.scaled_mm runs on the CPU, so the capability check is passed over). Ours: the
    fp8 tensor-core path (torch._scaled_mm; the grouped GEMM's fp32 reference on the CPU, where torch has no kernel)
    and the just-in-time dequantised path."""
    import shutil
    import tempfile

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, Glm4MoeConfig
    from transformers.quantizers.quantizer_compressed_tensors import CompressedTensorsHfQuantizer
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from moetune.model.hf_io import load_model
    from moetune.model.quant.checkpoint import fp8_config
    from moetune.model.quant.fp8 import ROWWISE
    from moetune.names import FP8_WEIGHT_RE

    d = dict(_cfg(3), first_k_dense_replace=1)
    if CPU and not WIDE:
        d.update(n_routed_experts=8, num_experts_per_tok=2)
    elif CPU:
        from moetune.model.config import BUILTIN

        d = dict(BUILTIN["glm45-air"], num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=16,
                 num_experts_per_tok=8, vocab_size=32768)
    tmp = tempfile.mkdtemp(prefix="fp8_numerics_")
    res = {"config": {k: d[k] for k in ("hidden_size", "num_hidden_layers", "n_routed_experts",
                                        "num_experts_per_tok", "moe_intermediate_size", "vocab_size")}}
    try:
        torch.manual_seed(0)
        truth_model = AutoModelForCausalLM.from_config(Glm4MoeConfig(**d), dtype=torch.float32)
        with torch.no_grad():
            for n, p in truth_model.named_parameters():
                p.normal_(0.0, 0.02) if "norm" not in n else p.fill_(1.0)
        plain, fp8 = os.path.join(tmp, "plain"), os.path.join(tmp, "fp8")
        truth_model.save_pretrained(plain)
        ids = torch.randint(0, d["vocab_size"], (2, 128 if CPU else 2048), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            truth = truth_model.to(DEV)(input_ids=ids.to(DEV)).logits.float().cpu()
        del truth_model
        # the FP8 checkpoint: every weight the releases store in fp8 quantised per row, the rest as they are
        sd = {}
        for f in sorted(os.listdir(plain)):
            if f.endswith(".safetensors"):
                sd.update(load_file(os.path.join(plain, f)))
        out = {}
        for k, v in sd.items():
            if FP8_WEIGHT_RE.match(k):
                out[k], out[k[: -len("weight")] + "weight_scale"] = ROWWISE.quantize(v)
            else:
                out[k] = v.to(torch.bfloat16)
        os.makedirs(fp8)
        save_file(out, os.path.join(fp8, "model.safetensors"))
        del sd, out
        cfg = json.load(open(os.path.join(plain, "config.json")))
        json.dump(dict(cfg, quantization_config=fp8_config(ROWWISE)), open(os.path.join(fp8, "config.json"), "w"))

        def measure(name, make, context=contextlib.nullcontext):
            t = time.time()
            try:
                m = make()
                with torch.no_grad(), context():
                    y = m(ids.to(DEV))
                y = (y.logits if hasattr(y, "logits") else y).float().cpu()
                res[name] = rel(y, truth)
            except Exception as ex:  # noqa: BLE001  (one path that cannot run is a finding)
                res[name] = f"{type(ex).__name__}: {str(ex)[:300]}"
            print(f"numerics_transformers {name}: {res[name]} ({time.time() - t:.0f}s)", flush=True)

        bf = torch.bfloat16
        measure("ours_bf16", lambda: load_model(plain, device=DEV, dtype="bfloat16"))
        measure("transformers_bf16", lambda: AutoModelForCausalLM.from_pretrained(plain, dtype=bf).to(DEV))
        measure("ours_fp8", lambda: load_model(fp8, device=DEV, dtype="bfloat16"), _fp8_kernels_on_cpu)
        measure("ours_fp8_dequantised_just_in_time", lambda: load_model(fp8, device=DEV, dtype="bfloat16"),
                _fp8_kernels_off)
        measure("transformers_fp8_compressed_tensors",
                lambda: AutoModelForCausalLM.from_pretrained(fp8, dtype=bf).to(DEV))
        validate = CompressedTensorsHfQuantizer.validate_environment
        try:
            if CPU:  # F.scaled_mm runs on the CPU: let transformers' kernel path run there
                def keep_kernel(self, *a, **k):
                    validate(self, *a, **k)
                    self.use_fp8_kernel = True
                CompressedTensorsHfQuantizer.validate_environment = keep_kernel
            def kernel_model():
                from transformers.integrations.compressed_tensors import CompressedTensorsFP8Linear

                m = AutoModelForCausalLM.from_pretrained(
                    fp8, dtype=bf, quantization_config=CompressedTensorsConfig(use_optimized_inference=True)).to(DEV)
                res["transformers_fp8_scaled_mm_linears"] = sum(isinstance(x, CompressedTensorsFP8Linear)
                                                                for x in m.modules())
                return m

            measure("transformers_fp8_scaled_mm", kernel_model)
        finally:
            CompressedTensorsHfQuantizer.validate_environment = validate
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for ours, theirs in (("ours_fp8", "transformers_fp8_scaled_mm"),
                         ("ours_fp8", "transformers_fp8_compressed_tensors")):
        if isinstance(res.get(ours), float) and isinstance(res.get(theirs), float):
            res[f"ratio_{ours}_over_{theirs}"] = res[ours] / res[theirs]
    res["nan"] = any(v != v for v in res.values() if isinstance(v, float))
    save("numerics_transformers", res)


# --------------------------------------------------------------------------------------------------- curves
# The Markov task's chain: CHAIN_STATES token ids, each with CHAIN_SUCCESSORS allowed successors (uniform), fixed by
# CHAIN_SEED. Every predicted token's entropy given the previous one is log(successors) = log 4 = 1.386 nats: the floor.
# Why 16 states. On a random-weight base the curve has two stages: first the chain's ids as a set (a "unigram" plateau
# that a random lm_head caps at best near log(n + V e^(-0.02*hidden/sqrt n)): log 16 = 2.8 at AIR's width, but 7.1
# for 256 ids), then the bigram, which LoRA q,k,v,o learns only once attention carries the current token's identity,
# and the later the larger the chain. Measured on the CPU proxy (BENCH_CPU=wide: hidden 1024, 4 layers, vocabulary 2048,
# 4 x 128 tokens a step, lr 1e-3), mean loss of steps 1-10, ..., 291-300:
#   16 ids: 5.49 3.50 3.40 3.03 2.38 2.02 1.82 1.69 1.65 1.61 | 1.60 1.57 1.58 1.55 1.55 1.55 1.55 1.56 1.54 1.52|..1.51
#   32 ids: 5.91 4.23 4.15 3.83 3.13 2.64 2.43 2.15 2.05 1.91 | 1.87 1.80 1.77 1.75 1.72 1.70 1.68 1.66 1.65 1.64|..1.59
#   64 ids: plateau 5.2 until step 60, 3.30 at step 100, 1.92 at step 200, 1.80 at step 300 (still falling)
#  256 ids: plateau 6.6 (its capped unigram) until step ~250, then the fall starts
# (the tiny model, hidden 128, cannot sharpen its logits at all: 0.02*128 = 2.6 nats at most for one token.) 16 ids
# come within 0.05 nat of their 300-step loss by step ~130 there and move ~0.03 nat over steps 150-200; AIR-8 has
# twice the layers carrying LoRA, a 4x larger logit range and 8x the tokens a step, so its 200-step curve should be at
# least as flat: a lag of ten steps then moves the final loss by well under 1%, not the memorisation curve's 20%.
# `--states` picks another size (32 and 64 are harder tasks that flatten later).
CHAIN_STATES, CHAIN_SUCCESSORS, CHAIN_SEED = 16, 4, 7
# base name: (model.quantize, DGRAD of moetune.model.quant.matmul, dequantise the fp8 weights into bf16 ones,
#             GROUPED_DGRAD of moetune.model.quant.matmul or None)
CURVE_BASES = {
    "bf16": (None, None, False, None),                      # the bf16 draw
    "fp8_dequant_bf16": ("fp8", None, True, None),          # the fp8 base's weights in a bf16 model: what a bf16
                                                            # trainer trains when handed the FP8 release
    "fp8": ("fp8", "fp8", False, None),                     # fp8 kernels forward and input gradient
    "fp8_dgrad_dequant": ("fp8", "dequant", False, None),   # input gradient through the dequantised weight
    "fp8_triton_dgrad": ("fp8", "fp8", False, "w8a16"),     # experts' input gradient: the Triton W8A16 kernel
}
DEFAULT_CURVE_BASES = ("bf16", "fp8_dequant_bf16", "fp8", "fp8_dgrad_dequant")


def markov_chain(vocab: int, states: int, successors: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token id of each state [states], successor states of each state [states, successors]): a random first-order
    chain whose every transition is uniform over `successors` distinct states, so a predicted token's entropy given
    the previous one is exactly log(successors) nats."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab, generator=g)[:states]
    nxt = torch.stack([torch.randperm(states, generator=g)[:successors] for _ in range(states)])
    return ids, nxt


def markov_batches(ids, nxt, steps: int, rows: int, seq: int, seed: int) -> torch.Tensor:
    """[steps, rows, seq] token ids, fresh every step: each row starts at a uniform state and walks the chain. Step
    i's rows come from a generator seeded by (seed, i) alone: the same batches whatever is run around them."""
    states, k = nxt.shape
    start, choice = [], []
    for i in range(steps):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        start.append(torch.randint(0, states, (rows,), generator=g))
        choice.append(torch.randint(0, k, (rows, seq), generator=g))
    start, choice = torch.stack(start).view(-1), torch.stack(choice).view(-1, seq)
    walk = torch.empty(steps * rows, seq, dtype=torch.long)
    walk[:, 0] = start
    for t in range(1, seq):
        walk[:, t] = nxt[walk[:, t - 1], choice[:, t]]
    return ids[walk].view(steps, rows, seq)


CPU_SEQ = 128 if WIDE else 64


def _curve_cfg():
    """AIR-8; on the CPU the tiny model (3 layers), or with BENCH_CPU=wide a proxy whose logits can be as sharp as a
    trained model's (hidden 1024: 0.02 x hidden = 20 nats for one token, tiny's 2.6), 4 layers, vocabulary 2,048."""
    if WIDE:
        from moetune.model.config import BUILTIN

        return dict(BUILTIN["tiny"], hidden_size=1024, num_hidden_layers=4, vocab_size=2048, num_attention_heads=8,
                    head_dim=64, num_key_value_heads=2, intermediate_size=1024, moe_intermediate_size=256)
    return _cfg(8)


def _curve_model(cfg, q, dequant):
    """AIR-8 (CPU: tiny) with LoRA q,k,v,o, bf16 compute, weights of seed 0; `q` "fp8": the fp8 base of the same
    draw; `dequant`: that fp8 base's weights put back into a plain bf16 model (bf16 kernels). Returns (model, note)."""
    from moetune.model.config import ModelConfig
    from moetune.model.hf_io import build_model, cast_model, init_weights
    from moetune.model.lora import apply_lora
    from moetune.model.quant.fp8 import scheme_named
    from moetune.model.quant.modules import dequantize_model, quantize_model, scale_name
    from moetune.parallel.apply import apply_compile
    from moetune.train.setup import init_lora

    model = build_model(ModelConfig.from_hf_dict(cfg), "meta")
    cast_model(model, torch.bfloat16)
    if q:
        quantize_model(model, scheme_named(q))
    apply_lora(model, ["q_proj", "k_proj", "v_proj", "o_proj"], 16, 32)
    if not CPU:
        apply_compile(model)  # lazy: compiles at the first forward, after any dequantisation below
    model.to_empty(device=DEV)
    init_weights(model, 0.02, seed=0)
    init_lora(model, seed=0)
    note = None
    if dequant:
        # one linear and one expert stack of the fp8 base, kept to check the dequantised model against
        lin = model.model.layers[0].self_attn.q_proj
        ex = next(m.experts for m in model.model.modules() if hasattr(m, "experts") and hasattr(m.experts, "quant"))
        ref = {"linear": (lin, "weight", lin.weight.detach().clone(),
                          getattr(lin, scale_name("weight", lin.quant)).detach().clone()),
               "experts": (ex, "down_proj", ex.down_proj.detach().clone(),
                           getattr(ex, scale_name("down_proj", ex.quant)).detach().clone())}
        dequantize_model(model, torch.bfloat16)
        note = {}
        for kind, (mod, name, w8, s) in ref.items():
            w = getattr(mod, name)
            exact = (w8.to(torch.float32) * s.to(torch.float32))  # the fp8 base's weight (its kernels' product)
            assert getattr(mod, "quant", None) is None and w.dtype == torch.bfloat16, (kind, w.dtype)
            assert torch.equal(w, exact.to(torch.bfloat16)), f"{kind}: dequantised bf16 weight != fp8 base's weight"
            note[f"{kind}_rel_bf16_rounding_of_fp8_weight"] = rel(w, exact)
        assert not any(p.dtype == torch.float8_e4m3fn for p in model.parameters()), "an fp8 weight is left"
    return model, note


def curves(task: str = "markov", steps: int | None = None, bases=DEFAULT_CURVE_BASES, states: int | None = None,
           successors: int = CHAIN_SUCCESSORS):
    """LoRA (q,k,v,o) loss curves of several bases of the same random draw, AIR-8 shapes (CPU: tiny, 3 layers),
    AdamW lr 1e-3, 4 rows of 1,024 tokens (CPU: 64, wide 128) a step, the same batches for every base.
    task "markov": fresh batches every step from a fixed random Markov chain (the curve flattens at the chain's
    entropy, log(successors) nats a predicted token); "memorise": 16 fixed sequences of random tokens cycled four at
    a time (the loss falls as long as it runs)."""
    import moetune.model.quant.matmul as fp8_matmul

    cfg = _curve_cfg()
    steps = steps or (20 if CPU else 200)
    S, B = (CPU_SEQ if CPU else 1024), 4
    res = {"task": task, "steps": steps, "rows": B, "seq": S, "lr": 1e-3, "lora": "q,k,v,o r16 alpha32"}
    if task == "markov":
        vocab = cfg["vocab_size"]
        states = states or CHAIN_STATES
        assert successors <= states <= vocab, (successors, states, vocab)
        ids, nxt = markov_chain(vocab, states, successors, CHAIN_SEED)
        data = markov_batches(ids, nxt, steps, B, S, seed=1).to(DEV)
        floor = math.log(successors)
        res.update(chain_states=states, chain_successors=successors, entropy_floor_nats=floor,
                   unigram_entropy_nats=math.log(states))
        print(f"curves task=markov states={states} successors={successors} entropy_floor={floor:.4f} nats/token "
              f"(log {successors}; the ids as a set, no order: log {states} = {math.log(states):.3f})", flush=True)
    elif task == "memorise":
        g = torch.Generator().manual_seed(1)
        fixed = torch.randint(0, min(1000, cfg["vocab_size"]), (16, S), generator=g)
        data = torch.stack([fixed[(i % 4) * 4:(i % 4) * 4 + 4] for i in range(steps)]).to(DEV)
        res["entropy_floor_nats"] = 0.0  # memorisation: nothing stops it but the steps
        print("curves task=memorise: 16 fixed sequences cycled four at a time (floor 0)", flush=True)
    else:
        raise ValueError(f"unknown task {task!r}: markov or memorise")
    dgrad0, grouped0 = fp8_matmul.DGRAD, getattr(fp8_matmul, "GROUPED_DGRAD", None)
    ran = []
    for name in bases:
        if name not in CURVE_BASES:
            raise ValueError(f"unknown base {name!r}; choose from {list(CURVE_BASES)}")
        q, dgrad, dequant, grouped = CURVE_BASES[name]
        if grouped is not None and not hasattr(fp8_matmul, "GROUPED_DGRAD"):
            print(f"curves {name} skipped: moetune.model.quant.matmul has no GROUPED_DGRAD switch", flush=True)
            res[name] = {"skipped": "moetune.model.quant.matmul has no GROUPED_DGRAD"}
            continue
        fp8_matmul.DGRAD = dgrad or dgrad0
        if hasattr(fp8_matmul, "GROUPED_DGRAD"):
            fp8_matmul.GROUPED_DGRAD = grouped if grouped is not None else grouped0
        torch._dynamo.reset()
        model = opt = params = None
        try:
            model, note = _curve_model(cfg, q, dequant)
            params = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=1e-3)
            losses = []
            t = time.perf_counter()
            for step in range(steps):
                ids_ = data[step]
                labels = torch.roll(ids_, -1, 1)
                labels[:, -1] = -100
                loss = model(ids_, labels=labels) / (labels != -100).sum()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(round(loss.item(), 5))
            res[name] = {"losses": losses, "final_mean_last10": sum(losses[-10:]) / len(losses[-10:]),
                         "mean_last50": sum(losses[-50:]) / len(losses[-50:]), "s": round(time.perf_counter() - t, 1)}
            if note:
                res[name]["dequant_check"] = note
            ran.append(name)
        except Exception as ex:  # noqa: BLE001  one base's failure keeps the others' curves
            import traceback

            traceback.print_exc()
            res[name] = {"error": f"{type(ex).__name__}: {str(ex)[:500]}"}
        finally:
            del model, opt, params
            fp8_matmul.DGRAD = dgrad0
            if hasattr(fp8_matmul, "GROUPED_DGRAD"):
                fp8_matmul.GROUPED_DGRAD = grouped0
            if not CPU:
                torch.cuda.empty_cache()
    floor = res["entropy_floor_nats"]
    for name in ran:
        r = res[name]
        for ref, key in (("bf16", "ratio_vs_bf16"), ("fp8_dequant_bf16", "ratio_vs_dequant")):
            if ref in ran:
                r[key] = r["final_mean_last10"] / res[ref]["final_mean_last10"]
                res[f"final_ratio_{name}_over_{ref}"] = r[key]
        r["excess_over_floor"] = r["final_mean_last10"] - floor
        print(f"curves {name} final={r['final_mean_last10']:.4f} last50={r['mean_last50']:.4f} "
              f"ratio_vs_bf16={r.get('ratio_vs_bf16', float('nan')):.4f} "
              f"ratio_vs_dequant={r.get('ratio_vs_dequant', float('nan')):.4f} "
              f"excess_over_floor={r['excess_over_floor']:.4f} s={r['s']} task={task} floor={floor:.4f}", flush=True)
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="*", help="kernels speed numerics curves transformers (default: all)")
    ap.add_argument("--task", default="markov", choices=("markov", "memorise"), help="curves: the training task")
    ap.add_argument("--steps", type=int, default=None, help="curves: steps per base (default 200; CPU 20)")
    ap.add_argument("--bases", default=",".join(DEFAULT_CURVE_BASES),
                    help=f"curves: comma-separated, of {','.join(CURVE_BASES)}")
    ap.add_argument("--states", type=int, default=None, help=f"curves markov: chain states (default {CHAIN_STATES})")
    ap.add_argument("--successors", type=int, default=CHAIN_SUCCESSORS, help="curves markov: successors a state")
    args = ap.parse_args()
    parts = args.parts or ["kernels", "speed", "numerics", "curves", "transformers"]
    fns = {"kernels": kernels, "speed": speed, "numerics": numerics, "transformers": transformers_fp8,
           "numerics_transformers": numerics_transformers,
           "curves": lambda: curves(args.task, args.steps, [b for b in args.bases.split(",") if b], args.states,
                                    args.successors)}
    unknown = [p for p in parts if p not in fns]
    if unknown:
        ap.error(f"unknown part(s) {unknown}; choose from {list(fns)}")
    for p in parts:
        try:
            fns[p]()
        except Exception as ex:  # noqa: BLE001  one part's failure keeps the others' numbers
            import traceback

            traceback.print_exc()
            save(p, {"error": f"{type(ex).__name__}: {str(ex)[:500]}"})
