"""The grouped GEMM of model/grouped_gemm.py with its operand tiles loaded by TMA (Hopper's tensor memory
accelerator), pipelined by Triton, on the same tile schedule (model/grouped_gemm_tiles.py), and the K-major copy of a
stack that its fp8 input gradient reads.

`_grouped_gemm_tma_kernel` runs the fp8 × fp8 forward of a row-scaled fp8 stack and its input gradient, on a K-major
copy (model/quant/matmul.py's "tma", the default there) or on the stack as stored as the transposed product (its
"w8a8"), and bf16 stacks both ways (not used by default: within 3% of torch's `_grouped_mm` end to end, BENCHMARKS.md,
twenty-second session). `grouped_mm_tma` is it as a triton_op, which torch.compile launches from its own code.
`_grouped_gemm_tma_persistent_kernel` computes the same tiles with a program an SM, enumerating only tiles that have
rows and running its tile and K loops as one pipelined loop (`TMA_PERSISTENT`). model/grouped_gemm.py's custom ops
choose it where `tma_supported` says it takes the operands. With `a_rows` either kernel reads a 16-bit A's rows
through an index by pointer loads (the permutation by expert read from the tokens: experts.GATHER_IN_GEMM).
"""

from __future__ import annotations

import torch

# the switches (KERNEL_ON_CPU, CONFIG) read through their module at call time: tests and benchmarks set them there
from moetune.model import grouped_gemm_tiles
from moetune.model.grouped_gemm_tiles import _interpreting

