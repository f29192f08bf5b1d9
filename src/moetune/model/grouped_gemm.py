"""A Triton grouped GEMM for frozen expert stacks (bf16, or fp8 e4m3 with one scale per output row): the forward
y = x · W[e]ᵀ and the input gradient dx = dy · W[e], both reading the stack as stored, on the tile schedule of
model/grouped_gemm_tiles.py (rows sorted by expert, group ends `offs`, weight [E, out, in]).

The input gradient is the same kernel with the weight's strides swapped (the reduction runs over `out`): no
transposed copy of the stack. An fp8 weight is converted to bf16 in registers for a bf16 MMA (W8A16: no activation
quantisation, so the numerics are the dequantised GEMM's up to accumulation order); its row scale multiplies the
output columns in the forward's epilogue, and the incoming gradient's columns as they are loaded in the input
gradient (the scale lies inside that sum).

`grouped_mm_frozen` is the autograd-facing op (a torch.library custom op, opaque to Inductor): it gives only the
input's gradient (the weight is frozen); it and the fp8 ops run model/grouped_gemm_tma.py's TMA kernel where that
takes the operands, else this kernel. `grouped_mm_frozen_lora` adds a LoRA branch in the TMA kernel's epilogue, its
thin products by model/grouped_lora_kernels.py; `grouped_mm_frozen_rows` reads its rows through an index in the TMA
kernel's loads (the permutation's gathers, model/experts.py's GATHER_IN_GEMM). `grouped_mm_reference` is the torch
computation, which is also the path off CUDA; the tests run the kernels on the CPU under Triton's interpreter against
it.
"""

from __future__ import annotations

import torch

# the switches (KERNEL_ON_CPU, CONFIG) and the neighbours' functions read through their modules at call time: a switch
# set there, or a stand-in for `tma.grouped_gemm_tma` (the tests' launch spies), takes effect here too
from moetune.model import grouped_gemm_tiles, grouped_lora_kernels
from moetune.model import grouped_gemm_tma as tma
from moetune.model.grouped_gemm_tiles import _interpreting
from moetune.model.recompute import register_product

try:  # optional: the CPU build of torch comes without Triton
    import triton
    import triton.language as tl
except ImportError:
    triton = None


# ------------------------------------------------------------------------------------------------ reference
def grouped_mm_reference(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, scale: torch.Tensor | None = None,
                         transpose: bool = True) -> torch.Tensor:
    """y[rows of e] = x[rows of e] · op(W[e]) in fp32, in x's dtype; op(W) = Wᵀ (`transpose`, the forward) or W (the
    input gradient), W = weight · scale (row-wise) when a scale is given. Rows past the last group end get zeros."""
    E, n_out, n_in = weight.shape
    y = torch.zeros(x.shape[0], n_out if transpose else n_in, dtype=torch.float32, device=x.device)
    ends = offs.tolist()
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            w = weight[e].float()
            if scale is not None:
                w = w * scale[e].reshape(n_out, 1).float()
            y[start:end] = x[start:end].float() @ (w.t() if transpose else w)
        start = max(start, end)
    return y.to(x.dtype)


def scaled_grouped_mm_reference(a, b, scale_a, scale_b, offs, out_dtype, **_):
    """torch._scaled_grouped_mm's row-wise product in fp32 torch, where it has no kernel (the CPU tests put it in
    its place): rows a [N, K] fp8 sorted by group (ends `offs`) with row scales scale_a [N] × each group's
    b [E, K, O] fp8 with column scales scale_b [E, O]."""
    x = a.float() * scale_a.float().reshape(-1, 1)
    return grouped_mm_reference(x, b.transpose(-2, -1), offs, scale_b).to(out_dtype)


