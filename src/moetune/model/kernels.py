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
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

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
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


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


# ---------------------------------------------------------------------------------------- weighted SwiGLU
def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def weighted_swiglu_fwd_torch(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return swiglu(h).float().mul(w.unsqueeze(-1)).to(h.dtype)


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


if triton is not None:
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

    @triton.jit
    def _swiglu_fwd_kernel(h, w, out, I, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < I
        g = tl.load(h + row * 2 * I + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h + row * 2 * I + I + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(w + row).to(tl.float32)
        a = g * tl.sigmoid(g) * u * scale
        tl.store(out + row * I + cols, a.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(h, w, grad, grad_h, grad_w, I, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < I
        g = tl.load(h + row * 2 * I + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h + row * 2 * I + I + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(grad + row * I + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(w + row).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        tl.store(grad_w + row, tl.sum(silu * u * dy, axis=0))
        dp = dy * scale  # gradient of silu(g)·u
        d_gate = dp * u * sig * (1.0 + g * (1.0 - sig))
        tl.store(grad_h + row * 2 * I + cols, d_gate.to(grad_h.dtype.element_ty), mask=mask)
        tl.store(grad_h + row * 2 * I + I + cols, (dp * silu).to(grad_h.dtype.element_ty), mask=mask)
