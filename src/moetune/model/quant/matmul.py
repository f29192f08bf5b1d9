"""Matmuls through a frozen FP8 weight: forward, and the input gradient (the only gradient a frozen weight needs).

Two paths, chosen per call:
- fp8 tensor cores (CUDA, compute capability ≥ 8.9, one scale per weight row, dims multiples of 16): the activation is
  quantised per row (token) on the fly and `torch._scaled_mm` / `torch._scaled_grouped_mm` run fp8 × fp8 with fp32
  row/column scales. For the input gradient dx = dy · diag(s) · W8, the weight's row scale s lies inside the sum over
  output rows, so it is folded into dy before dy is quantised; W8 is transposed for that GEMM into a transient of one
  weight's fp8 bytes (Hopper's fp8 GEMM wants both operands K-major).
- just in time dequantisation (the CPU, GPUs without fp8, block-scaled weights): the weight is dequantised to the
  activation's dtype for this one product and dropped; autograd never keeps it (the backward dequantises again).
`reference_*` are the fp8 path's numerics written in plain torch (the activation quantised and dequantised the
same way): the tests hold the kernels to them.

The routed experts without expert LoRA run as one node on the fp8 tensor-core path (`fp8_expert_mlp`): the SwiGLU
between the two stacks writes down's quantised operand, and its backward gate_up's scaled, quantised operand, each in
one pass (model/kernels.py) instead of Inductor's two-pass reductions; compiled, the node also takes the tokens
quantised before they are gathered and sums each token's rows itself. AIR-8 LoRA q,k,v,o on one H200: 52,652
tokens/s against 48,530 GEMM by GEMM, the bf16 base 38,994 in the same call (BENCHMARKS.md, seventeenth session).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetune.model import grouped_gemm_tiles
from moetune.model.grouped_gemm import grouped_mm_fp8, grouped_mm_fp8_dgrad, kernel_supported, kernel_supported_w8a8
from moetune.model.grouped_gemm_tma import grouped_gemm_tma, k_major_copy, k_major_copy_reference, tma_supported
from moetune.model.kernels import (SCALED_ROWS_MAX, compiled_for_eager, gather_sum, gathered_rows_fp8, scaled_rows_fp8,
                                   scaled_rows_fp8_torch, weighted_swiglu_bwd_fp8, weighted_swiglu_fp8)
from moetune.model.quant.fp8 import FP8, Fp8Scheme, quantize_rows

_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


def _fp8_kernels(x: torch.Tensor, w8: torch.Tensor, scheme: Fp8Scheme) -> bool:
    # the grouped fp8 GEMM writes bf16 only; an fp32 model (reference runs) takes the dequantising path
    if scheme.block is not None or not x.is_cuda or x.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(x.device) < (8, 9):
        return False
    return w8.shape[-1] % 16 == 0 and w8.shape[-2] % 16 == 0


def _row_scales(scale: torch.Tensor) -> torch.Tensor:
    """[..., out, 1] weight scales as [..., out] (what the scaled GEMMs take for mat2's columns)."""
    return scale.reshape(*scale.shape[:-2], scale.shape[-2])


# --------------------------------------------------------------------------------------------- dense
# Hopper's fp8 tensor cores accumulate in reduced precision unless the GEMM promotes partial sums ("fast accum"
# off): on for the forward as torchao's float8 recipe has it, off for the gradient.
FAST_ACCUM_FORWARD, FAST_ACCUM_DGRAD = True, True
# The input gradient through fp8 tensor cores quantises dy per row as well ("fp8"), or runs in bf16 on the weight
# dequantised just in time ("dequant": only the weight's own rounding, no gradient quantisation).
DGRAD = "fp8"
# The expert stacks' grouped GEMMs on the fp8 tensor-core path (model/grouped_gemm*.py have the Triton kernels):
# forward "scaled_mm" (torch._scaled_grouped_mm) or "triton" (fp8 × fp8, the same numerics); input gradient "fp8"
# (dy with the scales folded in, quantised per row, × a K-major copy of the stack through _scaled_grouped_mm) or
# "w8a16" (the Triton kernel reads the stack as stored and converts it to bf16 in registers: no copy, no
# quantisation of the gradient) or "w8a8" (fp8 × fp8 on the stack as stored: the "fp8" numerics without the copy; on
# Hopper the TMA kernel's transposed product, grouped_gemm_tma.py's SWAP, where its K tiles fit the stack's `out`).
# "tma": the Triton TMA kernel (fp8 × fp8, Hopper) for the forward, and for the input gradient on the K-major copy
# or the stack as stored (STORED_DGRAD_MAX_ROWS; the "fp8" numerics either way), where it takes the operands; torch's
# kernels elsewhere.
# "tma" for both: on one H200 the kernel runs Air's and Flash's expert GEMMs at 650–1,130 TFLOP/s against 510–1,080
# for torch 2.11's `_scaled_grouped_mm` (forward, and input gradient on the same copy); with the transposed copies
# kept, AIR-8 q,k,v,o on an fp8 base 47,471 tokens/s against 39,006 with torch's kernels, 1.23x the bf16 base
# (BENCHMARKS.md, fifteenth session).
GROUPED_FORWARD = "tma"
GROUPED_DGRAD = "tma"
# Under "tma", where the stack has no kept K-major copy: the input gradient reads the stack as stored (the "w8a8"
# kernel) when its groups average at most this many rows, else it makes the copy. A copy costs a pass over the stack's
# bytes whatever the rows; the kernel on the stack as stored runs ~35% slower per row than the K-major one, so it wins
# on many small groups. One H200, gate_up's and down's input gradients, as stored against the copy + the K-major
# kernel: GLM-4.7-Flash (256 rows an expert) 0.59 against 0.69 ms, AIR-8 (256) 2.13 against 2.50; one EP-8 rank of Air
# (2,036) 1.61 against 1.14 (its tile moved byte by byte; break-even 300–520 rows then; BENCHMARKS.md, twenty-third
# session).
STORED_DGRAD_MAX_ROWS = 320
# How "tma" launches: "custom_op" (an opaque op whose Python launches the Triton kernel, as the other Triton paths) or
# "triton_op" (torch.compile launches it from its own code). Within 2% of each other either way on one H200 (AIR-8
# 1.8% faster as the custom op, GLM-4.7-Flash 1.4% slower); the custom op is what the CPU tests can compile and
# recompute (tests/unit/test_fp8_base.py: Triton's interpreter cannot be traced inside a triton_op).
TMA_LAUNCH = "custom_op"
# How code outside a compiled graph (the expert-parallel exchange's local work, an eager model) quantises the fp8
# GEMMs' operands: "compiled", each quantisation compiled on its own (`EAGER_QUANT_BACKEND`), or "torch", op by op
# (some six passes over an fp32 copy of the rows). One EP-8 rank of Air on an fp8 base through the exchange, one
# H200, same call: 6,542 tokens/s compiled against 5,136 op by op (BENCHMARKS.md, fourteenth session).
EAGER_QUANT = "compiled"
EAGER_QUANT_BACKEND = "inductor"


def _quantized(fn, *args):
    """fn(*args), a quantisation of a GEMM operand; compiled on its own in eager code when EAGER_QUANT says so (in a
    compiled graph Inductor fuses it with its neighbours)."""
    if EAGER_QUANT == "compiled" and not torch.compiler.is_compiling():
        return compiled_for_eager(fn, EAGER_QUANT_BACKEND)(*args)
    return fn(*args)


# How the input gradient copies a stack K-major where no copy is kept: "triton" (model/grouped_gemm_tma.py's copy
# kernel, launched directly) or "compiled" (Inductor's transpose compiled on its own, called through Dynamo).
K_MAJOR_COPY = "triton"


@torch.library.custom_op("moetune::k_major_copy", mutates_args=())
def _k_major_copy(w8: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """An expert stack w8 [E, out, in] copied to [E, in, out] contiguous (Hopper's fp8 GEMM takes both operands
    K-major), for the input gradient. `grad`, the gradient it is for, is read by nothing: it makes the copy depend on
    backward's input. As a plain `w8.transpose().contiguous()`, a function of the weight alone, torch.compile's
    partitioner may compute it in the forward and keep it until the backward — a second copy of every stack
    (measured: 11.6 GiB on one EP-8 rank of full-size Air through the compiled exchange, BENCHMARKS.md, thirteenth
    session; a dense weight's copy is not kept, tests/unit/test_fp8_base.py)."""
    if K_MAJOR_COPY == "compiled" and w8.is_cuda:
        return compiled_for_eager(k_major_copy_reference)(w8)
    return k_major_copy(w8)


@_k_major_copy.register_fake
def _(w8, grad):
    return w8.new_empty(*w8.shape[:-2], w8.shape[-1], w8.shape[-2])


# How the dense fp8 GEMMs' operands are quantised on CUDA (the activation forward, the gradient with the weight's row
# scales folded in backward): "inductor", quantize_rows traced into the graph, where Inductor fuses it into the kernel
# producing the operand as a reduction that reads and recomputes each row twice; "kernel", model/kernels.py's
# one-pass row kernel as an opaque op (rows up to SCALED_ROWS_MAX wide); "auto" (the default), the kernel where the
# compiled layers replay as CUDA graphs (parallel/apply.py's apply_compile says so), else Inductor's. On one H200,
# same call, "kernel" takes GPU time off every step (AIR-8 −3.2 ms, an EP-8 rank of Air −12.6 ms, GLM-4.7-Flash
# −4.4 ms) but its Python launches cost more host time where the step is not replayed as CUDA graphs (AIR-8 46,172
# tokens/s against 47,768, the EP-8 rank 11,148 against 11,268); replayed, Flash gains 2.0% (18,558 against 18,187).
# As a triton_op (torch.compile launching it) AIR-8 lost more (BENCHMARKS.md, twenty-fourth and -fifth sessions).
DENSE_QUANT = "auto"
# Whether the compiled layers replay as CUDA graphs: set by parallel/apply.py's apply_compile.
REPLAYED_AS_CUDA_GRAPHS = False


def dense_quant_mode() -> str:
    """DENSE_QUANT with "auto" resolved: "kernel" or "inductor"."""
    if DENSE_QUANT != "auto":
        return DENSE_QUANT
    return "kernel" if REPLAYED_AS_CUDA_GRAPHS else "inductor"


@torch.library.custom_op("moetune::scaled_rows_fp8", mutates_args=())
def _scaled_rows_fp8(x: torch.Tensor, col_scales: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return scaled_rows_fp8(x, col_scales)


@_scaled_rows_fp8.register_fake
def _(x, col_scales):
    return x.new_empty(x.shape, dtype=FP8), x.new_empty(x.shape[0], 1, dtype=torch.float32)


def _dense_kernel_quant(x2: torch.Tensor) -> bool:
    return dense_quant_mode() == "kernel" and x2.is_cuda and x2.shape[-1] <= SCALED_ROWS_MAX


def _quantized_operand(x2):
    """A dense fp8 GEMM's activation quantised per row: the row kernel where DENSE_QUANT says, else quantize_rows."""
    return _scaled_rows_fp8(x2, None) if _dense_kernel_quant(x2) else _quantized(quantize_rows, x2)


def fp8_mm(x2, w8, scale, bias):
    """x2 [M, in] · dequant(w8 [out, in], scale)ᵀ (+ bias) on fp8 tensor cores, x2 quantised per row here."""
    xq, sx = _quantized_operand(x2)
    # _scaled_mm takes a bias only for a 16-bit output
    fused_bias = bias is not None and x2.dtype != torch.float32
    y = torch._scaled_mm(xq, w8.t(), scale_a=sx, scale_b=_row_scales(scale).view(1, -1),
                         bias=bias.to(x2.dtype) if fused_bias else None, out_dtype=x2.dtype,
                         use_fast_accum=FAST_ACCUM_FORWARD)
    return y + bias.to(y.dtype) if bias is not None and not fused_bias else y


# LoRA's branch on an fp8 weight added by the fp8 GEMM that makes y (grouped_gemm_tma.py's TMA kernel as one group,
# s·(x·Aᵀ)·Bᵀ one more MMA in its epilogue) instead of cuBLAS's fp8 GEMM and an in-place add that reads and writes y
# again (GLM-4.7-Flash's kv_b: 43 µs for the GEMM, 59 for the add, one H200), where lora.py's op says (outputs much
# wider than their inputs). Flash LoRA on MLA, fp8 base, harness with CUDA graphs: 19,257 tokens/s against 19,140
# (BENCHMARKS.md, twenty-eighth session).
FP8_LORA_EPILOGUE = True


def fp8_mm_lora_fits(x2, w8, rank: int, bias) -> bool:
    """Whether `fp8_mm_lora` takes this product: FP8_LORA_EPILOGUE, no bias, a rank the epilogue's MMA takes, and
    the TMA kernel's operands (fp8 rows as x2's, the weight as a one-expert stack)."""
    return (FP8_LORA_EPILOGUE and bias is None and rank in grouped_gemm_tiles.LORA_RANKS
            and (x2.is_cuda or grouped_gemm_tiles.KERNEL_ON_CPU)
            and x2.shape[-1] <= SCALED_ROWS_MAX
            and tma_supported(x2.new_empty(0, x2.shape[-1], dtype=FP8), w8.unsqueeze(0), True))


def fp8_mm_lora(x2, w8, scale, L, P):
    """x2 [M, in] · dequant(w8 [out, in], scale)ᵀ + L [M, r] · P [r, out], one rounding: x2 quantised per row, the
    fp8 GEMM and the 16-bit product summed in the TMA kernel's accumulator."""
    xq, sx = _quantized_operand(x2)
    offs = torch.full((1,), x2.shape[0], dtype=torch.int32, device=x2.device)
    return grouped_gemm_tma(xq, w8.unsqueeze(0), offs, scale.reshape(1, -1), True, x_scale=sx,
                            lora=(L.to(torch.bfloat16), P.to(torch.bfloat16).unsqueeze(0))).to(x2.dtype)


def _mm_dgrad_operand(g2, scale):
    """dy with the weight's row scales folded in (they lie inside the sum over `out`), quantised per row."""
    return scaled_rows_fp8_torch(g2, _row_scales(scale))


def fp8_mm_dgrad(g2, w8, scale, fast_accum=None, transposed=None):
    """dx through w8 [out, in]: the GEMM reads it K-major, `transposed` [in, out] (a kept copy) or a copy made here
    (traced: Inductor's transpose, fused with its neighbours; eager: the copy kernel, ~10x torch's strided copy)."""
    if _dense_kernel_quant(g2):
        gq, sg = _scaled_rows_fp8(g2, _row_scales(scale))
    else:
        gq, sg = _quantized(_mm_dgrad_operand, g2, scale)
    ones = torch.ones(1, w8.shape[1], device=g2.device, dtype=torch.float32)
    if transposed is None:
        transposed = w8.t().contiguous() if torch.compiler.is_compiling() else k_major_copy(w8)
    k_major = transposed.t()
    return torch._scaled_mm(gq, k_major, scale_a=sg, scale_b=ones, out_dtype=g2.dtype,
                            use_fast_accum=FAST_ACCUM_DGRAD if fast_accum is None else fast_accum)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w8, scale, bias, scheme, transposed):
        ctx.save_for_backward(w8, scale, transposed)
        ctx.scheme = scheme
        x2 = x.reshape(-1, x.shape[-1])
        if _fp8_kernels(x2, w8, scheme):
            y = fp8_mm(x2, w8, scale, bias)
        else:
            y = F.linear(x2, scheme.dequantize(w8, scale, x.dtype), None if bias is None else bias.to(x.dtype))
        return y.view(*x.shape[:-1], w8.shape[0])

    @staticmethod
    def backward(ctx, g):
        w8, scale, transposed = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1]).contiguous()
        dx = None
        if ctx.needs_input_grad[0]:
            if DGRAD == "fp8" and _fp8_kernels(g2, w8, ctx.scheme):
                dx = fp8_mm_dgrad(g2, w8, scale, transposed=transposed)
            else:
                dx = g2 @ ctx.scheme.dequantize(w8, scale, g.dtype)
            dx = dx.view(*g.shape[:-1], w8.shape[1])
        dbias = g2.sum(0) if ctx.needs_input_grad[3] else None
        return dx, None, None, dbias, None, None


