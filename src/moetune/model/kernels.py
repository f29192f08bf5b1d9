"""Triton kernels for the MoE layer's eager code: the expert-parallel exchange is a graph break, so what runs
around its grouped GEMMs is not fused by torch.compile. Each kernel has its torch reference beside it, which is
also the path off CUDA; the tests run the kernels on the CPU under Triton's interpreter (`TRITON_INTERPRET=1`)
against those references.

- `bag_sum`: out[m] = Σ_j src[slots[m, j]] over the slots ≥ 0, accumulated in fp32 in slot order (deterministic:
  no atomics) — the exchange's combines, and the local permutation's sums of k rows in eager code
  (model/experts.py). torch has no single op for it: `embedding_bag` does one scalar load per thread, and the EP-2
  step's element-wise work ran at 4× the compiled single-GPU figure with it (34.6 against 8.1 ms on an H200,
  BENCHMARKS.md); a padded gather materialises [m, J, H].
- `weighted_swiglu_fwd` / `_bwd`: silu(gate)·up·w per row and its gradients in one pass each, where eager torch
  takes five kernels forward and twelve backward over the [rows, intermediate] activations.
- `gathered_rows_fp8`: rows gathered, times each row's expert's weight scales, quantised per row (down_proj's
  input-gradient operand on an fp8 base, from the tokens' gradient).
- `scaled_rows_fp8`: rows (times a weight's row scales) quantised per row, one pass each: an fp8 base's dense GEMM
  operands (model/quant/matmul.py's DENSE_QUANT).
- `weighted_swiglu_fp8` / `weighted_swiglu_bwd_fp8`: the same with their outputs quantised per row for an fp8 base's
  expert GEMMs (model/quant/matmul.py `fp8_expert_mlp`), the gradient first multiplied by each row's expert's weight
  scales. Compiled, Inductor writes these as reductions that read their inputs twice and, for the gradient, store
  and reload it in bf16 between the passes (0.78 ms a layer on Air's 32,768 rows); here a row stays on chip.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from moetune.model.quant.fp8 import _TINY, FP8, FP8_MAX, quantize_rows

try:  # optional: the CPU build of torch comes without Triton
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK = 1024  # columns per program of bag_sum: 8 bf16 (16 bytes) per thread with 4 warps


@functools.cache
def compiled_for_eager(fn, backend="inductor"):
    """fn compiled on its own, once per function, for eager code to call (what a compiled graph would fuse, where
    there is none): every caller shares its graphs, static shapes until a dimension is seen to change."""
    return torch.compile(fn, backend=backend)


def kernel_available(device: torch.device) -> bool:
    return triton is not None and (device.type == "cuda" or _interpreted())


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _use_kernel(t: torch.Tensor, use_kernel: bool | None) -> bool:
    return (t.is_cuda and triton is not None) if use_kernel is None else use_kernel


# ------------------------------------------------------------------------------------------------ bag sum
def bag_sum_torch(src: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    m, H = slots.shape[0], src.shape[1]
    if not m or not src.shape[0]:  # no bags, or only empty ones
        return src.new_zeros(m, H)
    picked = src[slots.clamp(min=0)]  # [m, J, H]; the empty slots' rows zeroed below (no padded copy of src)
    picked[slots < 0] = 0
    return picked.sum(1, dtype=torch.promote_types(src.dtype, torch.float32)).to(src.dtype)


def bag_sum(src: torch.Tensor, slots: torch.Tensor, use_kernel: bool | None = None) -> torch.Tensor:
    """src [n, H], slots [m, J] int64 (−1: empty) -> [m, H] in src's dtype."""
    if not _use_kernel(src, use_kernel) or slots.shape[0] == 0 or slots.shape[1] == 0:
        return bag_sum_torch(src, slots)
    src, slots = src.contiguous(), slots.contiguous()
    m, J = slots.shape
    H = src.shape[1]
    out = src.new_empty(m, H)
    _bag_sum_kernel[(m, triton.cdiv(H, BLOCK))](src, slots, out, H, J=J, BLOCK=BLOCK, num_warps=4)
    return out


