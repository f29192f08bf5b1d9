"""Token permutation and grouped GEMM for stacked experts.

Tokens are sorted by expert once per MoE layer; every expert's rows are then contiguous and one grouped GEMM
(`torch._grouped_mm`, offsets from the cumulative token count) runs all experts at once — no Python loop over
experts, no host synchronisation. Expert LoRA runs on the same permuted tokens (x·Aᵀ then ·Bᵀ, each a grouped
GEMM), so W + BA is never built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    grouped_mm's backward rejects expanded (stride-0) gradients, e.g. those of `y.sum()`; this guard costs
    nothing when the gradient is already contiguous.
    """

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """y[rows of expert e] = x[rows of expert e] @ weight[e].T, for weight [E, out, in] and int32 offsets [E]."""
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    return _ContiguousGrad.apply(_grouped_mm(x, weight.transpose(-2, -1), offs=offs))


@dataclass
class Permutation:
    """Where each (token, slot) pair went when tokens were sorted by expert."""

    token_idx: torch.Tensor  # [T*k] source token of each permuted row
    order: torch.Tensor  # [T*k] flat (token, slot) index of each permuted row
    inverse: torch.Tensor  # [T*k] permuted row of each flat (token, slot) index
    counts: torch.Tensor  # [E] rows per expert
    offs: torch.Tensor  # [E] int32 cumulative counts: the grouped GEMM's group ends


def permute(topk_idx: torch.Tensor, num_experts: int) -> Permutation:
    k = topk_idx.shape[-1]
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    offs = counts.cumsum(0).to(torch.int32)
    return Permutation(order // k, order, inverse, counts, offs)


def unpermute(y_perm: torch.Tensor, perm: Permutation, num_tokens: int) -> torch.Tensor:
    """Sum of each token's k (already weighted) expert outputs, as a gather (deterministic, no atomics)."""
    y = y_perm[perm.inverse]
    return y.view(num_tokens, -1, y.shape[-1]).sum(dim=1)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def experts_forward(x, perm: Permutation, row_weights, gate_up_proj, down_proj, lora=None) -> torch.Tensor:
    """Run permuted tokens x [T*k, H] through stacked experts (gate_up [E, 2I, H], down [E, H, I]).

    The routing weight of each row scales the SwiGLU output, before down_proj: the same product (down_proj
    is linear) on I = 1408 columns instead of H = 4096, and the combine that follows is a plain sum."""
    h = grouped_linear(x, gate_up_proj, perm.offs)
    if lora is not None:
        h = h + lora.delta_gate_up(x, perm.offs)
    a = (swiglu(h).float() * row_weights.unsqueeze(-1)).to(x.dtype)
    y = grouped_linear(a, down_proj, perm.offs)
    if lora is not None:
        y = y + lora.delta_down(a, perm.offs)
    return y
