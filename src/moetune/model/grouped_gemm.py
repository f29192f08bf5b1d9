"""A Triton grouped GEMM for frozen expert stacks (bf16, or fp8 e4m3 with one scale per output row): the forward
y = x · W[e]ᵀ and the input gradient dx = dy · W[e], both reading the stack as stored.

Rows are sorted by expert, group ends `offs` (int32 [E], cumulative), weight [E, out, in]. The grid is fixed by an
upper bound on the number of row tiles, so nothing reads `offs` on the host: group g (expert g < E, and past the
last end a group E of padding rows that gets zeros) owns the virtual row tiles [⌊a_g/BM⌋ + g, ⌊b_g/BM⌋ + g + 1) for
its rows [a_g, b_g) — at least ⌈(b_g − a_g)/BM⌉ of them — so ⌊M/BM⌋ + E + 1 virtual tiles cover every group
(telescoping), and each program finds its group with one vector compare over `offs`; tiles past a group's rows exit.
Tiles start at a group's first row, so a group of n rows costs ⌈n/BM⌉ tiles, as in a per-expert GEMM.

The input gradient is the same kernel with the weight's strides swapped (the reduction runs over `out`): no
transposed copy of the stack. An fp8 weight is converted to bf16 in registers for a bf16 MMA (W8A16: no activation
quantisation, so the numerics are the dequantised GEMM's up to accumulation order); its row scale multiplies the
output columns in the forward's epilogue, and the incoming gradient's columns as they are loaded in the input
gradient (the scale lies inside that sum).

A second kernel, `_grouped_gemm_tma_kernel`, has the same tile schedule with its operand tiles loaded by TMA (Hopper's
tensor memory accelerator), pipelined by Triton: the fp8 × fp8 forward of a row-scaled fp8 stack and its input
gradient, on a K-major copy (model/quant/matmul.py's "tma", the default there) or on the stack as stored as the
transposed product (its "w8a8"), and bf16 stacks both ways (not used by default: within 3% of torch's `_grouped_mm`
end to end, BENCHMARKS.md, twenty-second session). `grouped_mm_tma` is it as a triton_op, which torch.compile
launches from its own code. `_grouped_gemm_tma_persistent_kernel` computes the same tiles with a program an SM,
enumerating only tiles that have rows and running its tile and K loops as one pipelined loop (`TMA_PERSISTENT`).

`grouped_mm_frozen` is the autograd-facing op (a torch.library custom op, opaque to Inductor): it gives only the
input's gradient (the weight is frozen). `grouped_mm_reference` is the torch computation, which is also the path off
CUDA; the tests run the kernel on the CPU under Triton's interpreter against it.
"""

from __future__ import annotations

import os

import torch

from moetune.model.recompute import register_product

