"""fp8 e4m3 with 128×128 block scales: the format of block-quantized checkpoints (DeepSeek-V3, GLM-4.5-FP8) and
of the block-fp8 MoE kernels that serve them.

For every 128×128 block of a weight [..., R, C] (the last blocks of a dimension may be shorter):
    s = max|w| / 448                      (fp32, stored as `weight_scale_inv`: the factor that *restores* w)
    q = fp8_e4m3fn(w / s)                 (round to nearest; |w / s| ≤ 448, the largest e4m3fn value)
    w ≈ q · s                             (`dequantize`)
Error (elementwise): |w − q·s| ≤ 2⁻⁴·|w| + 2⁻¹⁰·s  — half a unit in the last place of e4m3 (3 mantissa bits) for
normal values, half the subnormal spacing (2⁻⁹) below 2⁻⁶ — plus fp32 rounding of the division, far smaller.
"""

from __future__ import annotations

import math

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128


def scale_shape(rows: int, cols: int, block: int = BLOCK) -> tuple[int, int]:
    return math.ceil(rows / block), math.ceil(cols / block)


def _spans(n: int, block: int):
    """(start, stop, block length) of the full blocks of a dimension, then of its short tail block if any."""
    full = n // block * block
    if full:
        yield 0, full, block
    if full < n:
        yield full, n, n - full


@torch.no_grad()
def quantize_(x: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor, block: int = BLOCK) -> None:
    """Quantize x [..., R, C] (fp32 staging, possibly a strided view) into q_out (fp8, same shape) and scale_out
    [..., ⌈R/block⌉, ⌈C/block⌉] (fp32). x is divided by its scales in place: it is scratch, and dividing where it lies
    is what keeps quantization free of temporaries the size of x (reductions and the scale grid are all it adds)."""
    R, C = x.shape[-2:]
    for r0, r1, br in _spans(R, block):
        for c0, c1, bc in _spans(C, block):
            # [..., rows, cols] -> [..., row blocks, br, col blocks, bc]: a view, as both spans are whole blocks
            blocks = x[..., r0:r1, c0:c1].unflatten(-1, (-1, bc)).unflatten(-3, (-1, br))
            amax = torch.linalg.vector_norm(blocks, ord=float("inf"), dim=(-3, -1))  # max |w|, in one pass
            scale = amax.div_(FP8_MAX).clamp_min_(torch.finfo(torch.float32).tiny)  # an all-zero block keeps q = 0
            i, j = r0 // block, c0 // block
            scale_out[..., i: i + scale.shape[-2], j: j + scale.shape[-1]].copy_(scale)
            blocks.div_(scale.unsqueeze(-1).unsqueeze(-3))
    # |w / s| can exceed 448 by an ulp of fp32 rounding; e4m3fn has no infinity, so make sure nothing rounds past it
    x.clamp_(-FP8_MAX, FP8_MAX)
    q_out.copy_(x)


def quantize(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of w [..., R, C]; allocating convenience wrapper of quantize_ (w is not modified)."""
    x = w.detach().to(torch.float32, copy=True)
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    s = torch.empty(*x.shape[:-2], *scale_shape(*x.shape[-2:], block), dtype=torch.float32, device=x.device)
    quantize_(x, q, s, block)
    return q, s


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK, dtype=torch.float32) -> torch.Tensor:
    """q · s per block: the reference the receivers (and inference kernels) apply."""
    R, C = q.shape[-2:]
    s = scale.repeat_interleave(block, dim=-2)[..., :R, :].repeat_interleave(block, dim=-1)[..., :C]
    return (q.to(torch.float32) * s).to(dtype)


def error_bound(w: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The elementwise bound on |w − dequantize(quantize(w))| stated in the module docstring."""
    R, C = w.shape[-2:]
    s = scale.repeat_interleave(block, dim=-2)[..., :R, :].repeat_interleave(block, dim=-1)[..., :C]
    w = w.to(torch.float32).abs()
    return w * 2.0**-4 + s * 2.0**-10 + w * 2.0**-20