# ------------------------------------------------------------------------------------------------ kernel
if triton is not None:
    from moetune.model.grouped_gemm_tiles import _tile

    @triton.jit
    def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, scale_ptr, ascale_ptr, offs_ptr, M, N, K,
                             stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
                             stride_se, stride_ss,
                             E, E_POW2: tl.constexpr, SCALE: tl.constexpr, DOT_FP32: tl.constexpr,
                             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                             SWAP: tl.constexpr, PREFETCH: tl.constexpr = False):
        """C[rows of g] = A[rows of g] · B[g] with B[g][k, n] at b_ptr + g·stride_be + k·stride_bk + n·stride_bn.
        SCALE 0: none; 1: C[:, n] *= s[g, n] (forward); 2: A[:, k] *= s[g, k] as loaded (input gradient);
        3: A and B both fp8 (an fp8 × fp8 MMA), C[m, n] *= a_s[m] · s[g, n] (the forward, W8A8);
        4: A and B both fp8, C[m, n] *= a_s[m] (the input gradient, W8A8: the weight's scales are in A already).
        PREFETCH: B's next tile is loaded into registers while this one multiplies — for a B the MMA needs
        transposed (fp8 read as stored), which Triton stages through registers and does not pipeline itself."""
        g, row0, row_b, tn = _tile(tl.program_id(0), offs_ptr, M, N, E, E_POW2, BM, BN, GROUP_M)
        if row0 >= row_b:
            return

        rm = row0 + tl.arange(0, BM)
        rn = tn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        m_mask = rm < row_b
        n_mask = rn < N
        g64 = g.to(tl.int64)
        a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * stride_am + rk[None, :] * stride_ak
        b_ptrs = b_ptr + g64 * stride_be + rk[:, None] * stride_bk + rn[None, :] * stride_bn
        s_ptrs = scale_ptr + g64 * stride_se + rk * stride_ss
        if SWAP:
            acc_t = tl.zeros((BN, BM), dtype=tl.float32)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        k_end = tl.where(g < E, K, 0)  # the padding group E has nothing to sum
        if PREFETCH:
            b_next = tl.load(b_ptrs, mask=(rk < k_end)[:, None] & n_mask[None, :], other=0.0)
        for k0 in range(0, k_end, BK):
            k_mask = rk < K - k0
            a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            if PREFETCH:
                b = b_next
                b_next = tl.load(b_ptrs + BK * stride_bk, mask=(rk < K - k0 - BK)[:, None] & n_mask[None, :],
                                 other=0.0)
            else:
                b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if SCALE == 2:
                s = tl.load(s_ptrs, mask=k_mask, other=0.0)
                a = (a.to(tl.float32) * s[None, :]).to(a_ptr.dtype.element_ty)
            b = b.to(a_ptr.dtype.element_ty)
            if DOT_FP32:  # Triton's interpreter gets bf16 dots wrong; bf16 products are exact in fp32
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if SWAP:  # Cᵀ = Bᵀ·Aᵀ: the (converted) weight is the MMA's first operand
                acc_t += tl.dot(tl.trans(b), tl.trans(a))
            else:
                acc += tl.dot(a, b)
            a_ptrs += BK * stride_ak
            b_ptrs += BK * stride_bk
            s_ptrs += BK * stride_ss
        if SWAP:
            acc = tl.trans(acc_t)
        if SCALE == 1 or SCALE == 3:
            # the padding group's zeros read expert E − 1's scales (in bounds, finite)
            s = tl.load(scale_ptr + tl.minimum(g64, E - 1) * stride_se + rn * stride_ss, mask=n_mask, other=0.0)
            acc = acc * s[None, :]
        if SCALE == 3 or SCALE == 4:
            acc = acc * tl.load(ascale_ptr + rm, mask=m_mask, other=0.0)[:, None]
        c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _config(BM, BN, BK, stages, warps, GROUP_M=8, SWAP=False, PREFETCH=False):
    return triton.Config(dict(BM=BM, BN=BN, BK=BK, GROUP_M=GROUP_M, SWAP=SWAP, PREFETCH=PREFETCH), num_warps=warps,
                         num_stages=stages)


