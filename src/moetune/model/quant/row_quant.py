"""Row-wise fp8 quantisation of an activation in one pass: `quantize_rows` (fp8.py), optionally of the activation with
a column scale per group of rows folded in first — the fp8 input gradient's operand, dy · diag(s_e) for the rows of
expert e (model/quant/matmul.py).

Why a kernel of our own: inside a compiled MoE layer Inductor fuses this quantisation with its neighbours (the
permutation's gather, the folded scales looked up per element) into looped reductions that read each row twice. In a
traced EP-8 rank of Air on an fp8 base they took ~69 ms of a 437 ms step for ~54 GB of traffic (~0.8 TB/s,
BENCHMARKS.md, eleventh session). Here a program holds a whole row in registers: one read, one write.

`row_quant` is a torch.library custom op (opaque to Inductor) whose result equals `reference` bit for bit: the same
fp32 products, the exact row maximum, IEEE division (div_rn) and round-to-nearest into e4m3. The reference is also the
path off CUDA; the tests run the kernel on the CPU under Triton's interpreter against it.
"""

from __future__ import annotations

import os

import torch

from moetune.model.quant.fp8 import FP8, FP8_MAX, _TINY, quantize_rows

try:  # optional: the CPU build of torch comes without Triton
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# Run the kernel (not the reference) on CPU tensors too: the tests set it under the interpreter.
KERNEL_ON_CPU = False


def reference(x: torch.Tensor, col_scale: torch.Tensor | None = None,
              offs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows(x · col_scale[group of the row]): col_scale [G, K] fp32, the rows sorted by group with group ends
    `offs` (int32 [G], cumulative; rows past the last end take the last group); without offs every row takes row 0."""
    if col_scale is None:
        return quantize_rows(x)
    if offs is None:
        return quantize_rows(x.float() * col_scale[0])
    return quantize_rows(x.float() * col_scale[group_of_rows(offs, x.shape[0])])


def group_of_rows(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """The group (expert) of each of `rows` rows sorted by group with group ends `offs`; rows past the last end
    (padding) get the last group."""
    idx = torch.searchsorted(offs, torch.arange(rows, device=offs.device, dtype=offs.dtype), right=True)
    return idx.clamp_(max=offs.numel() - 1)


if triton is not None:
    @triton.jit
    def _row_quant_kernel(x_ptr, q_ptr, s_ptr, col_ptr, offs_ptr, K, G, stride_x,
                          HAS_COL: tl.constexpr, HAS_OFFS: tl.constexpr, G_POW2: tl.constexpr,
                          BLOCK_K: tl.constexpr, FP8_MAX: tl.constexpr, TINY: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_K)
        mask = cols < K
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_COL:
            group = 0
            if HAS_OFFS:  # the row's group: how many group ends lie at or before it (searchsorted, right)
                g = tl.arange(0, G_POW2)
                ends = tl.load(offs_ptr + g, mask=g < G, other=2147483647)
                group = tl.minimum(tl.sum((ends <= row).to(tl.int32), axis=0), G - 1)
            x = x * tl.load(col_ptr + group * K + cols, mask=mask, other=0.0)
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), FP8_MAX), TINY)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * K + cols, y.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)


def kernel(x: torch.Tensor, col_scale: torch.Tensor | None = None,
           offs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel: x [N, K] (rows contiguous), col_scale [G, K] fp32, offs int32 [G]."""
    N, K = x.shape
    # Triton 3.9's interpreter rounds fp32 -> e4m3 wrongly where the rounding carries into the exponent (124.3 -> 64,
    # not 128): under it the kernel writes the scaled fp32 values and torch casts them (a GPU casts in the kernel)
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    q = torch.empty(N, K, dtype=torch.float32 if interpreting else FP8, device=x.device)
    s = torch.empty(N, 1, dtype=torch.float32, device=x.device)
    if N == 0:
        return q.to(FP8), s
    if x.stride(-1) != 1:
        x = x.contiguous()
    G = col_scale.shape[0] if col_scale is not None else 1
    col = col_scale.float().contiguous() if col_scale is not None else s
    ends = offs.to(torch.int32).contiguous() if offs is not None else s
    block = triton.next_power_of_2(K)
    _row_quant_kernel[(N,)](x, q, s, col, ends, K, G, x.stride(0), HAS_COL=col_scale is not None,
                            HAS_OFFS=offs is not None, G_POW2=triton.next_power_of_2(G), BLOCK_K=block,
                            FP8_MAX=FP8_MAX, TINY=_TINY, num_warps=max(1, min(16, block // 256)))
    return (q.to(FP8) if interpreting else q), s


def _kernel_runs(x: torch.Tensor) -> bool:
    return triton is not None and (x.is_cuda or (KERNEL_ON_CPU and os.environ.get("TRITON_INTERPRET") == "1"))


@torch.library.custom_op("moetune::row_quant", mutates_args=())
def row_quant(x: torch.Tensor, col_scale: torch.Tensor | None = None,
              offs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] e4m3, scale [N, 1] fp32) of reference(x, col_scale, offs), by the kernel where it runs."""
    if x.dim() != 2 or not _kernel_runs(x):
        return reference(x, col_scale, offs)
    return kernel(x, col_scale, offs)


@row_quant.register_fake
def _(x, col_scale=None, offs=None):
    return x.new_empty(x.shape, dtype=FP8), x.new_empty(*x.shape[:-1], 1, dtype=torch.float32)
