"""FP8 (e4m3) storage of a frozen weight: the two layouts the hub's FP8 GLM releases use, quantising and dequantising.

- "rowwise": compressed-tensors `float-quantized` with `strategy: channel` (GLM-4.5/4.5-Air/4.6/4.7 FP8): an fp8
  `weight [out, in]` and `weight_scale [out, 1]`; the real weight is `weight · weight_scale`.
- "block": DeepSeek-style `quant_method: fp8`, `weight_block_size: [b0, b1]` (GLM-5 FP8, b = 128): an fp8 `weight` and
  `weight_scale_inv [⌈out/b0⌉, ⌈in/b1⌉]`; the real weight is `weight · weight_scale_inv` per block (the name is the
  inverse of the quantiser's scale, which is what multiplies back).

A fused expert stack `gate_up_proj [E, 2I, H]` holds two weights the hub stores apart, gate and up [I, H], each
blocked on its own grid: its block scales are the two grids, `[E, 2, ⌈I/b0⌉, ⌈H/b1⌉]` (`parts` 2; one more dimension
than the weight, so that everything dequantising a weight reads the convention from its scale). Where I is not a
multiple of b0 that differs from one grid of ⌈2I/b0⌉ rows, in the count of rows or, as bad, in where they start.

Everything here works on leading batch dimensions too (expert stacks `[E, out, in]`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# A row or block of zeros gets this scale rather than 0 (its quantised values are 0 either way; no division by 0).
_TINY = 1e-12


@dataclass(frozen=True)
class Fp8Scheme:
    """How a frozen weight is stored: one scale per output row (`block` None) or one per `block` of [rows, cols]."""

    block: tuple[int, int] | None = None

    @property
    def scale_suffix(self) -> str:
        """The name of the scale tensor next to `weight` in a checkpoint (and in our modules)."""
        return "weight_scale" if self.block is None else "weight_scale_inv"

    def scale_shape(self, shape, parts: int = 1) -> tuple[int, ...]:
        """The scale of a weight of `shape` whose rows fuse `parts` weights blocked apart (row scales: one a row)."""
        *lead, out, inp = shape
        if self.block is None:
            return (*lead, out, 1)
        b0, b1 = self.block
        grid = (-(-(out // parts) // b0), -(-inp // b1))
        return (*lead, *grid) if parts == 1 else (*lead, parts, *grid)

    def quantize(self, w: torch.Tensor, parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """fp8 values and scales of w; `parts` > 1: w's rows fuse that many weights, each blocked on its own grid."""
        if self.block is None:
            return quantize_rows(w)
        if parts == 1:
            return quantize_blocks(w, self.block)
        *lead, out, inp = w.shape
        q, scale = quantize_blocks(w.reshape(*lead, parts, out // parts, inp), self.block)
        return q.reshape(w.shape), scale

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        if self.block is None:
            return (q.to(torch.float32) * scale.to(torch.float32)).to(dtype)
        return (q.to(torch.float32) * expand_block_scale(scale, q.shape, self.block)).to(dtype)

    @property
    def name(self) -> str:
        return "fp8" if self.block is None else "fp8_block"


ROWWISE = Fp8Scheme()


def scheme_named(name: str | None, block: tuple[int, int] = (128, 128)) -> Fp8Scheme | None:
    """`model.quantize`: None (no quantisation), "fp8" (one scale per output row) or "fp8_block" (`block` scales)."""
    if name is None:
        return None
    return {"fp8": ROWWISE, "fp8_block": Fp8Scheme(tuple(block))}[name]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 values and fp32 scales [..., 1] with x ≈ q · scale, one scale per row (last dim reduced). Functional:
    the compiled fp8 matmuls quantise their activations with it (Inductor fuses it)."""
    xf = x.to(torch.float32)
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_TINY)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@torch.no_grad()
def quantize_rows_(x: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor) -> None:
    """quantize_rows, bit for bit, into q_out (fp8) and scale_out [..., 1] (fp32), x (fp32 scratch) divided by its
    scales in place: no temporary the size of x (the weight sync's staging is bounded)."""
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=-1, keepdim=True)  # max |x| a row, exact
    scale = amax.div_(FP8_MAX).clamp_(min=_TINY)
    x.div_(scale).clamp_(-FP8_MAX, FP8_MAX)
    q_out.copy_(x)
    scale_out.copy_(scale)


def quantize_blocks(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 values and fp32 `scale_inv [..., ⌈out/b0⌉, ⌈in/b1⌉]` with w ≈ q · scale_inv per block."""
    b0, b1 = block
    *lead, out, inp = w.shape
    po, pi = -out % b0, -inp % b1
    wf = torch.nn.functional.pad(w.to(torch.float32), (0, pi, 0, po))
    blocks = wf.view(*lead, (out + po) // b0, b0, (inp + pi) // b1, b1)
    scale = (blocks.abs().amax(dim=(-3, -1), keepdim=True) / FP8_MAX).clamp(min=_TINY)
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(*lead, out + po, inp + pi)[..., :out, :inp]
    return q.contiguous(), scale.squeeze(-1).squeeze(-2)


def expand_block_scale(scale: torch.Tensor, shape, block) -> torch.Tensor:
    """The per-element fp32 multiplier of a block-scaled weight of `shape`; a scale with one more dimension than the
    weight holds the grids of the parts its rows fuse (a gate_up stack), each part's rows blocked from its own start."""
    b0, b1 = block
    *lead, out, inp = shape
    if scale.dim() == len(shape) + 1:
        parts = scale.shape[-3]
        return expand_block_scale(scale, (*lead, parts, out // parts, inp), block).reshape(*lead, out, inp)
    s = scale.to(torch.float32).repeat_interleave(b0, dim=-2).repeat_interleave(b1, dim=-1)
    return s[..., :out, :inp]


@torch.no_grad()
def dequantize_(w: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme, row0: int = 0) -> torch.Tensor:
    """`scheme.dequantize` in place and bit for bit: w (fp32, holding the fp8 values) times its scales, with no
    temporary the size of w (the weight sync's staging is bounded). Block scales: w's rows start `row0` rows into the
    first block row of `scale` (the rows of a 2-D weight gathered from anywhere in it); a scale with one more
    dimension than w holds the grids of the parts w's rows fuse, each part's rows blocked from its own start."""
    if scheme.block is None:
        return w.mul_(scale)
    b0, b1 = scheme.block
    if scale.dim() == w.dim() + 1:
        for part, rows in enumerate(w.chunk(scale.shape[-3], dim=-2)):
            dequantize_(rows, scale[..., part, :, :], scheme, row0)
        return w
    R, C = w.shape[-2:]
    full = C // b1 * b1
    for i in range(scale.shape[-2]):  # a block row at a time: its full column blocks in one product, then the tail
        rows = w[..., max(0, i * b0 - row0): min(R, (i + 1) * b0 - row0), :]
        if rows.shape[-2] == 0:
            continue
        if full:
            rows[..., :full].unflatten(-1, (-1, b1)).mul_(scale[..., i, None, : full // b1, None])
        if full < C:
            rows[..., full:].mul_(scale[..., i, None, -1:])
    return w


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