def fp8_mm_in_one_op(x: torch.Tensor, w8: torch.Tensor, scheme: Fp8Scheme) -> bool:
    """Whether a LoRA linear on this fp8 weight runs as one op each way (lora.lora_linear): the fp8 tensor-core
    path, forward and input gradient, with the operands quantised by the row kernel (DENSE_QUANT's "kernel", where
    the layers replay as CUDA graphs). Under Inductor's quantisations, fused into the kernels that produce the
    operands, the traced form keeps that fusion."""
    return DGRAD == "fp8" and _fp8_kernels(x, w8, scheme) and _dense_kernel_quant(x)


def fp8_linear(x, w8, scale, scheme: Fp8Scheme, bias=None, transposed=None):
    """x · dequant(w8, scale)ᵀ + bias for a frozen fp8 weight [out, in]; `transposed`: its kept copy [in, out] for
    the input gradient (quant.modules.keep_transposed_copies), or None."""
    return _Fp8Linear.apply(x, w8, scale, bias, scheme, transposed)


def reference_fp8_linear(x, w8, scale, bias=None):
    """What the fp8 kernel computes (row-wise weight scales), in fp32 torch: quantised activation × fp8 weight."""
    xq, sx = quantize_rows(x.reshape(-1, x.shape[-1]))
    y = (xq.float() * sx) @ (w8.float() * scale.float()).t()
    if bias is not None:
        y = y + bias.float()
    return y.view(*x.shape[:-1], w8.shape[0])


