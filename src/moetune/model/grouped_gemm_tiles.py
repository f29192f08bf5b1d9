"""What the grouped kernels share (model/grouped_gemm.py's pointer kernel, grouped_gemm_tma.py's TMA kernels,
grouped_lora_kernels.py's thin LoRA products): the tile schedule over groups of rows, and the switches for where and
how they launch (on CPU tensors too under Triton's interpreter, with a fixed config or the interpreter's).

Rows are sorted by expert, group ends `offs` (int32 [E], cumulative), weight [E, out, in]. The grid is fixed by an
upper bound on the number of row tiles, so nothing reads `offs` on the host: group g (expert g < E, and past the
last end a group E of padding rows that gets zeros) owns the virtual row tiles [⌊a_g/BM⌋ + g, ⌊b_g/BM⌋ + g + 1) for
its rows [a_g, b_g) — at least ⌈(b_g − a_g)/BM⌉ of them — so ⌊M/BM⌋ + E + 1 virtual tiles cover every group
(telescoping), and each program finds its group with one vector compare over `offs`; tiles past a group's rows exit.
Tiles start at a group's first row, so a group of n rows costs ⌈n/BM⌉ tiles, as in a per-expert GEMM.
"""

from __future__ import annotations

import os

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
# The LoRA ranks the kernels take as an MMA dimension: powers of two from 16 (the MMA's K) to 64 (the rank's tiles
# beside the operands' in shared memory). Other ranks take torch's grouped GEMMs.
LORA_RANKS = (16, 32, 64)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# ------------------------------------------------------------------------------------------------ tile schedule
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