def smem_bytes(BM, BN, BK, stages, weight_bytes=2) -> int:
    """The operand tiles' shared memory across pipeline stages (what rules a config out: ~227 KiB on an H100/H200)."""
    return stages * BK * (BM * 2 + BN * weight_bytes)


# The autotuner's candidates (keyed by the GEMM's N, K, expert count and dtypes; not by the row count, which changes
# every step under expert parallelism). benchmarks/grouped_gemm.py sweeps a wider set; put its winners here.
AUTOTUNE = [(128, 128, 64, 4, 8), (128, 256, 64, 3, 8), (64, 128, 64, 4, 4), (64, 256, 64, 3, 8),
            (128, 128, 128, 3, 8), (64, 128, 128, 3, 4), (128, 64, 64, 4, 4), (64, 64, 64, 4, 4)]

# fp8 × fp8 (W8A8): one byte per operand element, so deeper K tiles (the fp8 MMA consumes 32 of K per instruction)
AUTOTUNE_FP8 = [(128, 128, 128, 4, 8), (128, 256, 128, 3, 8), (64, 128, 128, 4, 4), (64, 256, 128, 4, 8),
                (128, 128, 64, 4, 8), (128, 64, 128, 4, 4), (256, 128, 128, 3, 8), (64, 64, 128, 4, 4)]

# fp8 × fp8 input gradient: the stack is read as stored, so the weight tile is N-major (the reduction runs over the
# stack's rows) and the MMA needs it transposed; SWAP makes it the first operand, which the MMA may take from registers
AUTOTUNE_FP8_DGRAD = [(128, 128, 128, 4, 8, 8, False, True), (128, 128, 128, 4, 8, 8, True, True),
                      (64, 128, 128, 4, 4, 8, False, True), (128, 128, 128, 4, 8, 8, False, False)]