def reference_fp8_dgrad(g, w8, scale):
    """The fp8 kernel's input gradient: dy with the weight's row scales folded in, quantised per row, × fp8 weight."""
    gq, sg = quantize_rows(g.reshape(-1, g.shape[-1]).float() * _row_scales(scale).view(1, -1))
    return ((gq.float() * sg) @ w8.float()).view(*g.shape[:-1], w8.shape[1])


# --------------------------------------------------------------------------------------------- grouped (experts)
def expert_of_rows(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """The expert (group) of each of `rows` rows sorted by expert with group ends `offs`; rows past the last end
    (padding) get the last expert."""
    idx = torch.searchsorted(offs, torch.arange(rows, device=offs.device, dtype=offs.dtype), right=True)
    return idx.clamp_(max=offs.numel() - 1)


def _gmm_tma(x8, x_scale, w8, offs, scale):
    """fp8 rows × a K-major fp8 stack through the TMA kernel, launched as TMA_LAUNCH says (`scale` None: the input
    gradient on a K-major copy)."""
    if TMA_LAUNCH == "triton_op":
        return torch.ops.moetune.grouped_mm_tma(x8, w8, offs, scale, x_scale, True)
    return grouped_mm_fp8(x8, x_scale, w8, offs, scale)


def _gmm_fwd(x, w8, scale, offs):
    xq, sx = _quantized(quantize_rows, x)
    return _gmm_fwd_quantized(xq, sx, w8, scale, offs, x.dtype)


def _gmm_fwd_quantized(xq, sx, w8, scale, offs, dtype):
    """Rows quantised per row (xq, sx) × each expert's fp8 weight, in `dtype`."""
    if GROUPED_FORWARD == "tma" and tma_supported(xq, w8, True):
        return _gmm_tma(xq, sx, w8, offs, scale)
    if GROUPED_FORWARD == "triton" and kernel_supported_w8a8(xq, w8):
        return grouped_mm_fp8(xq, sx, w8, offs, scale)
    return torch._scaled_grouped_mm(xq, w8.transpose(-2, -1), scale_a=sx.view(-1), scale_b=_row_scales(scale),
                                    offs=offs, out_dtype=dtype, use_fast_accum=FAST_ACCUM_FORWARD)


def _gmm_dgrad_operand(g, scale, offs):
    """dy with each row's expert's weight scales folded in (they lie inside the sum over `out`), quantised per row."""
    return quantize_rows(g.float() * _row_scales(scale)[expert_of_rows(offs, g.shape[0])])


def _gmm_dgrad(g, w8, scale, offs, fast_accum=None, transposed=None):
    """dx through the stack w8 [E, out, in], read K-major: `transposed` [E, in, out] (a kept copy) or a copy made
    here (fp8 paths), or as stored (the Triton kernels' w8a8)."""
    gq, sg = _quantized(_gmm_dgrad_operand, g, scale, offs)
    return _gmm_dgrad_quantized(gq, sg, w8, offs, g, fast_accum, transposed)


def _gmm_dgrad_quantized(gq, sg, w8, offs, grad, fast_accum=None, transposed=None):
    """dx (in grad's dtype) from the operand already folded and quantised (gq, sg); `grad`, the backward's input,
    is what a copy made here depends on (see _k_major_copy)."""
    if GROUPED_DGRAD == "w8a8" and kernel_supported_w8a8(gq, w8):
        return grouped_mm_fp8_dgrad(gq, sg, w8, offs)
    if (GROUPED_DGRAD == "tma" and transposed is None and gq.shape[0] <= STORED_DGRAD_MAX_ROWS * w8.shape[0]
            and tma_supported(gq, w8, False)):
        return grouped_mm_fp8_dgrad(gq, sg, w8, offs)
    k_major = _k_major_copy(w8, grad) if transposed is None else transposed
    # the copy's rows are `out` bytes, a multiple of 16 as _fp8_kernels requires: TMA takes it where it takes w8
    if GROUPED_DGRAD == "tma" and tma_supported(gq, w8, True):
        return _gmm_tma(gq, sg, k_major, offs, None)
    ones = torch.ones(w8.shape[0], w8.shape[2], device=gq.device, dtype=torch.float32)
    return torch._scaled_grouped_mm(gq, k_major.transpose(-2, -1), scale_a=sg.view(-1),
                                    scale_b=ones, offs=offs, out_dtype=grad.dtype,
                                    use_fast_accum=FAST_ACCUM_DGRAD if fast_accum is None else fast_accum)


class _Fp8GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w8, scale, offs, scheme, transposed):
        ctx.save_for_backward(w8, scale, offs, transposed)
        ctx.scheme = scheme
        if _fp8_kernels(x, w8, scheme):
            return _gmm_fwd(x, w8, scale, offs)
        return _grouped_mm(x, scheme.dequantize(w8, scale, x.dtype).transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, g):
        w8, scale, offs, transposed = ctx.saved_tensors
        g = g.contiguous()
        if DGRAD == "fp8" and _fp8_kernels(g, w8, ctx.scheme):
            if GROUPED_DGRAD == "w8a16" and kernel_supported(g, w8, scale):
                dx = torch.ops.moetune.grouped_mm_frozen_dgrad(g, w8, offs, scale)
            else:
                dx = _gmm_dgrad(g, w8, scale, offs, transposed=transposed)
        else:
            dx = _grouped_mm(g, ctx.scheme.dequantize(w8, scale, g.dtype), offs=offs)
        return dx, None, None, None, None, None