try:  # optional: the CPU build of torch comes without Triton
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# ------------------------------------------------------------------------------------------------ kernels
if triton is not None:
    from moetune.model.grouped_gemm_tiles import _grouped_order, _tile

    @triton.jit
    def _tma_descriptors(a_ptr, b_ptr, M, N, K, E, stride_am, B_KMAJOR: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, PAIRS: tl.constexpr = False,
                         A_ROWS: tl.constexpr = False):
        """The operands' TMA descriptors: A as [M, K], the stack as one [E·N, K] (K-major) or [E·K, N] matrix
        (PAIRS: b_ptr is an fp8 stack's int16 view, [E·K, N/2]). A_ROWS: A's rows are gathered by pointer loads,
        and a_ptr is handed on as it is."""
        if A_ROWS:
            a_desc = a_ptr
        else:
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
                  stride_pr=0, stride_pn=0, LORA: tl.constexpr = False, RANK: tl.constexpr = 16, rows_ptr=None,
                  stride_am=0, A_ROWS: tl.constexpr = False):
        """One output tile (rows row0.. of group g below row_b, column tile tn): C = A · B[g] summed over K up to
        k_end, the scales applied, stored; the padding group E's rows are stored as zeros whatever they summed.
        SWAP (an N-major fp8 stack): Cᵀ = B[g]ᵀ · Aᵀ, the stack's tile transposed in registers as the MMA's first
        operand. Hopper's fp8 MMA reads its second operand K-major from shared memory only: an N-major fp8 tile
        there, Triton transposes it through shared memory again and waits on every MMA (145–157 TFLOP/s,
        BENCHMARKS.md, fifteenth session); as the first operand it may come from registers, and the MMAs stay
        asynchronous (the sm_90 compile: wgmma with its A in registers, MMAs left in flight at each wait).
        LORA (no SWAP): C[rows of g] += L[rows] · P[g] after the scales, L [M, RANK] contiguous and P[g] [RANK, N]
        at strides (stride_pr, stride_pn) 16-bit: one more MMA over RANK before the store (a LoRA branch's product
        added in the epilogue).
        A_ROWS (16-bit, no SWAP): row m of A is row rows[m] of the matrix at a_desc (a pointer here, rows
        `stride_am` apart), loaded by pointer loads, which Triton pipelines as TMA's are; the tile's rows past its
        group load as zeros."""
        ge = tl.minimum(g, E - 1)  # the padding group reads expert E − 1 (in bounds, finite)
        acc = tl.zeros((BN, BM) if SWAP else (BM, BN), dtype=tl.float32)
        if A_ROWS:
            ra = row0 + tl.arange(0, BM)
            rk = tl.arange(0, BK)
            src = tl.load(rows_ptr + ra, mask=ra < row_b, other=0)
            a_ptrs = a_desc + src.to(tl.int64)[:, None] * stride_am + rk[None, :]
        for k0 in range(0, k_end, BK):
            if A_ROWS:
                a = tl.load(a_ptrs + k0, mask=(ra < row_b)[:, None] & (rk < K - k0)[None, :], other=0.0)
            else:
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
                                 stride_pn=0, LORA: tl.constexpr = False, RANK: tl.constexpr = 16, rows_ptr=None,
                                 A_ROWS: tl.constexpr = False):
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
        a_desc, b_desc = _tma_descriptors(a_ptr, b_ptr, M, N, K, E, stride_am, B_KMAJOR, BM, BN, BK, PAIRS,
                                          A_ROWS)
        k_end = tl.where(g < E, K, 0)  # the padding group has nothing to sum
        _tma_tile(a_desc, b_desc, c_ptr, scale_ptr, ascale_ptr, g, row0, row_b, tn, k_end, N, K, E, stride_cm,
                  stride_se, B_KMAJOR, SCALE_A, SCALE_B, DOT_FP32, BM, BN, BK, SWAP, PAIRS, l_ptr, p_ptr, stride_pe,
                  stride_pr, stride_pn, LORA, RANK, rows_ptr, stride_am, A_ROWS)

    @triton.jit
    def _grouped_gemm_tma_persistent_kernel(a_ptr, b_ptr, c_ptr, scale_ptr, ascale_ptr, offs_ptr, M, N, K, E,
                                            stride_am, stride_cm, stride_se,
                                            E_POW2: tl.constexpr, B_KMAJOR: tl.constexpr, SCALE_A: tl.constexpr,
                                            SCALE_B: tl.constexpr, DOT_FP32: tl.constexpr, BM: tl.constexpr,
                                            BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                                            num_programs, FLATTEN: tl.constexpr, SWAP: tl.constexpr = False,
                                            PAIRS: tl.constexpr = False, l_ptr=None, p_ptr=None, stride_pe=0,
                                            stride_pr=0, stride_pn=0, LORA: tl.constexpr = False,
                                            RANK: tl.constexpr = 16, rows_ptr=None, A_ROWS: tl.constexpr = False):
        """The tiles with rows, each program taking every `num_programs`-th one (a program an SM): with FLATTEN,
        Triton's pipeliner runs the tile loop and the K loop as one, so the next tile's first operand loads overlap
        this tile's epilogue. On Flash's ~256-row groups a tile sums 12–16 K tiles, so the loads that start a tile
        and the stores that end it are a large part of a one-tile program (the candidate for the grouped GEMMs' rate
        on small groups: BENCHMARKS.md, twenty-first session). Only tiles with rows are enumerated (`_row_tiles`):
        every tile runs the whole K loop, which the loops' flattening needs; the padding group's is stored as zeros."""
        a_desc, b_desc = _tma_descriptors(a_ptr, b_ptr, M, N, K, E, stride_am, B_KMAJOR, BM, BN, BK, PAIRS,
                                          A_ROWS)
        starts, ends, first, R = _row_tiles(offs_ptr, M, E, E_POW2, BM)
        num_n = tl.cdiv(N, BN)
        for t in tl.range(tl.program_id(0), R * num_n, num_programs, flatten=FLATTEN):
            g, row0, row_b, tn = _real_tile(t, starts, ends, first, R, num_n, E_POW2, BM, GROUP_M)
            _tma_tile(a_desc, b_desc, c_ptr, scale_ptr, ascale_ptr, g, row0, row_b, tn, K, N, K, E, stride_cm,
                      stride_se, B_KMAJOR, SCALE_A, SCALE_B, DOT_FP32, BM, BN, BK, SWAP, PAIRS, l_ptr, p_ptr,
                      stride_pe, stride_pr, stride_pn, LORA, RANK, rows_ptr, stride_am, A_ROWS)


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
# SMs the persistent kernel leaves to kernels of other streams (NCCL's, an exchange's transfers), which a program on
# every SM may keep waiting until its last tile. On one H100 a stand-in transfer ran beside it in part with none left
# (overlap 0.2–0.8), 0.7–0.9 with 16 at ~5% of the GEMM (benchmarks/comm_overlap.py, BENCHMARKS.md thirty-seventh
# session); on 2 × H200 an all-to-all beside torch's CUTLASS grouped GEMM did not run at all ("Several GPUs").
# 0 until several GPUs measure it with this kernel.
RESERVED_SMS = 0


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
    elif not (_interpreting() and grouped_gemm_tiles.KERNEL_ON_CPU):
        return False
    if not (_aligned(x) and _aligned(weight) and weight.is_contiguous()):
        return False
    return transpose or weight.shape[1] % _tma_config(x.dtype == torch.float8_e4m3fn, transpose)["BK"] == 0


