"""Expert LoRA's thin products on rows sorted by expert, as Triton kernels on the grouped GEMMs' tile schedule
(model/grouped_gemm_tiles.py): `lora_rows` (rows · W[e] down to the rank) and `ragged_outer` (Σ over a group's rows of
pᵀ·q, LoRA's weight gradients), torch's grouped GEMMs where the kernels do not run; and their custom ops, which the
frozen stack's LoRA op (model/grouped_gemm.py) calls from its traced backward. Either may read a row operand through
an index (the expansion's gathers inside the kernels: model/experts.py's GATHER_IN_GEMM).
"""

from __future__ import annotations

import torch

# KERNEL_ON_CPU read through its module at call time: tests and benchmarks set it there
from moetune.model import grouped_gemm_tiles
from moetune.model.grouped_gemm_tiles import _interpreting

try:  # optional: the CPU build of torch comes without Triton
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# Expert LoRA's products are thin: rows × (in or out) against a rank of 16–64. torch's CUTLASS grouped GEMMs take them
# as tiles of a wide product (16.4 ms a GLM-4.7-Flash step with LoRA on the experts for four products a layer, ~4× what
# reading their operands costs). Two kernels read each operand once: `lora_rows` (rows · W[e] to the rank, a program a
# row tile of one group) and `ragged_outer` (Σ over a group's rows of Pᵀ·Q, the weight gradients, a program an expert
# and column tile). AIR-8 with LoRA on the experts, one H200: 37,458 tokens/s against 36,324 (BENCHMARKS.md,
# twenty-sixth session). LORA_KERNELS False: torch's grouped GEMMs.
LORA_KERNELS = True
_THIN = dict(BM=64, BK=128, num_warps=4, num_stages=3)
_OUTER = dict(BT=128, BK=64, num_warps=4, num_stages=3)
_OUTER_INTERPRETER = dict(BT=16, BK=16, num_warps=1, num_stages=1)