def fp8_grouped_linear(x, w8, scale, offs, scheme: Fp8Scheme, transposed=None):
    """Rows x [N, in] sorted by expert (group ends `offs`) × each expert's frozen fp8 weight [E, out, in];
    `transposed`: the stack's kept copy [E, in, out] for the input gradient, or None."""
    return _Fp8GroupedLinear.apply(x, w8, scale, offs, scheme, transposed)


# The routed experts' MLP on an fp8 base without expert LoRA as one autograd node (`fp8_expert_mlp`): True, or each
# GEMM its own node with the SwiGLU between them compiled by Inductor (False, the form that takes expert LoRA).
FUSED_EXPERT_MLP = True


@torch.library.custom_op("moetune::weighted_swiglu_fp8", mutates_args=())
def _weighted_swiglu_fp8(h: torch.Tensor, row_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return weighted_swiglu_fp8(h, row_weights)


@_weighted_swiglu_fp8.register_fake
def _(h, row_weights):
    return h.new_empty(h.shape[0], h.shape[1] // 2, dtype=FP8), h.new_empty(h.shape[0], 1, dtype=torch.float32)


@torch.library.custom_op("moetune::weighted_swiglu_bwd_fp8", mutates_args=())
def _weighted_swiglu_bwd_fp8(h: torch.Tensor, row_weights: torch.Tensor, grad: torch.Tensor, scales: torch.Tensor,
                             expert: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return weighted_swiglu_bwd_fp8(h, row_weights, grad, scales, expert)


@_weighted_swiglu_bwd_fp8.register_fake
def _(h, row_weights, grad, scales, expert):
    n = h.shape[0]
    return (h.new_empty(h.shape, dtype=FP8), h.new_empty(n, 1, dtype=torch.float32),
            h.new_empty(n, dtype=torch.float32))


@torch.library.custom_op("moetune::gathered_rows_fp8", mutates_args=())
def _gathered_rows_fp8(src: torch.Tensor, index: torch.Tensor, scales: torch.Tensor,
                       expert: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return gathered_rows_fp8(src, index, scales, expert)


@_gathered_rows_fp8.register_fake
def _(src, index, scales, expert):
    n = index.shape[0]
    return src.new_empty(n, src.shape[1], dtype=FP8), src.new_empty(n, 1, dtype=torch.float32)


class _Fp8ExpertMLP(torch.autograd.Function):
    """down(swiglu(gate_up(x)) · w) through frozen fp8 stacks, one node: the SwiGLU's output is quantised for down's
    GEMM by the kernel that computes it, and its backward writes gate_up's input-gradient operand (the gradient
    times the expert's weight scales, quantised) in the same pass (model/kernels.py). Keeps what the two nodes
    kept: gate_up's output h."""

    @staticmethod
    def forward(ctx, x, row_weights, gu8, gu_scale, dn8, dn_scale, offs, gu_t, dn_t, xq, sx, inverse, token_idx,
                num_tokens):
        if xq is None:
            xq, sx = _quantized(quantize_rows, x)
        h = _gmm_fwd_quantized(xq, sx, gu8, gu_scale, offs, x.dtype)
        aq, sa = _weighted_swiglu_fp8(h, row_weights)
        ctx.save_for_backward(h, row_weights, gu8, gu_scale, dn8, dn_scale, offs, gu_t, dn_t, token_idx)
        y = _gmm_fwd_quantized(aq, sa, dn8, dn_scale, offs, x.dtype)
        # with the combine: each token's rows summed, and backward reads the tokens' gradient where it gathers it
        return y if inverse is None else gather_sum(y, inverse, num_tokens)

    @staticmethod
    def backward(ctx, g):
        h, row_weights, gu8, gu_scale, dn8, dn_scale, offs, gu_t, dn_t, token_idx = ctx.saved_tensors
        g = g.contiguous()
        expert = expert_of_rows(offs, h.shape[0])
        if token_idx is None:
            da = _gmm_dgrad(g, dn8, dn_scale, offs, transposed=dn_t)
        else:
            gq, sg = _gathered_rows_fp8(g, token_idx, _row_scales(dn_scale), expert)
            da = _gmm_dgrad_quantized(gq, sg, dn8, offs, g, transposed=dn_t)
        dq, sd, grad_w = _weighted_swiglu_bwd_fp8(h, row_weights, da, _row_scales(gu_scale), expert)
        dx = _gmm_dgrad_quantized(dq, sd, gu8, offs, g, transposed=gu_t)
        return dx, grad_w.to(row_weights.dtype), *[None] * 12


def fp8_expert_mlp_applies(x, gate_up, down) -> bool:
    """Whether `fp8_expert_mlp` runs these stacks (FrozenFp8, row scales, on fp8 tensor cores): otherwise the expert
    MLP runs GEMM by GEMM."""
    return (FUSED_EXPERT_MLP and DGRAD == "fp8" and GROUPED_DGRAD in ("fp8", "tma", "w8a8")
            and all(_fp8_kernels(x, w.q, w.scheme) for w in (gate_up, down)))


def fp8_expert_mlp(x, row_weights, gate_up, down, offs, quantized=None, combine=None):
    """Rows x [N, H] sorted by expert (group ends `offs`) through each expert's SwiGLU MLP, each row's output scaled
    by its routing weight: `gate_up` and `down` are FrozenFp8 stacks (tensors local to this rank). `quantized`:
    quantize_rows(x), made by the caller (the rows' tokens quantised, then gathered: one byte a value moved, not
    two), or None. x's values are then not read: compiled, the gather that made x is dropped; its gradient is still
    x's. `combine` (inverse, token_idx, num_tokens) of the rows' permutation (experts.Permutation): each token's rows
    summed ([num_tokens, H] returned), and down's input-gradient operand gathered from the tokens' gradient in the
    pass that scales and quantises it."""
    xq, sx = quantized if quantized is not None else (None, None)
    inverse, token_idx, num_tokens = combine if combine is not None else (None, None, 0)
    return _Fp8ExpertMLP.apply(x, row_weights, gate_up.q, gate_up.scale, down.q, down.scale, offs,
                               gate_up.transposed, down.transposed, xq, sx, inverse, token_idx, num_tokens)


def reference_fp8_grouped_linear(x, w8, scale, offs):
    e = expert_of_rows(offs, x.shape[0])
    xq, sx = quantize_rows(x)
    w = w8.float() * scale.float()
    return torch.einsum("nk,nok->no", xq.float() * sx, w[e])