def _tma_config(fp8: bool, transpose: bool) -> dict:
    """The module's launch config on a GPU for these operands (grouped_gemm_tiles.CONFIG, if set, overrides it)."""
    return (TMA_CONFIG_FP8 if transpose else TMA_CONFIG_FP8_SWAP) if fp8 else TMA_CONFIG


def _tma_scratch(size: int, alignment: int, stream):
    """Scratch memory from torch's allocator for descriptors the kernel builds on the device it launches on (Triton
    launches on the current device; the interpreter runs on the CPU)."""
    return torch.empty(size, dtype=torch.int8, device="cpu" if _interpreting() else torch.cuda.current_device())


def grouped_gemm_tma(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, scale: torch.Tensor | None = None,
                     transpose: bool = True, x_scale: torch.Tensor | None = None,
                     config: dict | None = None, launch=None, persistent: bool | None = None,
                     pairs: bool | None = None, lora: tuple[torch.Tensor, torch.Tensor] | None = None,
                     a_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The TMA kernel's launch (operands as `tma_supported` says): y = x · op(W[e]) per group, op(W) = Wᵀ
    (`transpose`) or W; `scale` [E, out(, 1)] the fp8 stack's row scales for the forward (None: the input gradient,
    on a K-major copy or the stack as stored, the weight's scales folded into x), `x_scale` [M(, 1)] fp8 x's row
    scales. y bf16 for fp8 operands, else x's dtype. `config` as for `grouped_gemm` (GROUP_M, BM, BN, BK,
    num_warps, num_stages).
    `launch`: torch.library.wrap_triton inside the triton_op (torch.compile then launches the kernel itself).
    `persistent`: the persistent kernel (default TMA_PERSISTENT); `pairs`: an fp8 stack as stored moved as int16
    pairs (default TMA_SWAP_PAIRS). `lora` (L [M, r], P [E, r, N], any strides; 16-bit, r as `lora_epilogue_fits`
    says; not with `transpose` False on fp8): y[rows of e] += L[rows] · P[e] (after an fp8 product's scales),
    summed with the product in fp32 and rounded once.
    `a_rows` (integer [M], 16-bit operands): the product's rows are x[a_rows], read by the kernel where it loads them
    (no [M, K] copy of the gathered rows is made); y has M rows."""
    E, n_out, n_in = weight.shape
    M = x.shape[0] if a_rows is None else a_rows.shape[0]
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
    if a_rows is not None:
        assert not fp8 and a_rows.dim() == 1, (x.dtype, a_rows.shape)
        meta.update(rows_ptr=a_rows.contiguous(), A_ROWS=True)
    if lora is not None:
        L, P = lora
        assert not swap and L.shape == (M, P.shape[1]) and P.shape == (E, L.shape[1], N) and L.dtype == y.dtype
        L = L.contiguous()
        meta.update(l_ptr=L, p_ptr=P, stride_pe=P.stride(0), stride_pr=P.stride(1), stride_pn=P.stride(2), LORA=True,
                    RANK=L.shape[1])
    config = config or grouped_gemm_tiles.CONFIG or (
        grouped_gemm_tiles._INTERPRETER_CONFIG if _interpreting() else _tma_config(fp8, transpose))
    config = {k: v for k, v in config.items() if k not in ("SWAP", "PREFETCH")}
    triton.set_allocator(_tma_scratch)
    tiles = (M // config["BM"] + E + 1) * triton.cdiv(N, config["BN"])
    launch = launch or (lambda k: k)
    if TMA_PERSISTENT if persistent is None else persistent:
        programs = min(tiles, _INTERPRETER_PROGRAMS if _interpreting()
                       else torch.cuda.get_device_properties(x.device).multi_processor_count - RESERVED_SMS)
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
            w.is_cuda or (grouped_gemm_tiles.KERNEL_ON_CPU and _interpreting())):
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