if triton is not None:
    from moetune.model.grouped_gemm_tiles import _tile

    @triton.jit
    def _lora_rows_kernel(x_ptr, w_ptr, y_ptr, offs_ptr, M, K, E, stride_xm, stride_we, stride_wk, stride_wr, scale,
                          E_POW2: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                          DOT_FP32: tl.constexpr, rows_ptr=None, X_ROWS: tl.constexpr = False):
        """y[rows of g] = scale · x[rows of g] · W[g], W[g] [K, R] at strides (stride_wk, stride_wr); the padding
        group's rows are stored as zeros. X_ROWS: row m of x is row rows[m] of the matrix at x_ptr."""
        g, row0, row_b, _ = _tile(tl.program_id(0), offs_ptr, M, R, E, E_POW2, BM, R, 1)
        if row0 >= row_b:
            return
        ge = tl.minimum(g, E - 1)
        rm = row0 + tl.arange(0, BM)
        rr = tl.arange(0, R)
        m_mask = rm < row_b
        src = tl.load(rows_ptr + rm, mask=m_mask, other=0) if X_ROWS else rm
        acc = tl.zeros((BM, R), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            k_mask = rk < K
            xt = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_xm + rk[None, :],
                         mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            wt = tl.load(w_ptr + ge.to(tl.int64) * stride_we + rk[:, None] * stride_wk + rr[None, :] * stride_wr,
                         mask=k_mask[:, None], other=0.0)
            if DOT_FP32:
                xt = xt.to(tl.float32)
                wt = wt.to(tl.float32)
            acc = tl.dot(xt, wt, acc)
        acc = tl.where(g < E, acc * scale, 0.0)
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * R + rr[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_mask[:, None])

    @triton.jit
    def _ragged_outer_kernel(p_ptr, q_ptr, c_ptr, offs_ptr, NP, NQ, stride_pm, stride_qm, stride_ce, stride_cp,
                             stride_cq, scale, BP: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
                             DOT_FP32: tl.constexpr, rows_ptr=None, P_ROWS: tl.constexpr = False,
                             Q_ROWS: tl.constexpr = False):
        """c[e] = scale · Σ over expert e's rows of p[row]ᵀ · q[row] ([NP, NQ]), a program a (p, q) tile of one
        expert, reading its rows' slices once; an expert without rows gets zeros. P_ROWS (Q_ROWS): row r of p (q) is
        row rows[r] of the matrix at p_ptr (q_ptr)."""
        e = tl.program_id(0)
        start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
        end = tl.load(offs_ptr + e)
        rp = tl.program_id(1) * BP + tl.arange(0, BP)
        rq = tl.program_id(2) * BQ + tl.arange(0, BQ)
        acc = tl.zeros((BP, BQ), dtype=tl.float32)
        for r0 in range(start, end, BK):
            rk = r0 + tl.arange(0, BK)
            k_mask = rk < end
            if P_ROWS or Q_ROWS:
                src = tl.load(rows_ptr + rk, mask=k_mask, other=0)
            pt = tl.load(p_ptr + (src if P_ROWS else rk).to(tl.int64)[:, None] * stride_pm + rp[None, :],
                         mask=k_mask[:, None] & (rp < NP)[None, :], other=0.0)
            qt = tl.load(q_ptr + (src if Q_ROWS else rk).to(tl.int64)[:, None] * stride_qm + rq[None, :],
                         mask=k_mask[:, None] & (rq < NQ)[None, :], other=0.0)
            if DOT_FP32:
                pt = pt.to(tl.float32)
                qt = qt.to(tl.float32)
            acc = tl.dot(tl.trans(pt), qt, acc)
        c = c_ptr + e.to(tl.int64) * stride_ce + rp[:, None] * stride_cp + rq[None, :] * stride_cq
        tl.store(c, (acc * scale).to(c_ptr.dtype.element_ty), mask=(rp < NP)[:, None] & (rq < NQ)[None, :])


def _thin_kernels(x: torch.Tensor, rank: int) -> bool:
    return (LORA_KERNELS and triton is not None and (x.is_cuda or grouped_gemm_tiles.KERNEL_ON_CPU)
            and rank in grouped_gemm_tiles.LORA_RANKS and x.dtype in (torch.bfloat16, torch.float16))


def lora_rows(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, scale: float = 1.0,
              rows: torch.Tensor | None = None) -> torch.Tensor:
    """scale · x[rows of e] · w[e] per group, for rows x [M, K] sorted by expert and w [E, K, r] (any strides: LoRA's
    Aᵀ or B as stored): [M, r] in x's dtype, zeros past the last group end. `rows` [M]: the rows are x[rows], read
    through the index by the kernel (made first where it does not run)."""
    E, K, r = w.shape
    M = x.shape[0] if rows is None else rows.shape[0]
    if not _thin_kernels(x, r):
        y = torch._grouped_mm(x if rows is None else x[rows], w, offs=offs)
        return y * scale if scale != 1.0 else y
    x = x.contiguous()
    y = x.new_empty(M, r)
    if M == 0:
        return y
    cfg = grouped_gemm_tiles._INTERPRETER_CONFIG if _interpreting() else _THIN
    grid = (M // cfg["BM"] + E + 1,)
    gather = {} if rows is None else dict(rows_ptr=rows.contiguous(), X_ROWS=True)
    _lora_rows_kernel[grid](x, w, y, offs.to(torch.int32), M, K, E, x.stride(0), w.stride(0), w.stride(1),
                            w.stride(2), float(scale), E_POW2=triton.next_power_of_2(E + 1), R=r, BM=cfg["BM"],
                            BK=cfg["BK"], DOT_FP32=_interpreting(), num_warps=cfg["num_warps"],
                            num_stages=cfg["num_stages"], **gather)
    return y


def ragged_outer(p: torch.Tensor, q: torch.Tensor, offs: torch.Tensor, scale: float = 1.0,
                 p_rows: torch.Tensor | None = None, q_rows: torch.Tensor | None = None) -> torch.Tensor:
    """scale · Σ over each expert's rows of pᵀ·q: [E, NP, NQ] in p's dtype, for rows p [M, NP] and q [M, NQ] sorted by
    expert (the weight gradients of LoRA's A and B: one of NP, NQ is the rank). `p_rows` or `q_rows` [M] (one of
    them): that operand's rows are p[p_rows] (q[q_rows]), read through the index by the kernel."""
    assert p_rows is None or q_rows is None
    E = offs.shape[0]
    NP, NQ = p.shape[1], q.shape[1]
    rank = min(NP, NQ)
    if not _thin_kernels(p, rank) or q.dtype != p.dtype:
        p = p if p_rows is None else p[p_rows]
        q = q if q_rows is None else q[q_rows]
        c = torch._grouped_mm(p.t(), q, offs=offs)
        return c * scale if scale != 1.0 else c
    p, q = p.contiguous(), q.contiguous()
    c = p.new_empty(E, NP, NQ)
    if E == 0:
        return c
    cfg = _OUTER_INTERPRETER if _interpreting() else _OUTER
    BP, BQ = (NP, cfg["BT"]) if NP == rank else (cfg["BT"], NQ)
    grid = (E, triton.cdiv(NP, BP), triton.cdiv(NQ, BQ))
    rows = p_rows if p_rows is not None else q_rows
    gather = {} if rows is None else dict(rows_ptr=rows.contiguous(), P_ROWS=p_rows is not None,
                                          Q_ROWS=q_rows is not None)
    _ragged_outer_kernel[grid](p, q, c, offs.to(torch.int32), NP, NQ, p.stride(0), q.stride(0), c.stride(0),
                               c.stride(1), c.stride(2), float(scale), BP=BP, BQ=BQ, BK=cfg["BK"],
                               DOT_FP32=_interpreting(), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                               **gather)
    return c


@torch.library.custom_op("moetune::lora_rows", mutates_args=())
def _lora_rows_op(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, scale: float,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
    return lora_rows(x, w, offs, scale, rows)


@_lora_rows_op.register_fake
def _(x, w, offs, scale, rows=None):
    return x.new_empty(x.shape[0] if rows is None else rows.shape[0], w.shape[2])


@torch.library.custom_op("moetune::ragged_outer", mutates_args=())
def _ragged_outer_op(p: torch.Tensor, q: torch.Tensor, offs: torch.Tensor, scale: float,
                     p_rows: torch.Tensor | None = None, q_rows: torch.Tensor | None = None) -> torch.Tensor:
    return ragged_outer(p, q, offs, scale, p_rows, q_rows)


@_ragged_outer_op.register_fake
def _(p, q, offs, scale, p_rows=None, q_rows=None):
    return p.new_empty(offs.shape[0], p.shape[1], q.shape[1])
