"""The two products of a LoRA linear's backward that read its output gradient dy [M, N]: the gradient reaching
x·Aᵀ, grad_h = s·dy·B [M, r], and B's gradient, grad_B = s·dyᵀ·h [N, r] (h = x·Aᵀ). `dy_products` makes both from
one read of dy (a Triton kernel; torch's two GEMMs, its reference and the path where the kernel does not run).
"""

from __future__ import annotations

import torch

from moetune.model import grouped_gemm_tiles  # KERNEL_ON_CPU read through its module at call time
from moetune.model.grouped_gemm_tiles import _interpreting

try:  # optional: the CPU build of torch comes without Triton
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# Each product alone is a thin GEMM that streams dy (cuBLAS's split-K for grad_B and its reduction, one more pass for
# grad_h); on GLM-4.5-Air's q (dy 4,096 × 12,288) that is 100 MB read twice a layer. The kernel reads a tile of dy once
# for both: a program takes a block of rows and a run of columns, adds its tile's dy·B into the rows' grad_h and
# writes the tile's dyᵀ·h, partial sums over its block of rows; the partials are then summed in a fixed order
# (deterministic, no atomics). False: torch's two GEMMs.
DY_KERNEL = True
_RANKS = (16, 32, 64)  # an MMA dimension: powers of two from the MMA's 16
_CONFIG = dict(BM=128, BN=64, num_warps=4, num_stages=3)
_INTERPRETER_CONFIG = dict(BM=16, BN=16, num_warps=1, num_stages=1)
_TARGET_PROGRAMS = 264  # two waves of an H100/H200's 132 SMs

if triton is not None:
    @triton.jit
    def _dy_products_kernel(dy_ptr, b_ptr, h_ptr, part_h_ptr, part_b_ptr, M, N, stride_dm, stride_hm, cols_per_program,
                            R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DOT_FP32: tl.constexpr):
        """Program (i, j): rows [i·BM, +BM) and columns [j·cols_per_program, +cols_per_program) of dy.
        part_h[j, rows] = dy[rows, cols]·B[cols]; part_b[i, cols] = dy[rows, cols]ᵀ·h[rows] (fp32)."""
        i, j = tl.program_id(0), tl.program_id(1)
        rm = i * BM + tl.arange(0, BM)
        rr = tl.arange(0, R)
        m_mask = rm < M
        ht = tl.load(h_ptr + rm.to(tl.int64)[:, None] * stride_hm + rr[None, :], mask=m_mask[:, None], other=0.0)
        if DOT_FP32:
            ht = ht.to(tl.float32)
        acc_h = tl.zeros((BM, R), dtype=tl.float32)
        n_start = j * cols_per_program
        n_end = tl.minimum(n_start + cols_per_program, N)
        for n0 in range(n_start, n_end, BN):
            rn = n0 + tl.arange(0, BN)
            n_mask = rn < n_end
            dt = tl.load(dy_ptr + rm.to(tl.int64)[:, None] * stride_dm + rn[None, :],
                         mask=m_mask[:, None] & n_mask[None, :], other=0.0)
            bt = tl.load(b_ptr + rn.to(tl.int64)[:, None] * R + rr[None, :], mask=n_mask[:, None], other=0.0)
            if DOT_FP32:
                dt = dt.to(tl.float32)
                bt = bt.to(tl.float32)
            acc_h = tl.dot(dt, bt, acc_h)
            pb = tl.dot(tl.trans(dt), ht)
            tl.store(part_b_ptr + (i.to(tl.int64) * N + rn.to(tl.int64))[:, None] * R + rr[None, :], pb,
                     mask=n_mask[:, None])
        tl.store(part_h_ptr + (j.to(tl.int64) * M + rm.to(tl.int64))[:, None] * R + rr[None, :], acc_h,
                 mask=m_mask[:, None])


def dy_products_torch(dy: torch.Tensor, B: torch.Tensor, h: torch.Tensor, scaling: float):
    """(s·dy·B, s·dyᵀ·h) by torch's GEMMs, in dy's dtype."""
    return torch.mm(dy, B * scaling), torch.mm(dy.t(), h * scaling)


def _kernel_runs(dy: torch.Tensor, B: torch.Tensor, h: torch.Tensor) -> bool:
    return (DY_KERNEL and triton is not None and (dy.is_cuda or grouped_gemm_tiles.KERNEL_ON_CPU)
            and dy.dtype in (torch.bfloat16, torch.float16) and B.dtype == h.dtype == dy.dtype
            and B.shape[1] in _RANKS and dy.stride(1) == 1 and h.stride(1) == 1 and dy.shape[0] > 0)


def dy_products(dy: torch.Tensor, B: torch.Tensor, h: torch.Tensor, scaling: float):
    """(grad_h, grad_B) = (s·dy·B [M, r], s·dyᵀ·h [N, r]) for dy [M, N], B [N, r], h [M, r] (rows at any stride: a
    member's columns of the joined x·Aᵀ), in dy's dtype:
    accumulated in fp32, scaled, rounded once (torch's reference scales B and h in their dtype first: equal where s is
    a power of two)."""
    if not _kernel_runs(dy, B, h):
        return dy_products_torch(dy, B, h, scaling)
    M, N = dy.shape
    R = B.shape[1]
    cfg = _INTERPRETER_CONFIG if _interpreting() else _CONFIG
    BM, BN = cfg["BM"], cfg["BN"]
    row_blocks = triton.cdiv(M, BM)
    # columns split so that the grid fills the GPU, each program a whole number of BN-column tiles
    col_tiles = triton.cdiv(N, BN)
    splits = max(1, min(col_tiles, triton.cdiv(_TARGET_PROGRAMS, row_blocks)))
    cols = triton.cdiv(col_tiles, splits) * BN
    splits = triton.cdiv(N, cols)
    part_h = dy.new_empty(splits, M, R, dtype=torch.float32)
    part_b = dy.new_empty(row_blocks, N, R, dtype=torch.float32)
    _dy_products_kernel[(row_blocks, splits)](dy, B.contiguous(), h, part_h, part_b, M, N, dy.stride(0), h.stride(0),
                                              cols, R=R, BM=BM, BN=BN, DOT_FP32=_interpreting(),
                                              num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    grad_h = part_h.sum(0) if splits > 1 else part_h[0]
    grad_b = part_b.sum(0) if row_blocks > 1 else part_b[0]
    return (grad_h * scaling).to(dy.dtype), (grad_b * scaling).to(dy.dtype)
