"""Token permutation and grouped GEMM for stacked experts.

Tokens are sorted by expert once per MoE layer; every expert's rows are then contiguous and one grouped GEMM
(`torch._grouped_mm`, offsets from the cumulative token count) runs all experts at once — no Python loop over
experts, no host synchronisation. Expert LoRA runs on the same permuted tokens (x·Aᵀ then ·Bᵀ, each a grouped
GEMM), so W + BA is never built.

Expert parallelism (`ep_dispatch` / `ep_combine`): each rank holds E/ep experts (DTensor Shard(0) over the ep
group, set up by `parallel.apply_ep`). Rows sorted by global expert are already grouped by destination rank,
so one all-to-all sends every row to the rank holding its expert and a second one brings the results back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd

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


def local_experts(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a stacked weight: the local shard of an expert-parallel DTensor, else itself."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """y[rows of expert e] = x[rows of expert e] @ weight[e].T, for weight [E, out, in] and int32 offsets [E]
    (under expert parallelism: this rank's experts, `offs` counting only the rows it received)."""
    weight = local_experts(weight)
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


def experts_forward(x, offs, row_weights, gate_up_proj, down_proj, lora=None) -> torch.Tensor:
    """Run rows x [N, H] sorted by expert (group ends `offs`) through stacked experts (gate_up [E, 2I, H],
    down [E, H, I]).

    The routing weight of each row scales the SwiGLU output, before down_proj: the same product (down_proj
    is linear) on I = 1408 columns instead of H = 4096, and the combine that follows is a plain sum."""
    h = grouped_linear(x, gate_up_proj, offs)
    if lora is not None:
        h = h + lora.delta_gate_up(x, offs)
    a = (swiglu(h).float() * row_weights.unsqueeze(-1)).to(x.dtype)
    y = grouped_linear(a, down_proj, offs)
    if lora is not None:
        y = y + lora.delta_down(a, offs)
    return y


# ------------------------------------------------------------------------------------- expert parallelism
@dataclass
class EPPlan:
    """What `ep_combine` needs to send the expert outputs back where `ep_dispatch` took the rows from."""

    group: dist.ProcessGroup
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank
    unsort: torch.Tensor  # received row (source-major order) -> its position in expert-major order


def ep_dispatch(x, topk_weights, perm: Permutation, group):
    """Send each (token, slot) row and its routing weight to the rank that holds its expert.

    Returns (rows, row_weights, offs, plan): the rows this rank's experts must process, sorted by local expert,
    the grouped GEMM's group ends, and the plan for `ep_combine`. Every rank takes part in every call, whatever
    its tokens route to (split sizes may be 0), so uneven routing cannot desynchronise the collectives.
    """
    ep = group.size()
    n_local = perm.counts.numel() // ep
    # Routing metadata first, asynchronously: with NCCL the gathers below are queued behind it on the GPU, so
    # the one host sync (.tolist(), split sizes must be Python ints) waits while the GPU still has work.
    recv_counts = torch.empty_like(perm.counts)
    work = dist.all_to_all_single(recv_counts, perm.counts, group=group, async_op=True)
    rows = x[perm.token_idx]
    row_weights = topk_weights.reshape(-1)[perm.order]
    work.wait()
    recv_counts = recv_counts.view(ep, n_local)  # [source rank, local expert]
    send_splits, recv_splits = torch.stack([perm.counts.view(ep, n_local).sum(1), recv_counts.sum(1)]).tolist()
    rows = all_to_all_single_autograd(rows, recv_splits, send_splits, group)
    row_weights = all_to_all_single_autograd(row_weights, recv_splits, send_splits, group)
    # Received rows come grouped by source rank, then by local expert; the grouped GEMM wants them by expert.
    expert_of_row = torch.arange(n_local, device=rows.device).repeat(ep).repeat_interleave(
        recv_counts.reshape(-1), output_size=sum(recv_splits))
    order = torch.argsort(expert_of_row, stable=True)
    unsort = torch.empty_like(order)
    unsort[order] = torch.arange(order.numel(), device=order.device)
    offs = recv_counts.sum(0).cumsum(0).to(torch.int32)
    return rows[order], row_weights[order], offs, EPPlan(group, send_splits, recv_splits, unsort)


def ep_combine(y: torch.Tensor, plan: EPPlan) -> torch.Tensor:
    """The inverse of `ep_dispatch`: expert outputs back to the ranks (and the row order) they came from."""
    return all_to_all_single_autograd(y[plan.unsort], plan.send_splits, plan.recv_splits, plan.group)