try:  # optional: the CPU build of torch comes without Triton
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# Run the kernel (not the reference) inside the custom op on CPU tensors too: the tests set it under the interpreter.
KERNEL_ON_CPU = False
# A fixed launch config {BM, BN, BK, GROUP_M, SWAP, num_warps, num_stages} instead of autotuning (tests: small tiles).
CONFIG: dict | None = None
_INTERPRETER_CONFIG = dict(BM=16, BN=16, BK=16, GROUP_M=2, SWAP=False, num_warps=1, num_stages=1)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


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
    @triton.jit
    def _grouped_order(t, num_m, num_n, GROUP_M: tl.constexpr):
        """Tile t's row and column tile in grouped order: GROUP_M row tiles (a few experts) sweep the column tiles
        together, so each weight tile is read from memory once for all of an expert's row tiles."""
        per_group = GROUP_M * num_n
        first_m = (t // per_group) * GROUP_M
        group_rows = tl.minimum(num_m - first_m, GROUP_M)
        return first_m + (t % per_group) % group_rows, (t % per_group) // group_rows

    @triton.jit
    def _tile(pid, offs_ptr, M, N, E, E_POW2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              GROUP_M: tl.constexpr):
        """Program `pid`'s output tile: its group g (E: the padding rows past the last end), its first row `row0`,
        the group's end `row_b` (row0 >= row_b: a virtual tile with nothing to do) and its column tile `tn`."""
        num_m = M // BM + E + 1  # virtual row tiles (see the module's docstring)
        tm, tn = _grouped_order(pid, num_m, tl.cdiv(N, BN), GROUP_M)

        idx = tl.arange(0, E_POW2)
        prev = tl.load(offs_ptr + idx - 1, mask=(idx > 0) & (idx <= E), other=0)  # a_g: rows before group g
        first_tile = prev // BM + idx
        g = tl.sum(((idx <= E) & (first_tile <= tm)).to(tl.int32), axis=0) - 1
        row_a = tl.sum(tl.where(idx == g, prev, 0), axis=0)
        row_b = tl.sum(tl.where(idx == g + 1, prev, 0), axis=0) + tl.where(g == E, M, 0)
        row_b = tl.minimum(row_b, M)
        row0 = row_a + (tm - (row_a // BM + g)) * BM
        return g, row0, row_b, tn

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

    @triton.jit
    def _tma_descriptors(a_ptr, b_ptr, M, N, K, E, stride_am, B_KMAJOR: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, PAIRS: tl.constexpr = False):
        """The operands' TMA descriptors: A as [M, K], the stack as one [E·N, K] (K-major) or [E·K, N] matrix
        (PAIRS: b_ptr is an fp8 stack's int16 view, [E·K, N/2])."""
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BM, BK])
        if B_KMAJOR:
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[E * N, K], strides=[K, 1], block_shape=[BN, BK])
        elif PAIRS:
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[E * K, N // 2], strides=[N // 2, 1],
                                               block_shape=[BK, BN // 2])
        else:
            b_desc = tl.make_tensor_descriptor(b_ptr, shape=[E * K, N], strides=[N, 1], block_shape=[BK, BN])
        return a_desc, b_desc

    @triton.jit
    def _tma_tile(a_desc, b_desc, c_ptr, scale_ptr, ascale_ptr, g, row0, row_b, tn, k_end, N, K, E, stride_cm,
                  stride_se, B_KMAJOR: tl.constexpr, SCALE_A: tl.constexpr, SCALE_B: tl.constexpr,
                  DOT_FP32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  SWAP: tl.constexpr = False, PAIRS: tl.constexpr = False, l_ptr=None, p_ptr=None, stride_pe=0,
                  stride_pr=0, stride_pn=0, LORA: tl.constexpr = False, RANK: tl.constexpr = 16):
        """One output tile (rows row0.. of group g below row_b, column tile tn): C = A · B[g] summed over K up to
        k_end, the scales applied, stored; the padding group E's rows are stored as zeros whatever they summed.
        SWAP (an N-major fp8 stack): Cᵀ = B[g]ᵀ · Aᵀ, the stack's tile transposed in registers as the MMA's first
        operand. Hopper's fp8 MMA reads its second operand K-major from shared memory only: an N-major fp8 tile
        there, Triton transposes it through shared memory again and waits on every MMA (145–157 TFLOP/s,
        BENCHMARKS.md, fifteenth session); as the first operand it may come from registers, and the MMAs stay
        asynchronous (the sm_90 compile: wgmma with its A in registers, MMAs left in flight at each wait).
        LORA (no SWAP): C[rows of g] += L[rows] · P[g] after the scales, L [M, RANK] contiguous and P[g] [RANK, N]
        at strides (stride_pr, stride_pn) 16-bit: one more MMA over RANK before the store (a LoRA branch's product
        added in the epilogue)."""
        ge = tl.minimum(g, E - 1)  # the padding group reads expert E − 1 (in bounds, finite)
        acc = tl.zeros((BN, BM) if SWAP else (BM, BN), dtype=tl.float32)
        for k0 in range(0, k_end, BK):
            a = a_desc.load([row0, k0])
            if B_KMAJOR:
                b = tl.trans(b_desc.load([ge * N + tn * BN, k0]))
            else:
                b = b_desc.load([ge * K + k0, tn * (BN // 2 if PAIRS else BN)])
            if SWAP and PAIRS:
                # the stack's tile as int16 pairs of neighbours along `in`, transposed 16 bits at a time (vector
                # loads from shared memory where bytes take one load each), each pair then split into its two rows
                t = tl.trans(b)
                lo = (t & 0xFF).to(tl.int8)
                hi = ((t >> 8) & 0xFF).to(tl.int8)
                b = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BN, BK)).to(tl.float8e4nv, bitcast=True)
                a = tl.trans(a)
            elif SWAP:  # moved as int8: transposed as an fp8 tile, Triton stages it in shared memory for the MMA
                b = tl.trans(b.to(tl.int8, bitcast=True)).to(b.dtype, bitcast=True)
                a = tl.trans(a)
            if DOT_FP32:  # Triton's interpreter gets bf16 and fp8 dots wrong; their products are exact in fp32
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(b, a, acc) if SWAP else tl.dot(a, b, acc)
        if SWAP:
            acc = tl.trans(acc)
        rm = row0 + tl.arange(0, BM)
        rn = tn * BN + tl.arange(0, BN)
        m_mask = rm < row_b
        n_mask = rn < N
        if SCALE_B:
            acc = acc * tl.load(scale_ptr + ge.to(tl.int64) * stride_se + rn, mask=n_mask, other=0.0)[None, :]
        if SCALE_A:
            acc = acc * tl.load(ascale_ptr + rm, mask=m_mask, other=0.0)[:, None]
        if LORA:  # after the scales: L and P are 16-bit values as they are
            rr = tl.arange(0, RANK)
            lo = tl.load(l_ptr + rm.to(tl.int64)[:, None] * RANK + rr[None, :], mask=m_mask[:, None], other=0.0)
            pg = tl.load(p_ptr + ge.to(tl.int64) * stride_pe + rr[:, None] * stride_pr + rn[None, :] * stride_pn,
                         mask=n_mask[None, :], other=0.0)
            if DOT_FP32:
                lo = lo.to(tl.float32)
                pg = pg.to(tl.float32)
            acc = tl.dot(lo, pg, acc)
        acc = tl.where(g < E, acc, 0.0)  # not a product: the padding rows may hold anything
        c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    @triton.jit
    def _real_tile(t, starts, ends, first, R, num_n, E_POW2: tl.constexpr, BM: tl.constexpr,
                   GROUP_M: tl.constexpr):
        """Tile t of the R·num_n tiles that have rows (`_row_tiles`), in grouped order: its group, first row, the
        group's end and its column tile."""
        r, tn = _grouped_order(t, R, num_n, GROUP_M)
        idx = tl.arange(0, E_POW2)
        g = tl.sum((first <= r).to(tl.int32), axis=0) - 1  # groups without rows share their successor's `first`
        g_first = tl.sum(tl.where(idx == g, first, 0), axis=0)
        row0 = tl.sum(tl.where(idx == g, starts, 0), axis=0) + (r - g_first) * BM
        return g, row0, tl.sum(tl.where(idx == g, ends, 0), axis=0), tn

    @triton.jit
    def _row_tiles(offs_ptr, M, E, E_POW2: tl.constexpr, BM: tl.constexpr):
        """Each group's first row, end and first row tile (groups 0..E, E the padding rows; empty groups have no
        tiles), and the row tiles in all: ⌈n_g/BM⌉ for a group of n_g rows, as a per-expert GEMM has."""
        idx = tl.arange(0, E_POW2)
        starts = tl.load(offs_ptr + idx - 1, mask=(idx > 0) & (idx <= E), other=0)
        ends = tl.where(idx < E, tl.load(offs_ptr + idx, mask=idx < E, other=0), M)
        ends = tl.where(idx <= E, tl.minimum(ends, M), 0)
        starts = tl.minimum(starts, ends)
        tiles = (ends - starts + BM - 1) // BM
        last = tl.cumsum(tiles, axis=0)
        first = tl.where(idx <= E, last - tiles, 2147483647)  # groups past E never match a tile
        return starts, ends, first, tl.sum(tiles, axis=0)

    @triton.jit
    def _grouped_gemm_tma_kernel(a_ptr, b_ptr, c_ptr, scale_ptr, ascale_ptr, offs_ptr, M, N, K, E,
                                 stride_am, stride_cm, stride_se,
                                 E_POW2: tl.constexpr, B_KMAJOR: tl.constexpr, SCALE_A: tl.constexpr,
                                 SCALE_B: tl.constexpr, DOT_FP32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                                 BK: tl.constexpr, GROUP_M: tl.constexpr, SWAP: tl.constexpr = False,
                                 PAIRS: tl.constexpr = False, l_ptr=None, p_ptr=None, stride_pe=0, stride_pr=0,
                                 stride_pn=0, LORA: tl.constexpr = False, RANK: tl.constexpr = 16):
        """C[rows of g] = A[rows of g] · B[g], operand tiles loaded by the tensor memory accelerator (TMA: one
        asynchronous copy per tile into shared memory, which Triton pipelines over K), one output tile a program.
        B_KMAJOR: the stack is [E, N, K] (the forward on a stack as stored, or the input gradient on a K-major
        copy); else [E, K, N] (a 16-bit stack's input gradient, read as stored; K % BK == 0). SCALE_A: C[m, :] *=
        a_s[m] (fp8 rows); SCALE_B: C[:, n] *= s[g, n] (a row-scaled fp8 stack's forward).

        The descriptors see A as [M, K] and the stack as one [E·N, K] (or [E·K, N]) matrix: a row tile running past
        its group reads the next group's rows (or TMA's zeros past the end), and those rows are never stored; a
        column tile running past N reads the next expert's rows, whose columns are never stored either. K past the
        end is zero in both operands; with B N-major a K tile never crosses an expert (K % BK == 0)."""
        g, row0, row_b, tn = _tile(tl.program_id(0), offs_ptr, M, N, E, E_POW2, BM, BN, GROUP_M)
        if row0 >= row_b:
            return
        a_desc, b_desc = _tma_descriptors(a_ptr, b_ptr, M, N, K, E, stride_am, B_KMAJOR, BM, BN, BK, PAIRS)
        k_end = tl.where(g < E, K, 0)  # the padding group has nothing to sum
        _tma_tile(a_desc, b_desc, c_ptr, scale_ptr, ascale_ptr, g, row0, row_b, tn, k_end, N, K, E, stride_cm,
                  stride_se, B_KMAJOR, SCALE_A, SCALE_B, DOT_FP32, BM, BN, BK, SWAP, PAIRS, l_ptr, p_ptr, stride_pe,
                  stride_pr, stride_pn, LORA, RANK)

    @triton.jit
    def _grouped_gemm_tma_persistent_kernel(a_ptr, b_ptr, c_ptr, scale_ptr, ascale_ptr, offs_ptr, M, N, K, E,
                                            stride_am, stride_cm, stride_se,
                                            E_POW2: tl.constexpr, B_KMAJOR: tl.constexpr, SCALE_A: tl.constexpr,
                                            SCALE_B: tl.constexpr, DOT_FP32: tl.constexpr, BM: tl.constexpr,
                                            BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                                            num_programs, FLATTEN: tl.constexpr, SWAP: tl.constexpr = False,
                                            PAIRS: tl.constexpr = False, l_ptr=None, p_ptr=None, stride_pe=0,
                                            stride_pr=0, stride_pn=0, LORA: tl.constexpr = False,
                                            RANK: tl.constexpr = 16):
        """The tiles with rows, each program taking every `num_programs`-th one (a program an SM): with FLATTEN,
        Triton's pipeliner runs the tile loop and the K loop as one, so the next tile's first operand loads overlap
        this tile's epilogue. On Flash's ~256-row groups a tile sums 12–16 K tiles, so the loads that start a tile
        and the stores that end it are a large part of a one-tile program (the candidate for the grouped GEMMs' rate
        on small groups: BENCHMARKS.md, twenty-first session). Only tiles with rows are enumerated (`_row_tiles`):
        every tile runs the whole K loop, which the loops' flattening needs; the padding group's is stored as zeros."""
        a_desc, b_desc = _tma_descriptors(a_ptr, b_ptr, M, N, K, E, stride_am, B_KMAJOR, BM, BN, BK, PAIRS)
        starts, ends, first, R = _row_tiles(offs_ptr, M, E, E_POW2, BM)
        num_n = tl.cdiv(N, BN)
        for t in tl.range(tl.program_id(0), R * num_n, num_programs, flatten=FLATTEN):
            g, row0, row_b, tn = _real_tile(t, starts, ends, first, R, num_n, E_POW2, BM, GROUP_M)
            _tma_tile(a_desc, b_desc, c_ptr, scale_ptr, ascale_ptr, g, row0, row_b, tn, K, N, K, E, stride_cm,
                      stride_se, B_KMAJOR, SCALE_A, SCALE_B, DOT_FP32, BM, BN, BK, SWAP, PAIRS, l_ptr, p_ptr,
                      stride_pe, stride_pr, stride_pn, LORA, RANK)


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
    num_stages (default: `CONFIG`, the interpreter's, or autotuned)."""
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
    config = config or CONFIG or (_INTERPRETER_CONFIG if _interpreting() else None)

    def grid(m):
        return ((M // m["BM"] + E + 1) * triton.cdiv(N, m["BN"]),)

    if config is None:
        tuned = (_grouped_gemm_fp8_autotuned if transpose else _grouped_gemm_fp8_dgrad_autotuned) if w8a8 \
            else _grouped_gemm_autotuned
        tuned[grid](*args, **meta)
    else:
        _grouped_gemm_kernel[grid(config)](*args, **meta, **config)
    return y


# The TMA kernel's launch configs (BM, BN, BK, GROUP_M, warps, stages): the fastest of a sweep on one H200 on Air's,
# Flash's and an EP-8 rank's expert shapes, forward and input gradient (BENCHMARKS.md, fifteenth session); Triton's
# autotuner picked slower ones (10–30%) there, and tuning at the first step costs time of its own. A stack read
# N-major (a 16-bit input gradient) needs its K to be a multiple of BK, so that no K tile crosses into the next expert.
TMA_CONFIG = dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=3)
TMA_CONFIG_FP8 = dict(BM=128, BN=256, BK=128, GROUP_M=8, num_warps=8, num_stages=3)
# The fp8 input gradient on a stack as stored (SWAP: the stack's BK × BN tile transposed on its way from shared memory
# to registers): 256-row tiles halve that work per MMA against TMA_CONFIG_FP8's 128. On one H200, the tile moved byte
# by byte, Flash's gate_up 0.42 ms against 0.48, AIR-8's 1.55 against 1.70 (BENCHMARKS.md, twenty-third session).
TMA_CONFIG_FP8_SWAP = dict(BM=256, BN=128, BK=128, GROUP_M=8, num_warps=8, num_stages=3)
# Operands the TMA kernel takes go through it where its callers ask for it (Hopper and later; tests: the
# interpreter): see `tma_supported`.
TMA = True
# The TMA kernel as a persistent one (a program an SM striding over the tiles that have rows, its tile and K loops
# flattened so that a tile's first loads overlap the last one's epilogue) instead of a program a tile: on one H200,
# fp8 x fp8 on Flash's, Air's and an EP-8 rank's expert shapes 2-21% faster, forward and input gradient (BENCHMARKS.md,
# twenty-second session). A group's remainder in smaller tiles, in a second loop after every group's whole tiles, was
# slower on every shape (AIR-8 −5.6%): each group's weights are read from memory a second time (twenty-seventh).
TMA_PERSISTENT = True
# The fp8 stack as stored (SWAP) moved to registers as int16 pairs (vector loads from shared memory, the pairs' bytes
# split in registers) instead of byte by byte (one shared-memory load a byte: 64 a thread a K step at 256 × 128). On
# one H200 5–9% faster on Flash's and AIR-8's input gradients, e.g. Flash's down 0.201 ms against 0.221
# (BENCHMARKS.md, twenty-third session).
TMA_SWAP_PAIRS = True
# programs of the persistent kernel under the interpreter (a GPU: its SM count)
_INTERPRETER_PROGRAMS = 3


def _aligned(t: torch.Tensor) -> bool:
    """What a TMA descriptor takes: a 16-byte aligned start, unit inner stride, outer strides positive multiples of
    16 bytes (an expanded, stride-0 gradient is none). While torch.compile traces, tensors have no address and only
    the strides are checked: what a compiled layer hands the kernel are weights and its own fresh buffers (the
    quantised rows, the K-major copy), whose starts torch's allocators align."""
    if not torch.compiler.is_compiling() and t.data_ptr() % 16:
        return False
    return t.stride(-1) == 1 and all(
        st > 0 and (st * t.element_size()) % 16 == 0 for st in t.stride()[:-1])


def tma_supported(x: torch.Tensor, weight: torch.Tensor, transpose: bool) -> bool:
    """Whether the TMA kernel takes y = x · op(W[e]): a GPU with TMA (compute capability 9.0+; or the
    interpreter), x and the stack in one dtype (bf16, or fp8 e4m3 with row scales for x), 16-byte aligned rows with
    unit inner strides; op(W) = Wᵀ (K-major), or W itself (the input gradient on the stack as stored) where K (the
    stack's `out`) is a multiple of the dtype's BK (TMA_CONFIG, TMA_CONFIG_FP8): a K tile never crosses an expert.
    An fp8 W as stored runs as the transposed product (`_tma_tile`'s SWAP)."""
    if triton is None or not TMA or weight.dim() != 3 or x.dim() != 2 or x.dtype != weight.dtype:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        return False
    if x.is_cuda:
        if torch.cuda.get_device_capability(x.device) < (9, 0):
            return False
    elif not (_interpreting() and KERNEL_ON_CPU):
        return False
    if not (_aligned(x) and _aligned(weight) and weight.is_contiguous()):
        return False
    return transpose or weight.shape[1] % _tma_config(x.dtype == torch.float8_e4m3fn, transpose)["BK"] == 0


def _tma_config(fp8: bool, transpose: bool) -> dict:
    """The module's launch config on a GPU for these operands (CONFIG, if set, overrides it)."""
    return (TMA_CONFIG_FP8 if transpose else TMA_CONFIG_FP8_SWAP) if fp8 else TMA_CONFIG


def _tma_scratch(size: int, alignment: int, stream):
    """Scratch memory from torch's allocator for descriptors the kernel builds on the device it launches on (Triton
    launches on the current device; the interpreter runs on the CPU)."""
    return torch.empty(size, dtype=torch.int8, device="cpu" if _interpreting() else torch.cuda.current_device())


def grouped_gemm_tma(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, scale: torch.Tensor | None = None,
                     transpose: bool = True, x_scale: torch.Tensor | None = None,
                     config: dict | None = None, launch=None, persistent: bool | None = None,
                     pairs: bool | None = None, lora: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The TMA kernel's launch (operands as `tma_supported` says): y = x · op(W[e]) per group, op(W) = Wᵀ
    (`transpose`) or W; `scale` [E, out(, 1)] the fp8 stack's row scales for the forward (None: the input gradient,
    on a K-major copy or the stack as stored, the weight's scales folded into x), `x_scale` [M(, 1)] fp8 x's row
    scales. y bf16 for fp8 operands, else x's dtype. `config` as for `grouped_gemm` (GROUP_M, BM, BN, BK,
    num_warps, num_stages).
    `launch`: torch.library.wrap_triton inside the triton_op (torch.compile then launches the kernel itself).
    `persistent`: the persistent kernel (default TMA_PERSISTENT); `pairs`: an fp8 stack as stored moved as int16
    pairs (default TMA_SWAP_PAIRS). `lora` (L [M, r], P [E, r, N], any strides; 16-bit, r as `lora_epilogue_fits`
    says; not with `transpose` False on fp8): y[rows of e] += L[rows] · P[e] (after an fp8 product's scales),
    summed with the product in fp32 and rounded once."""
    E, n_out, n_in = weight.shape
    M = x.shape[0]
    N, K = (n_out, n_in) if transpose else (n_in, n_out)
    fp8 = x.dtype == torch.float8_e4m3fn
    assert x.shape[1] == K and offs.shape == (E,) and (x_scale is not None) == fp8, (x.shape, weight.shape)
    y = x.new_empty(M, N, dtype=torch.bfloat16 if fp8 else x.dtype)
    if M == 0 or N == 0:
        return y
    if K == 0 or E == 0:
        return y.zero_()
    scale_t = offs if scale is None else scale.reshape(E, n_out)  # offs: an unread placeholder
    assert scale is None or (transpose and scale_t.stride(1) == 1)
    x_scale = x_scale.reshape(M).float().contiguous() if fp8 else offs
    swap = fp8 and not transpose
    # _aligned(weight): its rows are 16-byte multiples, so an fp8 stack's `in` is even
    pairs = swap and (TMA_SWAP_PAIRS if pairs is None else pairs)
    args = (x, weight.view(torch.int16) if pairs else weight, y, scale_t, x_scale, offs.to(torch.int32), M, N, K, E,
            x.stride(0), y.stride(0), scale_t.stride(0) if scale is not None else 0)
    meta = dict(E_POW2=triton.next_power_of_2(E + 1), B_KMAJOR=transpose, SCALE_A=fp8, SCALE_B=scale is not None,
                DOT_FP32=_interpreting(), SWAP=swap, PAIRS=pairs)
    if lora is not None:
        L, P = lora
        assert not swap and L.shape == (M, P.shape[1]) and P.shape == (E, L.shape[1], N) and L.dtype == y.dtype
        L = L.contiguous()
        meta.update(l_ptr=L, p_ptr=P, stride_pe=P.stride(0), stride_pr=P.stride(1), stride_pn=P.stride(2), LORA=True,
                    RANK=L.shape[1])
    config = config or CONFIG or (_INTERPRETER_CONFIG if _interpreting() else _tma_config(fp8, transpose))
    config = {k: v for k, v in config.items() if k not in ("SWAP", "PREFETCH")}
    triton.set_allocator(_tma_scratch)
    tiles = (M // config["BM"] + E + 1) * triton.cdiv(N, config["BN"])
    launch = launch or (lambda k: k)
    if TMA_PERSISTENT if persistent is None else persistent:
        programs = min(tiles, _INTERPRETER_PROGRAMS if _interpreting()
                       else torch.cuda.get_device_properties(x.device).multi_processor_count)
        launch(_grouped_gemm_tma_persistent_kernel)[(programs,)](*args, **meta, **config, num_programs=programs,
                                                                 FLATTEN=not _interpreting())
    else:
        launch(_grouped_gemm_tma_kernel)[(tiles,)](*args, **meta, **config)
    return y


if triton is not None:
    @torch.library.triton_op("moetune::grouped_mm_tma", mutates_args=())
    def grouped_mm_tma(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, scale: torch.Tensor | None,
                       x_scale: torch.Tensor | None, transpose: bool) -> torch.Tensor:
        """`grouped_gemm_tma` as an op torch.compile sees into: Inductor launches the kernel from its own wrapper
        code instead of calling an opaque op's Python per launch. Operands as `tma_supported` says, which the caller
        checks."""
        return grouped_gemm_tma(x, weight, offs, scale, transpose, x_scale, launch=torch.library.wrap_triton)


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
    return (rank in (16, 32, 64) and (x.is_cuda or KERNEL_ON_CPU) and tma_supported(x, weight, True)
            and tma_supported(x.new_empty(0, weight.shape[1]), weight, False))


def _run_lora(x, weight, offs, transpose, L, P):
    """x · op(W[e]) + L · P[e] per group (op as `_run`), one rounding; the TMA kernel's epilogue where it fits, else
    both products in fp32 by the reference."""
    if lora_epilogue_fits(x, weight, L.shape[1]):
        return grouped_gemm_tma(x, weight, offs, None, transpose, lora=(L, P))
    y = grouped_mm_reference(x.float(), weight, offs, None, transpose)
    return (y + grouped_mm_reference(L.float(), P, offs, None, transpose=False)).to(x.dtype)


def _run(x, weight, offs, scale, transpose):
    if (x.is_cuda or KERNEL_ON_CPU) and scale is None and tma_supported(x, weight, transpose):
        return grouped_gemm_tma(x, weight, offs, None, transpose)
    if (x.is_cuda or KERNEL_ON_CPU) and kernel_supported(x, weight, scale):
        return grouped_gemm(x, weight, offs, scale, transpose)
    return grouped_mm_reference(x.contiguous(), weight, offs, scale, transpose)


# ------------------------------------------------------------------------------------------------ K-major copy
# The fp8 input gradient's operand: Hopper's fp8 MMA reads both operands K-major, and the stack [E, out, in] is
# K-major for the forward only. Without a kept copy (quant.modules.keep_transposed_copies) each backward copies the
# stack to [E, in, out]. Tiles of 128 x 128 bytes: 16-byte loads and stores along both directions, the transpose
# through shared memory; on one H200 ~4.0 TB/s (read + write) on Air's and Flash's stacks, against 1.6-2.8 for
# Inductor's transpose and 0.35 for torch's copy (AIR-8 on an fp8 base without kept copies: +4.5%; BENCHMARKS.md,
# sixteenth session).
K_MAJOR_TILE = 128

if triton is not None:
    @triton.jit
    def _k_major_copy_kernel(src, dst, R, C, BR: tl.constexpr, BC: tl.constexpr):
        pid = tl.program_id(0)
        base = tl.program_id(1).to(tl.int64) * R * C
        n_c = tl.cdiv(C, BC)
        rows = (pid // n_c) * BR + tl.arange(0, BR)
        cols = (pid % n_c) * BC + tl.arange(0, BC)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        tile = tl.load(src + base + rows[:, None].to(tl.int64) * C + cols[None, :], mask=mask)
        tl.store(dst + base + cols[:, None].to(tl.int64) * R + rows[None, :], tl.trans(tile), mask=tl.trans(mask))


def k_major_copy_reference(w: torch.Tensor) -> torch.Tensor:
    return w.transpose(-2, -1).contiguous()


def k_major_copy(w: torch.Tensor, tile: int | None = None) -> torch.Tensor:
    """A contiguous stack w [E, R, C] (or one matrix [R, C]) copied to [E, C, R] contiguous, by the kernel on CUDA
    (and under the interpreter with KERNEL_ON_CPU), else by torch. Bytes are moved as bytes: any 1- or 2-byte dtype.
    `tile`: the kernel's square tile (K_MAJOR_TILE; the benchmark compares others)."""
    if triton is None or not w.is_contiguous() or w.element_size() not in (1, 2) or not (
            w.is_cuda or (KERNEL_ON_CPU and _interpreting())):
        return k_major_copy_reference(w)
    *lead, R, C = w.shape
    out = w.new_empty(*lead, C, R)
    if w.numel() == 0:
        return out
    E = w.numel() // (R * C)
    bits = torch.uint8 if w.element_size() == 1 else torch.int16
    tile = 16 if _interpreting() else tile or K_MAJOR_TILE
    grid = (triton.cdiv(R, tile) * triton.cdiv(C, tile), E)
    _k_major_copy_kernel[grid](w.view(bits), out.view(bits), R, C, BR=tile, BC=tile, num_warps=4)
    return out


# ------------------------------------------------------------------------------------------------ custom ops
@torch.library.custom_op("moetune::grouped_mm_frozen", mutates_args=())
def _grouped_mm_frozen_op(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                          scale: torch.Tensor | None) -> torch.Tensor:
    return _run(x, weight, offs, scale, True)


@torch.library.custom_op("moetune::grouped_mm_frozen_dgrad", mutates_args=())
def _grouped_mm_frozen_dgrad_op(grad: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                                scale: torch.Tensor | None) -> torch.Tensor:
    return _run(grad, weight, offs, scale, False)


@torch.library.custom_op("moetune::grouped_mm_fp8", mutates_args=())
def grouped_mm_fp8(x8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                   scale: torch.Tensor | None) -> torch.Tensor:
    """The fp8 × fp8 forward (W8A8): rows x8 [N, in] e4m3 with row scales `x_scale` [N, 1] × each expert's e4m3 weight
    [E, out, in] with row scales `scale` [E, out, 1], fp32 accumulation, bf16 out — the numerics of
    torch._scaled_grouped_mm's row-wise path. `scale` None: the input gradient on a K-major copy of the stack, the
    weight's scales folded into x8. No autograd (model/quant/matmul.py gives the input gradient)."""
    if (x8.is_cuda or KERNEL_ON_CPU) and tma_supported(x8, weight, True):
        return grouped_gemm_tma(x8, weight, offs, scale, True, x_scale=x_scale)
    if (x8.is_cuda or KERNEL_ON_CPU) and kernel_supported_w8a8(x8, weight):
        return grouped_gemm(x8, weight, offs, scale, True, x_scale=x_scale)
    return grouped_mm_reference(x8.float() * x_scale.reshape(-1, 1).float(), weight, offs, scale,
                                True).to(torch.bfloat16)


@torch.library.custom_op("moetune::grouped_mm_fp8_dgrad", mutates_args=())
def grouped_mm_fp8_dgrad(g8: torch.Tensor, g_scale: torch.Tensor, weight: torch.Tensor,
                         offs: torch.Tensor) -> torch.Tensor:
    """The fp8 × fp8 input gradient (W8A8): rows g8 [N, out] e4m3 — the incoming gradient with each row's expert's
    weight scales folded in, then quantised per row (`g_scale` [N, 1]) — × each expert's e4m3 weight [E, out, in]
    read as stored: dx [N, in] bf16, fp32 accumulation. The numerics of model/quant/matmul.py's `_gmm_dgrad`."""
    if (g8.is_cuda or KERNEL_ON_CPU) and tma_supported(g8, weight, False):
        return grouped_gemm_tma(g8, weight, offs, None, False, x_scale=g_scale)
    if (g8.is_cuda or KERNEL_ON_CPU) and kernel_supported_w8a8(g8, weight):
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


# ------------------------------------------------------------------------------------------------ LoRA's thin products
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
    @triton.jit
    def _lora_rows_kernel(x_ptr, w_ptr, y_ptr, offs_ptr, M, K, E, stride_xm, stride_we, stride_wk, stride_wr, scale,
                          E_POW2: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                          DOT_FP32: tl.constexpr):
        """y[rows of g] = scale · x[rows of g] · W[g], W[g] [K, R] at strides (stride_wk, stride_wr); the padding
        group's rows are stored as zeros."""
        g, row0, row_b, _ = _tile(tl.program_id(0), offs_ptr, M, R, E, E_POW2, BM, R, 1)
        if row0 >= row_b:
            return
        ge = tl.minimum(g, E - 1)
        rm = row0 + tl.arange(0, BM)
        rr = tl.arange(0, R)
        m_mask = rm < row_b
        acc = tl.zeros((BM, R), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            k_mask = rk < K
            xt = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :],
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
                             DOT_FP32: tl.constexpr):
        """c[e] = scale · Σ over expert e's rows of p[row]ᵀ · q[row] ([NP, NQ]), a program a (p, q) tile of one
        expert, reading its rows' slices once; an expert without rows gets zeros."""
        e = tl.program_id(0)
        start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
        end = tl.load(offs_ptr + e)
        rp = tl.program_id(1) * BP + tl.arange(0, BP)
        rq = tl.program_id(2) * BQ + tl.arange(0, BQ)
        acc = tl.zeros((BP, BQ), dtype=tl.float32)
        for r0 in range(start, end, BK):
            rk = r0 + tl.arange(0, BK)
            k_mask = rk < end
            pt = tl.load(p_ptr + rk.to(tl.int64)[:, None] * stride_pm + rp[None, :],
                         mask=k_mask[:, None] & (rp < NP)[None, :], other=0.0)
            qt = tl.load(q_ptr + rk.to(tl.int64)[:, None] * stride_qm + rq[None, :],
                         mask=k_mask[:, None] & (rq < NQ)[None, :], other=0.0)
            if DOT_FP32:
                pt = pt.to(tl.float32)
                qt = qt.to(tl.float32)
            acc = tl.dot(tl.trans(pt), qt, acc)
        c = c_ptr + e.to(tl.int64) * stride_ce + rp[:, None] * stride_cp + rq[None, :] * stride_cq
        tl.store(c, (acc * scale).to(c_ptr.dtype.element_ty), mask=(rp < NP)[:, None] & (rq < NQ)[None, :])


def _thin_kernels(x: torch.Tensor, rank: int) -> bool:
    return (LORA_KERNELS and triton is not None and (x.is_cuda or KERNEL_ON_CPU) and rank in (16, 32, 64)
            and x.dtype in (torch.bfloat16, torch.float16))


def lora_rows(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """scale · x[rows of e] · w[e] per group, for rows x [M, K] sorted by expert and w [E, K, r] (any strides: LoRA's
    Aᵀ or B as stored): [M, r] in x's dtype, zeros past the last group end."""
    E, K, r = w.shape
    M = x.shape[0]
    if not _thin_kernels(x, r):
        y = torch._grouped_mm(x, w, offs=offs)
        return y * scale if scale != 1.0 else y
    x = x.contiguous()
    y = x.new_empty(M, r)
    if M == 0:
        return y
    cfg = _INTERPRETER_CONFIG if _interpreting() else _THIN
    grid = (M // cfg["BM"] + E + 1,)
    _lora_rows_kernel[grid](x, w, y, offs.to(torch.int32), M, K, E, x.stride(0), w.stride(0), w.stride(1),
                            w.stride(2), float(scale), E_POW2=triton.next_power_of_2(E + 1), R=r, BM=cfg["BM"],
                            BK=cfg["BK"], DOT_FP32=_interpreting(), num_warps=cfg["num_warps"],
                            num_stages=cfg["num_stages"])
    return y


def ragged_outer(p: torch.Tensor, q: torch.Tensor, offs: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """scale · Σ over each expert's rows of pᵀ·q: [E, NP, NQ] in p's dtype, for rows p [M, NP] and q [M, NQ] sorted by
    expert (the weight gradients of LoRA's A and B: one of NP, NQ is the rank)."""
    E = offs.shape[0]
    NP, NQ = p.shape[1], q.shape[1]
    rank = min(NP, NQ)
    if not _thin_kernels(p, rank) or q.dtype != p.dtype:
        c = torch._grouped_mm(p.t(), q, offs=offs)
        return c * scale if scale != 1.0 else c
    p, q = p.contiguous(), q.contiguous()
    c = p.new_empty(E, NP, NQ)
    if E == 0:
        return c
    cfg = _OUTER_INTERPRETER if _interpreting() else _OUTER
    BP, BQ = (NP, cfg["BT"]) if NP == rank else (cfg["BT"], NQ)
    grid = (E, triton.cdiv(NP, BP), triton.cdiv(NQ, BQ))
    _ragged_outer_kernel[grid](p, q, c, offs.to(torch.int32), NP, NQ, p.stride(0), q.stride(0), c.stride(0),
                               c.stride(1), c.stride(2), float(scale), BP=BP, BQ=BQ, BK=cfg["BK"],
                               DOT_FP32=_interpreting(), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return c


@torch.library.custom_op("moetune::lora_rows", mutates_args=())
def _lora_rows_op(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, scale: float) -> torch.Tensor:
    return lora_rows(x, w, offs, scale)


@_lora_rows_op.register_fake
def _(x, w, offs, scale):
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("moetune::ragged_outer", mutates_args=())
def _ragged_outer_op(p: torch.Tensor, q: torch.Tensor, offs: torch.Tensor, scale: float) -> torch.Tensor:
    return ragged_outer(p, q, offs, scale)


@_ragged_outer_op.register_fake
def _(p, q, offs, scale):
    return p.new_empty(offs.shape[0], p.shape[1], q.shape[1])


# A frozen bf16 stack with LoRA on it, one op each way: the LoRA branch's s·(x·Aᵀ)·Bᵀ added in the kernel's epilogue
# (forward), and in the input gradient's its (dy·s·B)·A, instead of each written out as [rows, out] and added by a pass
# of its own. The thin products (x·Aᵀ, dy·s·B, A's and B's gradients) by the kernels above.
@torch.library.custom_op("moetune::grouped_mm_frozen_lora", mutates_args=())
def _grouped_mm_frozen_lora_op(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, lora_A: torch.Tensor,
                               lora_B: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    xa = lora_rows(x, lora_A.transpose(-2, -1), offs)
    return _run_lora(x, weight, offs, True, xa, (lora_B * scaling).transpose(-2, -1)), xa


@_grouped_mm_frozen_lora_op.register_fake
def _(x, weight, offs, lora_A, lora_B, scaling):
    return x.new_empty(x.shape[0], weight.shape[1]), x.new_empty(x.shape[0], lora_A.shape[1])


@torch.library.custom_op("moetune::grouped_mm_frozen_lora_dgrad", mutates_args=())
def _grouped_mm_frozen_lora_dgrad_op(grad: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                                     grad_xa: torch.Tensor, lora_A: torch.Tensor) -> torch.Tensor:
    return _run_lora(grad, weight, offs, False, grad_xa, lora_A)


@_grouped_mm_frozen_lora_dgrad_op.register_fake
def _(grad, weight, offs, grad_xa, lora_A):
    return grad.new_empty(grad.shape[0], weight.shape[2])


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