if triton is not None:
    _grouped_gemm_fp8_dgrad_autotuned = triton.autotune(
        configs=[_config(*c) for c in AUTOTUNE_FP8_DGRAD], key=["N", "K", "E", "SCALE"])(_grouped_gemm_kernel)
    _grouped_gemm_autotuned = triton.autotune(
        configs=[_config(*c) for c in AUTOTUNE] + [_config(128, 128, 64, 4, 8, SWAP=True),
                                                    _config(64, 128, 64, 4, 4, SWAP=True)],
        key=["N", "K", "E", "SCALE"])(_grouped_gemm_kernel)
    _grouped_gemm_fp8_autotuned = triton.autotune(
        configs=[_config(*c) for c in AUTOTUNE_FP8], key=["N", "K", "E", "SCALE"])(_grouped_gemm_kernel)


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, scale: torch.Tensor | None = None,
                 transpose: bool = True, config: dict | None = None,
                 x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's launch: x [M, ·] (any strides) · op(W[e]) per group, W [E, out, in] bf16/fp16 (x's dtype) or fp8
    with `scale` [E, out(, 1)] fp32; op(W) = Wᵀ (`transpose`: y [M, out]) or W (y [M, in]). x fp8 too (W8A8, the
    forward, and the input gradient with `scale` None: the weight's scales folded into x before it was quantised):
    `x_scale` [M(, 1)] fp32 its row scales, y in bf16. `config`: a dict of BM, BN, BK, GROUP_M, SWAP, num_warps,
    num_stages (default: `grouped_gemm_tiles.CONFIG`, the interpreter's, or autotuned)."""
    E, n_out, n_in = weight.shape
    M = x.shape[0]
    N, K = (n_out, n_in) if transpose else (n_in, n_out)
    w8a8 = x.dtype == torch.float8_e4m3fn
    assert x.shape[1] == K and offs.shape == (E,), (x.shape, weight.shape, offs.shape)
    if w8a8:  # the input gradient: the weight's scales folded into x (on a stack as stored, or a K-major copy)
        assert weight.dtype == x.dtype and (scale is None or transpose) and x_scale is not None
    else:
        assert weight.dtype in (x.dtype, torch.float8_e4m3fn) and (scale is None) == (weight.dtype == x.dtype)
    y = x.new_empty(M, N, dtype=torch.bfloat16 if w8a8 else x.dtype)
    if M == 0 or N == 0:
        return y
    if K == 0 or E == 0:
        return y.zero_()
    stride_we, stride_wo, stride_wi = weight.stride()
    stride_bk, stride_bn = (stride_wi, stride_wo) if transpose else (stride_wo, stride_wi)
    if scale is None:
        scale_t, stride_se, stride_ss, mode = offs, 0, 0, 4 if w8a8 else 0  # an unread placeholder pointer
    else:
        scale_t = scale.reshape(E, n_out)
        stride_se, stride_ss = scale_t.stride()
        mode = 3 if w8a8 else 1 if transpose else 2
    x_scale = x_scale.reshape(M).float().contiguous() if w8a8 else offs  # else an unread placeholder
    offs = offs.to(torch.int32)
    args = (x, weight, y, scale_t, x_scale, offs, M, N, K, x.stride(0), x.stride(1), stride_we, stride_bk, stride_bn,
            y.stride(0), y.stride(1), stride_se, stride_ss, E)
    meta = dict(E_POW2=triton.next_power_of_2(E + 1), SCALE=mode, DOT_FP32=_interpreting())
    config = config or grouped_gemm_tiles.CONFIG or (
        grouped_gemm_tiles._INTERPRETER_CONFIG if _interpreting() else None)

    def grid(m):
        return ((M // m["BM"] + E + 1) * triton.cdiv(N, m["BN"]),)

    if config is None:
        tuned = (_grouped_gemm_fp8_autotuned if transpose else _grouped_gemm_fp8_dgrad_autotuned) if w8a8 \
            else _grouped_gemm_autotuned
        tuned[grid](*args, **meta)
    else:
        _grouped_gemm_kernel[grid(config)](*args, **meta, **config)
    return y


def kernel_supported(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """Whether the kernel takes these operands: 16-bit activations, a weight in their dtype or fp8 with row scales."""
    if triton is None or x.dtype not in (torch.bfloat16, torch.float16) or weight.dim() != 3:
        return False
    if scale is None:
        return weight.dtype == x.dtype
    return weight.dtype == torch.float8_e4m3fn and scale.numel() == weight.shape[0] * weight.shape[1]


def kernel_supported_w8a8(x8: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes an fp8 × fp8 forward: activations and weight stack both e4m3."""
    return (triton is not None and x8.dtype == torch.float8_e4m3fn and weight.dtype == torch.float8_e4m3fn
            and weight.dim() == 3)


def lora_epilogue_fits(x: torch.Tensor, weight: torch.Tensor, rank: int) -> bool:
    """Whether the TMA kernel adds a rank-`rank` LoRA product in its epilogue for these operands (both directions):
    16-bit, the rank a power of two from 16 (the MMA's K) to 64 (its tiles beside the operands' in shared memory)."""
    return (rank in grouped_gemm_tiles.LORA_RANKS and (x.is_cuda or grouped_gemm_tiles.KERNEL_ON_CPU)
            and tma.tma_supported(x, weight, True)
            and tma.tma_supported(x.new_empty(0, weight.shape[1]), weight, False))


def _run_lora(x, weight, offs, transpose, L, P, rows=None):
    """x · op(W[e]) + L · P[e] per group (op as `_run`), one rounding; the TMA kernel's epilogue where it fits, else
    both products in fp32 by the reference. `rows`: the product's rows are x[rows] (the kernel gathers them)."""
    if lora_epilogue_fits(x, weight, L.shape[1]):
        return tma.grouped_gemm_tma(x, weight, offs, None, transpose, lora=(L, P), a_rows=rows)
    x = x if rows is None else x[rows]
    y = grouped_mm_reference(x.float(), weight, offs, None, transpose)
    return (y + grouped_mm_reference(L.float(), P, offs, None, transpose=False)).to(x.dtype)


def _run(x, weight, offs, scale, transpose):
    if (x.is_cuda or grouped_gemm_tiles.KERNEL_ON_CPU) and scale is None and tma.tma_supported(x, weight, transpose):
        return tma.grouped_gemm_tma(x, weight, offs, None, transpose)
    if (x.is_cuda or grouped_gemm_tiles.KERNEL_ON_CPU) and kernel_supported(x, weight, scale):
        return grouped_gemm(x, weight, offs, scale, transpose)
    return grouped_mm_reference(x.contiguous(), weight, offs, scale, transpose)


# ------------------------------------------------------------------------------------------------ custom ops
@torch.library.custom_op("moetune::grouped_mm_frozen", mutates_args=())
def _grouped_mm_frozen_op(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                          scale: torch.Tensor | None) -> torch.Tensor:
    return _run(x, weight, offs, scale, True)


@torch.library.custom_op("moetune::grouped_mm_frozen_dgrad", mutates_args=())
def _grouped_mm_frozen_dgrad_op(grad: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                                scale: torch.Tensor | None) -> torch.Tensor:
    return _run(grad, weight, offs, scale, False)


# A product whose rows are gathered: the permutation by expert's gathers of the tokens (forward) and of their
# gradient (the combine's backward), read by the TMA kernel's A loads instead of written out as [rows, K] first.
@torch.library.custom_op("moetune::grouped_mm_frozen_rows", mutates_args=())
def _grouped_mm_frozen_rows_op(x: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                               transpose: bool) -> torch.Tensor:
    """x[rows] · op(W[e]) per group of a frozen 16-bit stack (op as `_run`): the TMA kernel gathers the rows where it
    takes the operands, elsewhere x[rows] is made and multiplied. No autograd (experts.py composes the backward)."""
    if (x.is_cuda or grouped_gemm_tiles.KERNEL_ON_CPU) and tma.tma_supported(x, weight, transpose):
        return tma.grouped_gemm_tma(x, weight, offs, None, transpose, a_rows=rows)
    return _run(x[rows], weight, offs, None, transpose)


@_grouped_mm_frozen_rows_op.register_fake
def _(x, rows, weight, offs, transpose):
    return x.new_empty(rows.shape[0], weight.shape[1] if transpose else weight.shape[2])


register_product(torch.ops.moetune.grouped_mm_frozen_rows.default)


@torch.library.custom_op("moetune::grouped_mm_fp8", mutates_args=())
def grouped_mm_fp8(x8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                   scale: torch.Tensor | None) -> torch.Tensor:
    """The fp8 × fp8 forward (W8A8): rows x8 [N, in] e4m3 with row scales `x_scale` [N, 1] × each expert's e4m3 weight
    [E, out, in] with row scales `scale` [E, out, 1], fp32 accumulation, bf16 out — the numerics of
    torch._scaled_grouped_mm's row-wise path. `scale` None: the input gradient on a K-major copy of the stack, the
    weight's scales folded into x8. No autograd (model/quant/matmul.py gives the input gradient)."""
    if (x8.is_cuda or grouped_gemm_tiles.KERNEL_ON_CPU) and tma.tma_supported(x8, weight, True):
        return tma.grouped_gemm_tma(x8, weight, offs, scale, True, x_scale=x_scale)
    if (x8.is_cuda or grouped_gemm_tiles.KERNEL_ON_CPU) and kernel_supported_w8a8(x8, weight):
        return grouped_gemm(x8, weight, offs, scale, True, x_scale=x_scale)
    return grouped_mm_reference(x8.float() * x_scale.reshape(-1, 1).float(), weight, offs, scale,
                                True).to(torch.bfloat16)


@torch.library.custom_op("moetune::grouped_mm_fp8_dgrad", mutates_args=())
def grouped_mm_fp8_dgrad(g8: torch.Tensor, g_scale: torch.Tensor, weight: torch.Tensor,
                         offs: torch.Tensor) -> torch.Tensor:
    """The fp8 × fp8 input gradient (W8A8): rows g8 [N, out] e4m3 — the incoming gradient with each row's expert's
    weight scales folded in, then quantised per row (`g_scale` [N, 1]) — × each expert's e4m3 weight [E, out, in]
    read as stored: dx [N, in] bf16, fp32 accumulation. The numerics of model/quant/matmul.py's `_gmm_dgrad`."""
    if (g8.is_cuda or grouped_gemm_tiles.KERNEL_ON_CPU) and tma.tma_supported(g8, weight, False):
        return tma.grouped_gemm_tma(g8, weight, offs, None, False, x_scale=g_scale)
    if (g8.is_cuda or grouped_gemm_tiles.KERNEL_ON_CPU) and kernel_supported_w8a8(g8, weight):
        return grouped_gemm(g8, weight, offs, None, False, x_scale=g_scale)
    return grouped_mm_reference(g8.float() * g_scale.reshape(-1, 1).float(), weight, offs, None,
                                False).to(torch.bfloat16)


@grouped_mm_fp8_dgrad.register_fake
def _(g8, g_scale, weight, offs):
    return g8.new_empty(g8.shape[0], weight.shape[2], dtype=torch.bfloat16)


@grouped_mm_fp8.register_fake
def _(x8, x_scale, weight, offs, scale):
    return x8.new_empty(x8.shape[0], weight.shape[1], dtype=torch.bfloat16)


@_grouped_mm_frozen_op.register_fake
def _(x, weight, offs, scale):
    return x.new_empty(x.shape[0], weight.shape[1])


@_grouped_mm_frozen_dgrad_op.register_fake
def _(grad, weight, offs, scale):
    return grad.new_empty(grad.shape[0], weight.shape[2])


def _setup_context(ctx, inputs, output):
    _, weight, offs, scale = inputs
    ctx.save_for_backward(weight, offs, scale)


def _backward(ctx, grad):
    weight, offs, scale = ctx.saved_tensors
    dx = torch.ops.moetune.grouped_mm_frozen_dgrad(grad, weight, offs, scale) if ctx.needs_input_grad[0] else None
    return dx, None, None, None


_grouped_mm_frozen_op.register_autograd(_backward, setup_context=_setup_context)
register_product(torch.ops.moetune.grouped_mm_frozen.default)


# A frozen bf16 stack with LoRA on it, one op each way: the LoRA branch's s·(x·Aᵀ)·Bᵀ added in the kernel's epilogue
# (forward), and in the input gradient's its (dy·s·B)·A, instead of each written out as [rows, out] and added by a pass
# of its own. The thin products (x·Aᵀ, dy·s·B, A's and B's gradients) by model/grouped_lora_kernels.py's kernels.
@torch.library.custom_op("moetune::grouped_mm_frozen_lora", mutates_args=())
def _grouped_mm_frozen_lora_op(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, lora_A: torch.Tensor,
                               lora_B: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    xa = grouped_lora_kernels.lora_rows(x, lora_A.transpose(-2, -1), offs)
    return _run_lora(x, weight, offs, True, xa, (lora_B * scaling).transpose(-2, -1)), xa


@_grouped_mm_frozen_lora_op.register_fake
def _(x, weight, offs, lora_A, lora_B, scaling):
    return x.new_empty(x.shape[0], weight.shape[1]), x.new_empty(x.shape[0], lora_A.shape[1])


@torch.library.custom_op("moetune::grouped_mm_frozen_lora_dgrad", mutates_args=())
def _grouped_mm_frozen_lora_dgrad_op(grad: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                                     grad_xa: torch.Tensor, lora_A: torch.Tensor,
                                     rows: torch.Tensor | None = None) -> torch.Tensor:
    return _run_lora(grad, weight, offs, False, grad_xa, lora_A, rows)


@_grouped_mm_frozen_lora_dgrad_op.register_fake
def _(grad, weight, offs, grad_xa, lora_A, rows=None):
    return grad.new_empty(grad_xa.shape[0], weight.shape[2])


# The LoRA op's forward on gathered rows (x[rows], the kernels' loads read them through the index): no autograd here,
# model/experts.py composes the backward of the expansion it belongs to.
@torch.library.custom_op("moetune::grouped_mm_frozen_lora_rows", mutates_args=())
def _grouped_mm_frozen_lora_rows_op(x: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                                    lora_A: torch.Tensor, lora_B: torch.Tensor,
                                    scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    xa = grouped_lora_kernels.lora_rows(x, lora_A.transpose(-2, -1), offs, rows=rows)
    return _run_lora(x, weight, offs, True, xa, (lora_B * scaling).transpose(-2, -1), rows), xa


@_grouped_mm_frozen_lora_rows_op.register_fake
def _(x, rows, weight, offs, lora_A, lora_B, scaling):
    return x.new_empty(rows.shape[0], weight.shape[1]), x.new_empty(rows.shape[0], lora_A.shape[1])


register_product(torch.ops.moetune.grouped_mm_frozen_lora_rows.default)


def _lora_setup_context(ctx, inputs, output):
    x, weight, offs, lora_A, lora_B, scaling = inputs
    ctx.save_for_backward(x, weight, offs, lora_A, lora_B, output[1])
    ctx.scaling = scaling


def _lora_backward(ctx, grad, _grad_xa):
    # x·Aᵀ is an output only to be saved: nothing outside reads it, so its gradient is zero
    x, weight, offs, lora_A, lora_B, xa = ctx.saved_tensors
    grad = grad.contiguous()
    ops = torch.ops.moetune  # opaque: the backward is traced, and the kernels launch at run time
    grad_xa = ops.lora_rows(grad, lora_B, offs, ctx.scaling)
    grad_B = ops.ragged_outer(grad, xa, offs, ctx.scaling)
    grad_A = ops.ragged_outer(grad_xa, x, offs, 1.0)
    dx = None
    if ctx.needs_input_grad[0]:
        dx = torch.ops.moetune.grouped_mm_frozen_lora_dgrad(grad, weight, offs, grad_xa, lora_A)
    return dx, None, None, grad_A, grad_B, None


_grouped_mm_frozen_lora_op.register_autograd(_lora_backward, setup_context=_lora_setup_context)
register_product(torch.ops.moetune.grouped_mm_frozen_lora.default)


def grouped_mm_frozen_lora(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, lora_A: torch.Tensor,
                           lora_B: torch.Tensor, scaling: float) -> torch.Tensor:
    """grouped_mm_frozen(x, weight, offs) + scaling·(x·A[e]ᵀ)·B[e]ᵀ per group, for LoRA's A [E, r, in] and B [E, out, r]
    in x's dtype (bf16 on the kernel's path: `lora_epilogue_fits`; elsewhere the fp32 reference). Autograd gives x's,
    A's and B's gradients."""
    assert not weight.requires_grad, "grouped_mm_frozen_lora: the stack is frozen (it gets no gradient)"
    return torch.ops.moetune.grouped_mm_frozen_lora(x, weight, offs, lora_A, lora_B, scaling)[0]


def grouped_mm_frozen(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                      scale: torch.Tensor | None = None) -> torch.Tensor:
    """Rows x [N, in] sorted by expert (group ends `offs`, int32 [E]) × each expert's frozen weight [E, out, in]
    transposed: y [N, out] in x's dtype. `weight` bf16 (x's dtype) or fp8 e4m3 with row scales `scale` [E, out, 1];
    autograd gives x's gradient only. On CUDA the Triton kernel, elsewhere the torch reference."""
    assert not weight.requires_grad, "grouped_mm_frozen: the weight is frozen (it gets no gradient)"
    assert scale is None or not scale.requires_grad
    return torch.ops.moetune.grouped_mm_frozen(x, weight, offs, scale)