def gather_sum(rows: torch.Tensor, index: torch.Tensor, n: int, empty_slots: bool = False) -> torch.Tensor:
    """out[t] = Σ_j rows[index[t·k + j]] (n groups of k consecutive indices), accumulated in fp32 in j order;
    `empty_slots`: an index −1 adds nothing (bag_sum's slots)."""
    idx = index.view(n, index.numel() // max(n, 1))
    if not torch.compiler.is_compiling():  # eager: one Triton kernel on CUDA, its torch reference elsewhere
        return bag_sum(rows, idx)
    acc_dtype = torch.promote_types(rows.dtype, torch.float32)
    if empty_slots and rows.shape[0] == 0:
        return rows.new_zeros(n, rows.shape[1])
    acc = None
    for j in range(idx.shape[1]):
        s = idx[:, j]
        picked = rows[s.clamp(min=0) if empty_slots else s].to(acc_dtype)
        if empty_slots:
            picked = torch.where((s >= 0).unsqueeze(-1), picked, 0.0)
        acc = picked if acc is None else acc + picked
    return (acc if acc is not None else rows.new_zeros(n, rows.shape[1], dtype=acc_dtype)).to(rows.dtype)


# ---------------------------------------------------------------------------------------- weighted SwiGLU
def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def weighted_swiglu_fwd_torch(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = swiglu(h).float().mul(w.unsqueeze(-1))
    # not `.to(h.dtype)` where it is a no-op: as the output of an autograd.Function compiled by torch 2.11 on CUDA
    # (experts._WeightedSwiGLU) that alias of the product got a zero gradient (fp32; tests/unit/test_fast_paths.py)
    return y if y.dtype == h.dtype else y.to(h.dtype)


def weighted_swiglu_bwd_torch(h, w, grad, need_w_grad: bool):
    """(grad of h, grad of w or None): the operations autograd would run on the recomputed silu(gate) and
    product."""
    gate, up = h.chunk(2, dim=-1)
    silu = F.silu(gate)
    grad = grad.float()
    grad_w = (silu * up).float().mul(grad).sum(-1) if need_w_grad else None
    grad_product = (grad * w.unsqueeze(-1)).to(h.dtype)
    grad_gate = torch.ops.aten.silu_backward(grad_product * up, gate)
    return torch.cat([grad_gate, grad_product * silu], dim=-1), grad_w


def weighted_swiglu_fwd(h, w, use_kernel: bool | None = None):
    """h [N, 2I] (gate columns, then up), w [N] fp32 -> silu(gate)·up·w [N, I] in h's dtype (fp32 inside)."""
    if not _use_kernel(h, use_kernel) or h.shape[0] == 0:
        return weighted_swiglu_fwd_torch(h, w)
    h, w = h.contiguous(), w.contiguous()
    N, I = h.shape[0], h.shape[1] // 2
    out = h.new_empty(N, I)
    _swiglu_fwd_kernel[(N,)](h, w, out, I, BLOCK=triton.next_power_of_2(I), num_warps=4)
    return out


def weighted_swiglu_bwd(h, w, grad, need_w_grad: bool, use_kernel: bool | None = None):
    if not _use_kernel(h, use_kernel) or h.shape[0] == 0:
        return weighted_swiglu_bwd_torch(h, w, grad, need_w_grad)
    h, w, grad = h.contiguous(), w.contiguous(), grad.contiguous()
    N, I = h.shape[0], h.shape[1] // 2
    grad_h = torch.empty_like(h)
    grad_w = torch.empty(N, dtype=torch.float32, device=h.device)
    _swiglu_bwd_kernel[(N,)](h, w, grad, grad_h, grad_w, I, BLOCK=triton.next_power_of_2(I), num_warps=4)
    return grad_h, grad_w.to(w.dtype) if need_w_grad else None


# ------------------------------------------------------------------------ weighted SwiGLU into fp8 operands
def weighted_swiglu_fp8_torch(h, w):
    """(fp8 [N, I], fp32 scales [N, 1]): weighted_swiglu_fwd's output (in h's dtype) quantised per row."""
    return quantize_rows(weighted_swiglu_fwd_torch(h, w))


def weighted_swiglu_bwd_fp8_torch(h, w, grad, row_scales):
    """(fp8 [N, 2I], fp32 scales [N, 1], grad of w [N] fp32): weighted_swiglu_bwd's grad of h (in h's dtype) times
    `row_scales` [N, 2I] fp32, quantised per row."""
    grad_h, grad_w = weighted_swiglu_bwd_torch(h, w, grad, True)
    q, scale = quantize_rows(grad_h.float() * row_scales)
    return q, scale, grad_w


def weighted_swiglu_fp8(h, w, use_kernel: bool | None = None):
    """h [N, 2I] (gate columns, then up), w [N] fp32 -> silu(gate)·up·w rounded to h's dtype, quantised per row."""
    if not _use_kernel(h, use_kernel) or h.shape[0] == 0:
        return weighted_swiglu_fp8_torch(h, w)
    h, w = h.contiguous(), w.contiguous()
    N, I = h.shape[0], h.shape[1] // 2
    q = torch.empty(N, I, dtype=FP8, device=h.device)
    scale = torch.empty(N, 1, dtype=torch.float32, device=h.device)
    _swiglu_fp8_kernel[(N,)](h, w, q, scale, I, FP8_MAX=FP8_MAX, TINY=_TINY, GRID=_interpreted(),
                             BLOCK=triton.next_power_of_2(I), num_warps=4)
    return q, scale


def weighted_swiglu_bwd_fp8(h, w, grad, scales, expert, use_kernel: bool | None = None):
    """weighted_swiglu_bwd_fp8_torch with the row scales given as a table `scales` [E, 2I] (fp32) and each row's
    `expert` [N] (int): the table row is read where it is used, no [N, 2I] copy of it."""
    if not _use_kernel(h, use_kernel) or h.shape[0] == 0:
        return weighted_swiglu_bwd_fp8_torch(h, w, grad, scales.float()[expert.long()])
    h, w, grad = h.contiguous(), w.contiguous(), grad.contiguous()
    scales, expert = scales.float().contiguous(), expert.contiguous()
    N, I = h.shape[0], h.shape[1] // 2
    q = torch.empty(N, 2 * I, dtype=FP8, device=h.device)
    scale = torch.empty(N, 1, dtype=torch.float32, device=h.device)
    grad_w = torch.empty(N, dtype=torch.float32, device=h.device)
    _swiglu_bwd_fp8_kernel[(N,)](h, w, grad, scales, expert, q, scale, grad_w, I, FP8_MAX=FP8_MAX, TINY=_TINY,
                                 GRID=_interpreted(), BLOCK=triton.next_power_of_2(I), num_warps=4)
    return q, scale, grad_w


def scaled_rows_fp8_torch(x, col_scales=None):
    """(fp8 [N, K], fp32 scales [N, 1]): x times `col_scales` [K] (or [N, K]) fp32 when given, quantised per row."""
    xf = x.float()
    return quantize_rows(xf if col_scales is None else xf * col_scales)


# The widest row scaled_rows_fp8 keeps on chip (one row a program); wider ones take the torch reference.
SCALED_ROWS_MAX = 32768


def scaled_rows_fp8(x, col_scales=None, use_kernel: bool | None = None):
    """x [N, K] (times `col_scales` [K] fp32: a frozen weight's row scales folded into its input gradient's operand)
    quantised per row in one pass, a row on chip: an fp8 base's dense GEMM operands. Compiled, Inductor fuses the
    same quantisation into the kernel that produces x as a reduction that reads (and recomputes) the row twice."""
    if not _use_kernel(x, use_kernel) or x.shape[0] == 0 or x.shape[1] > SCALED_ROWS_MAX:
        return scaled_rows_fp8_torch(x, col_scales)
    x = x.contiguous()
    N, K = x.shape
    q = torch.empty(N, K, dtype=FP8, device=x.device)
    scale = torch.empty(N, 1, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(K)
    cs = x if col_scales is None else col_scales.float().contiguous()  # x: an unread placeholder
    _scaled_rows_fp8_kernel[(N,)](x, cs, q, scale, K, SCALED=col_scales is not None, FP8_MAX=FP8_MAX, TINY=_TINY,
                                  GRID=_interpreted(), BLOCK=block,
                                  num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16)
    return q, scale


def gathered_rows_fp8_torch(src, index, row_scales):
    """(fp8 [N, H], fp32 scales [N, 1]): src[index] times row_scales [N, H] fp32, quantised per row."""
    return scaled_rows_fp8_torch(src[index], row_scales)


def gathered_rows_fp8(src, index, scales, expert, use_kernel: bool | None = None):
    """gathered_rows_fp8_torch with the row scales as a table `scales` [E, H] (fp32) and each row's `expert` [N]:
    one pass, each source row read where it is gathered (an fp8 base's down_proj input-gradient operand, from the
    tokens' output gradient)."""
    if not _use_kernel(src, use_kernel) or index.shape[0] == 0:
        return gathered_rows_fp8_torch(src, index, scales.float()[expert.long()])
    src, index, scales, expert = src.contiguous(), index.contiguous(), scales.float().contiguous(), expert.contiguous()
    N, H = index.shape[0], src.shape[1]
    q = torch.empty(N, H, dtype=FP8, device=src.device)
    scale = torch.empty(N, 1, dtype=torch.float32, device=src.device)
    _gathered_rows_fp8_kernel[(N,)](src, index, scales, expert, q, scale, H, FP8_MAX=FP8_MAX, TINY=_TINY,
                                    GRID=_interpreted(), BLOCK=triton.next_power_of_2(H), num_warps=8)
    return q, scale


if triton is not None:
    @triton.jit
    def _to_fp8(x, dtype: tl.constexpr, GRID: tl.constexpr):
        """x (within ±448) cast to fp8 e4m3, rounding to nearest even. Triton's interpreter rounds that cast wrongly
        where the mantissa carries (31 → 16, 17 → 18): under it (GRID) x is first rounded onto the fp8 grid here,
        after which the cast is exact; compiled, the cast is the hardware's."""
        if GRID:
            step = tl.exp2(tl.maximum(tl.floor(tl.log2(tl.maximum(tl.abs(x), 1e-30))), -6.0) - 3.0)
            t = x / step
            f = tl.floor(t)
            odd = f - 2.0 * tl.floor(f * 0.5)
            x = tl.where(t - f > 0.5, f + 1.0, tl.where(t - f < 0.5, f, f + odd)) * step
        return x.to(dtype)

    @triton.jit
    def _fp8_scale(amax, FP8_MAX: tl.constexpr, TINY: tl.constexpr):
        """quant.fp8.quantize_rows's scale of a row whose largest magnitude is amax."""
        return tl.maximum(amax / FP8_MAX, TINY)

    @triton.jit
    def _fp8_values(x, s, dtype: tl.constexpr, FP8_MAX: tl.constexpr, GRID: tl.constexpr):
        return _to_fp8(tl.clamp(x / s, -FP8_MAX, FP8_MAX), dtype, GRID)

    @triton.jit
    def _swiglu_row(h, w, row, cols, mask, I):
        """silu(gate)·up·w of one row, fp32."""
        g = tl.load(h + row * 2 * I + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h + row * 2 * I + I + cols, mask=mask, other=0.0).to(tl.float32)
        return g * tl.sigmoid(g) * u * tl.load(w + row).to(tl.float32)

    @triton.jit
    def _swiglu_bwd_row(h, w, grad, row, cols, mask, I):
        """(grad of gate, grad of up, grad of w) of one row, fp32."""
        g = tl.load(h + row * 2 * I + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h + row * 2 * I + I + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(grad + row * I + cols, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        dp = dy * tl.load(w + row).to(tl.float32)  # gradient of silu(g)·up
        return dp * u * sig * (1.0 + g * (1.0 - sig)), dp * silu, tl.sum(silu * u * dy, axis=0)

    @triton.jit
    def _swiglu_fwd_kernel(h, w, out, I, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < I
        tl.store(out + row * I + cols, _swiglu_row(h, w, row, cols, mask, I).to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(h, w, grad, grad_h, grad_w, I, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < I
        d_gate, d_up, gw = _swiglu_bwd_row(h, w, grad, row, cols, mask, I)
        tl.store(grad_w + row, gw)
        tl.store(grad_h + row * 2 * I + cols, d_gate.to(grad_h.dtype.element_ty), mask=mask)
        tl.store(grad_h + row * 2 * I + I + cols, d_up.to(grad_h.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_fp8_kernel(h, w, q, scale, I, FP8_MAX: tl.constexpr, TINY: tl.constexpr, GRID: tl.constexpr,
                           BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < I
        a = _swiglu_row(h, w, row, cols, mask, I).to(h.dtype.element_ty).to(tl.float32)
        s = _fp8_scale(tl.max(tl.abs(a), axis=0), FP8_MAX, TINY)
        tl.store(q + row * I + cols, _fp8_values(a, s, q.dtype.element_ty, FP8_MAX, GRID), mask=mask)
        tl.store(scale + row, s)

    @triton.jit
    def _swiglu_bwd_fp8_kernel(h, w, grad, scales, expert, q, scale, grad_w, I, FP8_MAX: tl.constexpr,
                               TINY: tl.constexpr, GRID: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < I
        d_gate, d_up, gw = _swiglu_bwd_row(h, w, grad, row, cols, mask, I)
        tl.store(grad_w + row, gw)
        # rounded to h's dtype, as the gradient the bf16 path hands the GEMM, then times the expert's scales
        e = tl.load(expert + row).to(tl.int64)
        d_gate = d_gate.to(h.dtype.element_ty).to(tl.float32) * tl.load(scales + e * 2 * I + cols, mask=mask,
                                                                          other=0.0)
        d_up = d_up.to(h.dtype.element_ty).to(tl.float32) * tl.load(scales + e * 2 * I + I + cols, mask=mask,
                                                                      other=0.0)
        s = _fp8_scale(tl.maximum(tl.max(tl.abs(d_gate), axis=0), tl.max(tl.abs(d_up), axis=0)), FP8_MAX, TINY)
        tl.store(q + row * 2 * I + cols, _fp8_values(d_gate, s, q.dtype.element_ty, FP8_MAX, GRID), mask=mask)
        tl.store(q + row * 2 * I + I + cols, _fp8_values(d_up, s, q.dtype.element_ty, FP8_MAX, GRID), mask=mask)
        tl.store(scale + row, s)

    @triton.jit
    def _scaled_rows_fp8_kernel(x, cs, q, scale, K, SCALED: tl.constexpr, FP8_MAX: tl.constexpr, TINY: tl.constexpr,
                                GRID: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < K
        v = tl.load(x + row * K + cols, mask=mask, other=0.0).to(tl.float32)
        if SCALED:
            v = v * tl.load(cs + cols, mask=mask, other=0.0)
        s = _fp8_scale(tl.max(tl.abs(v), axis=0), FP8_MAX, TINY)
        tl.store(q + row * K + cols, _fp8_values(v, s, q.dtype.element_ty, FP8_MAX, GRID), mask=mask)
        tl.store(scale + row, s)

    @triton.jit
    def _gathered_rows_fp8_kernel(src, index, scales, expert, q, scale, H, FP8_MAX: tl.constexpr, TINY: tl.constexpr,
                                  GRID: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        t = tl.load(index + row).to(tl.int64)
        e = tl.load(expert + row).to(tl.int64)
        x = tl.load(src + t * H + cols, mask=mask, other=0.0).to(tl.float32)
        x = x * tl.load(scales + e * H + cols, mask=mask, other=0.0)
        s = _fp8_scale(tl.max(tl.abs(x), axis=0), FP8_MAX, TINY)
        tl.store(q + row * H + cols, _fp8_values(x, s, q.dtype.element_ty, FP8_MAX, GRID), mask=mask)
        tl.store(scale + row, s)

    @triton.jit
    def _bag_sum_kernel(src, slots, out, H, J: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(J):
            s = tl.load(slots + row * J + j).to(tl.int64)
            if s >= 0:
                acc += tl.load(src + s * H + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out + row.to(tl.int64) * H + cols, acc.to(out.dtype.element_ty), mask=mask)
