"""Token permutation and grouped GEMM for stacked experts.

Tokens are sorted by expert once per MoE layer; every expert's rows are then contiguous and one grouped GEMM
(`torch._grouped_mm`, offsets from the cumulative token count) runs all experts at once — no Python loop over
experts, no host synchronisation. Expert LoRA runs on the same permuted tokens (x·Aᵀ then ·Bᵀ, each a grouped
GEMM), so W + BA is never built.

Each token's rows are copies of it, and its outputs are summed back (`expand`, `combine` over `Bags`); under expert
parallelism (model/expert_parallel.py) the same maps send a token's rows and expand the rows a rank received to its
(row, expert) pairs, and `routed_experts` runs the same expert computation on them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moetune.model import grouped_gemm_tiles
from moetune.model import grouped_gemm_tma as tma
from moetune.model.grouped_gemm import grouped_mm_frozen, grouped_mm_frozen_lora, kernel_supported, lora_epilogue_fits
from moetune.model.kernels import gather_sum, weighted_swiglu_bwd, weighted_swiglu_fwd, weighted_swiglu_fwd_torch
from moetune.model.quant.matmul import fp8_expert_mlp, fp8_expert_mlp_applies, fp8_grouped_linear
from moetune.model.quant.fp8 import quantize_rows
from moetune.model.quant.modules import FrozenFp8
from moetune.model.recompute import Rebuilt
from moetune.tensors import local_tensor

_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
# The frozen bf16 base stacks' GEMMs, forward and input gradient: "torch" (torch._grouped_mm) or "triton"
# (model/grouped_gemm.py: the persistent TMA kernel where it takes the operands, on Hopper). fp8 stacks take
# model/quant/matmul.py's kernels (its GROUPED_FORWARD, GROUPED_DGRAD); LoRA's trainable A/B and trainable stacks
# torch._grouped_mm. "triton": on one H200 faster in eight same-call pairs, +0.1–2.8% end to end (Flash and AIR-8,
# LoRA on attention and on the experts, with and without CUDA graphs; BENCHMARKS.md, twenty-second and
# twenty-third sessions).
GROUPED_GEMM = "triton"


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


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, base: bool = False) -> torch.Tensor:
    """y[rows of expert e] = x[rows of expert e] @ weight[e].T, for weight [E, out, in] and int32 offsets [E]
    (under expert parallelism: this rank's experts, `offs` counting only the rows it received). A `FrozenFp8`
    weight runs through the fp8 grouped GEMM (model/quant). `base`: the weight is an expert stack of the model (not
    LoRA's A or B), which `GROUPED_GEMM` may send through the Triton kernel when it is frozen."""
    if isinstance(weight, FrozenFp8):
        return fp8_grouped_linear(x, local_tensor(weight.q), local_tensor(weight.scale), offs, weight.scheme,
                                  weight.transposed)
    weight = local_tensor(weight)
    if (base and GROUPED_GEMM == "triton" and (x.is_cuda or grouped_gemm_tiles.KERNEL_ON_CPU)
            and not weight.requires_grad and kernel_supported(x, weight, None)):
        return grouped_mm_frozen(x, weight, offs)
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    return _ContiguousGrad.apply(_grouped_mm(x, weight.transpose(-2, -1), offs=offs))


@dataclass
class Bags:
    """A many-to-one map of `n` item rows onto `m` bag rows: item i is a copy of bag `bag[i]`, and `slots[j]` lists
    bag j's items (−1: an empty slot; `full`: none is). The permutation by expert (each token a bag of its k rows) and
    the expert-parallel exchange's expansions (model/expert_parallel.py: a token's rows to send, a received row's
    (row, expert) pairs) are both."""

    bag: torch.Tensor  # [n]
    slots: torch.Tensor  # [m, J]
    full: bool = False


@dataclass
class Permutation:
    """Where each (token, slot) pair went when tokens were sorted by expert."""

    token_idx: torch.Tensor  # [T*k] source token of each permuted row
    order: torch.Tensor  # [T*k] flat (token, slot) index of each permuted row
    inverse: torch.Tensor  # [T*k] permuted row of each flat (token, slot) index
    counts: torch.Tensor  # [E] rows per expert
    offs: torch.Tensor  # [E] int32 cumulative counts: the grouped GEMM's group ends
    k: int  # slots per token

    @property
    def bags(self) -> Bags:
        """Each token a bag of its k permuted rows."""
        return Bags(self.token_idx, self.inverse.view(-1, self.k), full=True)


def count_values(idx: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of 0..n-1 occurs in idx (int64 [n]). `torch.bincount` sizes its output from the data: on
    CUDA it copies idx's max and min to the host (two synchronisations that drain the GPU's queue) and
    torch.compile breaks the graph there; a scatter-add of ones has a static shape and exact integer sums."""
    flat = idx.reshape(-1)
    return torch.zeros(n, dtype=torch.long, device=idx.device).scatter_add_(0, flat, torch.ones_like(flat))


# Sort keys in the narrowest integer type that holds them: CUDA's radix sort makes one pass over the keys (and the
# order it carries) per byte of key, eight for the int64 the router's top-k gives. False: the keys as they come.
NARROW_SORT_KEYS = True


def sort_by_key(key: torch.Tensor, num_keys: int) -> torch.Tensor:
    """The stable argsort of integer keys in [0, num_keys): the same order whatever type they are sorted in."""
    if NARROW_SORT_KEYS:
        for dtype in (torch.uint8, torch.int16, torch.int32):
            if num_keys - 1 <= torch.iinfo(dtype).max:
                key = key.to(dtype)
                break
    return torch.argsort(key, stable=True)


def permute(topk_idx: torch.Tensor, num_experts: int) -> Permutation:
    k = topk_idx.shape[-1]
    flat = topk_idx.reshape(-1)
    order = sort_by_key(flat, num_experts)
    counts = count_values(flat, num_experts)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    offs = counts.cumsum(0).to(torch.int32)
    return Permutation(order // k, order, inverse, counts, offs, k)


def permute_rows(x: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """Each token's row once per slot, sorted by expert: x[perm.token_idx]."""
    return expand(x, perm.bags)


def unpermute(y_perm: torch.Tensor, perm: Permutation, num_tokens: int) -> torch.Tensor:
    """Sum of each token's k (already weighted) expert outputs, as a gather (deterministic, no atomics)."""
    assert num_tokens == perm.inverse.numel() // perm.k
    return combine(y_perm, perm.bags)


def expand_rows(src: torch.Tensor, bags: Bags) -> torch.Tensor:
    """Each item's copy of its bag's row: src[bags.bag]."""
    return src[bags.bag]


def _bag_sums(rows: torch.Tensor, slots: torch.Tensor, full: bool) -> torch.Tensor:
    return gather_sum(rows, slots.reshape(-1), slots.shape[0], empty_slots=not full)


def expand(src: torch.Tensor, bags: Bags) -> torch.Tensor:
    """bag rows [m, H] -> item rows [n, H] (each item a copy of its bag's row); the backward sums per bag."""
    return _Expand.apply(src, bags.bag, bags.slots, bags.full)


def combine(rows: torch.Tensor, bags: Bags) -> torch.Tensor:
    """item rows [n, H] -> bag rows [m, H] (the sum of each bag's items); the backward copies per item."""
    return _Combine.apply(rows, bags.bag, bags.slots, bags.full)


# Both directions are gathers, forward and backward. Autograd's own backward of x[token_idx] and of the [n, k, H] sum
# scatters into zeros (`index_put` after `new_zeros`), and Inductor writes a [n, k, H] sum as a reduction kernel over k
# that reads the rows at ~0.9 TB/s on an H200; k gathers added compile to one element-wise kernel running along each
# row's columns (2.9 TB/s; permutation forward + backward of Air's 32,768 rows 0.40 ms against 0.84, BENCHMARKS.md,
# twelfth session). Eager, the sums are model/kernels.py's bag-sum kernel.
class _Expand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, src, bag, slots, full):
        ctx.save_for_backward(slots)
        ctx.full = full
        return src[bag]  # expand_rows

    @staticmethod
    def backward(ctx, g):
        (slots,) = ctx.saved_tensors
        return _bag_sums(g, slots, ctx.full), None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, bag, slots, full):
        ctx.save_for_backward(bag)
        return _bag_sums(rows, slots, full)

    @staticmethod
    def backward(ctx, g):
        (bag,) = ctx.saved_tensors
        return g[bag], None, None, None


# The weighted SwiGLU's backward in compiled code: "kernel", model/kernels.py's row kernel as an opaque op (CUDA),
# one pass writing h's gradient and the routing weights' (the forward stays traced: Inductor fuses it with the
# grouped GEMM's neighbours at the rate of memory); or "inductor", autograd's ops traced, which Inductor writes as a
# reduction for the weights' gradient and an element-wise kernel for h's, reading h twice (GLM-4.7-Flash's 16,384
# rows: 183 µs a layer against the kernel's 58; +1.8–2.7% end to end on Flash, AIR-8 and an EP-8 rank of Air,
# BENCHMARKS.md, twenty-fifth session).
SWIGLU_BACKWARD = "kernel"


def weighted_swiglu(h: torch.Tensor, row_weights: torch.Tensor) -> torch.Tensor:
    """swiglu(h) scaled by each row's routing weight in fp32, back in h's dtype, keeping only h for the backward
    (autograd would keep silu(gate), the product and its fp32 copy: 2.5× the memory of h). Compiled, the forward is
    traced (Inductor fuses it with its neighbours) and the backward one opaque kernel (SWIGLU_BACKWARD); in eager mode
    (the expert-parallel exchange is a graph break) one Triton kernel each way on CUDA (model/kernels.py)."""
    if torch.compiler.is_compiling() and not (SWIGLU_BACKWARD == "kernel"
                                              and (h.is_cuda or grouped_gemm_tiles.KERNEL_ON_CPU)):
        return weighted_swiglu_fwd_torch(h, row_weights)
    return _WeightedSwiGLU.apply(h, row_weights)


@torch.library.custom_op("moetune::weighted_swiglu_bwd", mutates_args=())
def _weighted_swiglu_bwd_op(h: torch.Tensor, row_weights: torch.Tensor,
                            grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # weighted_swiglu sends the backward here only where the kernel runs
    grad_h, grad_w = weighted_swiglu_bwd(h, row_weights, grad, True, use_kernel=True)
    return grad_h, grad_w.to(row_weights.dtype)


@_weighted_swiglu_bwd_op.register_fake
def _(h, row_weights, grad):
    return torch.empty_like(h), row_weights.new_empty(h.shape[0])


class _WeightedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, row_weights):
        ctx.save_for_backward(h, row_weights)
        if torch.compiler.is_compiling():
            return weighted_swiglu_fwd_torch(h, row_weights)
        return weighted_swiglu_fwd(h, row_weights)

    @staticmethod
    def backward(ctx, grad):
        h, row_weights = ctx.saved_tensors
        if not torch.compiler.is_compiling():
            return weighted_swiglu_bwd(h, row_weights, grad, ctx.needs_input_grad[1])
        grad_h, grad_w = torch.ops.moetune.weighted_swiglu_bwd(h, row_weights, grad)
        return grad_h, grad_w if ctx.needs_input_grad[1] else None


# Expert LoRA on frozen bf16 stacks through the TMA kernel (GROUPED_GEMM "triton"): its product added in the kernel's
# epilogue, forward and input gradient (grouped_gemm.grouped_mm_frozen_lora), instead of written out as [rows, out]
# and added (ExpertLoRA.delta). One H200, same call: GLM-4.7-Flash LoRA on MLA and the experts with CUDA graphs 15,239
# tokens/s against 15,103, AIR-8 with LoRA on the experts equal (36,437 against 36,448): the element-wise passes go,
# the epilogue's plain loads cost the GEMM part of it (BENCHMARKS.md, twenty-sixth session). False: the latter.
LORA_IN_EPILOGUE = True


def _lora_in_epilogue(x, weight, lora, lora_A) -> bool:
    if not (LORA_IN_EPILOGUE and GROUPED_GEMM == "triton" and isinstance(lora.dropout, torch.nn.Identity)):
        return False
    weight = local_tensor(weight)
    return (not isinstance(weight, FrozenFp8) and not weight.requires_grad and weight.dtype == x.dtype
            and lora_epilogue_fits(x, weight, lora_A.shape[1]))


def _lora_linear(x, weight, offs, lora, lora_A, lora_B):
    """x through a frozen stack with the LoRA pair (A, B) on it: in the kernel's epilogue where it fits."""
    if _lora_in_epilogue(x, weight, lora, lora_A):
        A, B = local_tensor(lora_A).to(x.dtype), local_tensor(lora_B).to(x.dtype)
        return grouped_mm_frozen_lora(x, local_tensor(weight), offs, A, B, lora.scaling)
    return grouped_linear(x, weight, offs, base=True) + lora.delta(x, lora_A, lora_B, offs)


def fuses_fp8_mlp(x, gate_up_proj, down_proj, lora) -> bool:
    """Whether experts_forward runs these stacks as one fp8 node (quant.matmul.fp8_expert_mlp)."""
    return (lora is None and isinstance(gate_up_proj, FrozenFp8)
            and fp8_expert_mlp_applies(x, gate_up_proj, down_proj))


def _local_fp8(w: FrozenFp8) -> FrozenFp8:
    return FrozenFp8(local_tensor(w.q), local_tensor(w.scale), w.scheme, w.transposed)


def fp8_routed_experts(x, perm: Permutation, row_weights, gate_up, down) -> torch.Tensor:
    """unpermute(experts_forward(permute_rows(x, perm), ...)) for fp8 stacks fuses_fp8_mlp takes, in compiled code:
    the tokens quantised, then their fp8 rows gathered (the bf16 rows are never made), and the combine inside the
    fused node, whose backward gathers down's operand from the tokens' gradient (quant.matmul.fp8_expert_mlp)."""
    xq, sx = quantize_rows(x)
    return fp8_expert_mlp(permute_rows(x, perm), row_weights, _local_fp8(gate_up), _local_fp8(down), perm.offs,
                          quantized=(xq[perm.token_idx], sx[perm.token_idx]),
                          combine=(perm.inverse, perm.token_idx, x.shape[0]))


def experts_forward(x, offs, row_weights, gate_up_proj, down_proj, lora=None, lora_weights=None,
                    rebuilt: Rebuilt | None = None) -> torch.Tensor:
    """Run rows x [N, H] sorted by expert (group ends `offs`) through stacked experts (gate_up [E, 2I, H],
    down [E, H, I]); `lora` (an ExpertLoRA) adds its deltas, with `lora_weights` (gate_up A, B, down A, B) in
    place of its own parameters when given (the expert-parallel path passes this rank's local tensors). With
    `rebuilt` active (eager code), the SwiGLU output that down's weight gradients read is saved as a recompute from
    gate_up's output, which the SwiGLU's backward keeps anyway.

    The routing weight of each row scales the SwiGLU output, before down_proj: the same product (down_proj
    is linear) on I = 1408 columns instead of H = 4096, and the combine that follows is a plain sum. Frozen fp8
    stacks without expert LoRA run as one node (quant.matmul.fp8_expert_mlp)."""
    if fuses_fp8_mlp(x, gate_up_proj, down_proj, lora):
        return fp8_expert_mlp(x, row_weights, _local_fp8(gate_up_proj), _local_fp8(down_proj), offs)
    if lora is not None and lora_weights is None:
        lora_weights = lora.pairs()
    if lora is None:
        h = grouped_linear(x, gate_up_proj, offs, base=True)
    else:
        h = _lora_linear(x, gate_up_proj, offs, lora, lora_weights[0], lora_weights[1])
    a = weighted_swiglu(h, row_weights)
    if rebuilt is not None:
        rebuilt.add(a, functools.partial(weighted_swiglu_fwd, h.detach(), row_weights.detach()))
    if lora is None:
        return grouped_linear(a, down_proj, offs, base=True)
    return _lora_linear(a, down_proj, offs, lora, lora_weights[2], lora_weights[3])


# The expansion's two gathers inside the grouped GEMMs (frozen 16-bit stacks through the TMA kernel, expert LoRA in
# its epilogue or none): gate_up's forward reads its rows from the tokens (or the rows a rank received) and down's
# input gradient from their gradient, by pointer loads in the kernels, instead of each [rows, H] gather being written
# out and read back (one EP-8 rank of Air: 5.9 + 6.0 ms of its 455 ms step, BENCHMARKS.md, thirty-second session);
# with expert LoRA, A's weight gradient reads the tokens too, so the expanded rows are not kept for the backward.
# The kernel's A tiles then come by pointer loads, not TMA; one H200 (BENCHMARKS.md, thirty-fourth session): gate_up's
# forward 1.600 ms against 1.626 for the gather then the GEMM on the EP-8 rank's shape, down's input gradient 0.756
# against 0.925; the EP-8 rank 9,110 -> 9,258 tokens/s, AIR-8 q,k,v,o 40,856 -> 41,376, with expert LoRA 36,503 ->
# 37,427 (43.3 -> 41.8 GiB), Flash MLA 17,272 -> 17,402.
GATHER_IN_GEMM = True


class _GatheredFrozenLinear(torch.autograd.Function):
    """grouped_mm_frozen(expand(x, bags), W) with the gather in the kernel's loads; the backward gives x's gradient,
    each bag's rows' input gradients summed."""

    @staticmethod
    def forward(ctx, x, weight, offs, bag, slots, full):
        ctx.save_for_backward(weight, offs, slots)
        ctx.full = full
        return torch.ops.moetune.grouped_mm_frozen_rows(x, bag, weight, offs, True)

    @staticmethod
    def backward(ctx, g):
        weight, offs, slots = ctx.saved_tensors
        grad_rows = torch.ops.moetune.grouped_mm_frozen_dgrad(g.contiguous(), weight, offs, None)
        return _bag_sums(grad_rows, slots, ctx.full), None, None, None, None, None


class _FrozenLinearSummed(torch.autograd.Function):
    """combine(grouped_mm_frozen(a, W), bags): each bag's rows summed; the backward's input gradient reads its operand
    rows from the bags' gradient in the kernel's loads."""

    @staticmethod
    def forward(ctx, a, weight, offs, bag, slots, full):
        ctx.save_for_backward(weight, offs, bag)
        return _bag_sums(torch.ops.moetune.grouped_mm_frozen(a, weight, offs, None), slots, full)

    @staticmethod
    def backward(ctx, g):
        weight, offs, bag = ctx.saved_tensors
        grad_a = torch.ops.moetune.grouped_mm_frozen_rows(g.contiguous(), bag, weight, offs, False)
        return grad_a, None, None, None, None, None


class _GatheredFrozenLoRALinear(torch.autograd.Function):
    """grouped_mm_frozen_lora(expand(x, bags), W, A, B) with the gather in the kernels' loads (the base GEMM's and
    x·Aᵀ's); the backward gives x's gradient (each bag's rows' summed), and A's from the tokens read through the index
    (the expanded rows are not kept)."""

    @staticmethod
    def forward(ctx, x, weight, offs, bag, slots, full, lora_A, lora_B, scaling):
        y, xa = torch.ops.moetune.grouped_mm_frozen_lora_rows(x, bag, weight, offs, lora_A, lora_B, scaling)
        ctx.save_for_backward(x, weight, offs, bag, slots, lora_A, lora_B, xa)
        ctx.full, ctx.scaling = full, scaling
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight, offs, bag, slots, lora_A, lora_B, xa = ctx.saved_tensors
        g, ops = g.contiguous(), torch.ops.moetune
        grad_xa = ops.lora_rows(g, lora_B, offs, ctx.scaling)
        grad_B = ops.ragged_outer(g, xa, offs, ctx.scaling)
        grad_A = ops.ragged_outer(grad_xa, x, offs, 1.0, q_rows=bag)
        grad_rows = ops.grouped_mm_frozen_lora_dgrad(g, weight, offs, grad_xa, lora_A)
        return _bag_sums(grad_rows, slots, ctx.full), None, None, None, None, None, grad_A, grad_B, None


class _FrozenLoRALinearSummed(torch.autograd.Function):
    """combine(grouped_mm_frozen_lora(a, W, A, B), bags); the backward reads the rows' gradient from the bags'
    gradient through the index, in the input gradient's kernel and in LoRA's thin products."""

    @staticmethod
    def forward(ctx, a, weight, offs, bag, slots, full, lora_A, lora_B, scaling):
        y, xa = torch.ops.moetune.grouped_mm_frozen_lora(a, weight, offs, lora_A, lora_B, scaling)
        ctx.save_for_backward(a, weight, offs, bag, lora_A, lora_B, xa)
        ctx.scaling = scaling
        return _bag_sums(y, slots, full)

    @staticmethod
    def backward(ctx, g):
        a, weight, offs, bag, lora_A, lora_B, xa = ctx.saved_tensors
        g, ops = g.contiguous(), torch.ops.moetune
        grad_xa = ops.lora_rows(g, lora_B, offs, ctx.scaling, rows=bag)
        grad_B = ops.ragged_outer(g, xa, offs, ctx.scaling, p_rows=bag)
        grad_A = ops.ragged_outer(grad_xa, a, offs, 1.0)
        grad_a = ops.grouped_mm_frozen_lora_dgrad(g, weight, offs, grad_xa, lora_A, rows=bag)
        return grad_a, None, None, None, None, None, grad_A, grad_B, None


def gathers_in_gemm_settings(fp8_stacks: bool, lora_rank: int | None, lora_dropout: bool) -> bool:
    """The part of gathers_in_gemm that settings decide, without tensors (also the memory estimate's, for a GPU run):
    the switches, stacks not fp8, and expert LoRA of rank `lora_rank` (None: no expert LoRA) in the TMA kernel's
    epilogue, a rank it takes and no dropout. The rest is the device's and the operands' (16-bit, TMA)."""
    if not (GATHER_IN_GEMM and GROUPED_GEMM == "triton") or fp8_stacks:
        return False
    return lora_rank is None or (LORA_IN_EPILOGUE and not lora_dropout
                                 and lora_rank in grouped_gemm_tiles.LORA_RANKS)


def gathers_in_gemm(x, gate_up, down, lora, lora_weights=None) -> bool:
    """Whether routed_experts runs these stacks with the expansion's gathers inside the GEMMs (GATHER_IN_GEMM): frozen
    16-bit stacks through the TMA kernel, and expert LoRA (`lora_weights`, else its own) in its epilogue or none."""
    fp8 = isinstance(gate_up, FrozenFp8) or isinstance(down, FrozenFp8)
    A_gate_up, _, A_down, _ = (None,) * 4 if lora is None else (lora_weights or lora.pairs())
    rank = None if lora is None else A_gate_up.shape[1]
    dropout = lora is not None and not isinstance(lora.dropout, torch.nn.Identity)
    if not (gathers_in_gemm_settings(fp8, rank, dropout) and (x.is_cuda or grouped_gemm_tiles.KERNEL_ON_CPU)):
        return False
    if lora is not None and not (_lora_in_epilogue(x, gate_up, lora, A_gate_up)
                                 and _lora_in_epilogue(x, down, lora, A_down)):
        return False
    gate_up, down = local_tensor(gate_up), local_tensor(down)
    return (not gate_up.requires_grad and not down.requires_grad and gate_up.dtype == down.dtype == x.dtype
            and kernel_supported(x, gate_up, None) and tma.tma_supported(x, gate_up, True)
            and tma.tma_supported(x.new_empty(0, down.shape[1]), down, False))


def routed_experts(x, bags: Bags, offs, row_weights, gate_up, down, lora=None, lora_weights=None,
                   rebuilt: Rebuilt | None = None) -> torch.Tensor:
    """combine(experts_forward(expand(x, bags), offs, ...), bags): rows x [m, H] (tokens; under expert parallelism the
    rows a rank received) expanded to their (row, expert) pairs sorted by expert (group ends `offs`), through the
    experts, each row's weighted outputs summed [m, H]; with the two gathers inside the GEMMs where `gathers_in_gemm`
    says. Arguments after `bags` as experts_forward's; with `rebuilt`, the expanded rows are saved as a gather of x."""
    if gathers_in_gemm(x, gate_up, down, lora, lora_weights):
        gate_up, down = local_tensor(gate_up), local_tensor(down)
        maps = (bags.bag, bags.slots, bags.full)
        if lora is None:
            h = _GatheredFrozenLinear.apply(x, gate_up, offs, *maps)
            return _FrozenLinearSummed.apply(weighted_swiglu(h, row_weights), down, offs, *maps)
        A1, B1, A2, B2 = (local_tensor(t).to(x.dtype) for t in lora_weights or lora.pairs())
        h = _GatheredFrozenLoRALinear.apply(x, gate_up, offs, *maps, A1, B1, lora.scaling)
        a = weighted_swiglu(h, row_weights)
        if rebuilt is not None:  # down's A gradient reads the SwiGLU output: rebuilt from h, which backward keeps
            rebuilt.add(a, functools.partial(weighted_swiglu_fwd, h.detach(), row_weights.detach()))
        return _FrozenLoRALinearSummed.apply(a, down, offs, *maps, A2, B2, lora.scaling)
    rows = expand(x, bags)
    if rebuilt is not None:
        rebuilt.add(rows, functools.partial(expand_rows, x.detach(), bags))
    return combine(experts_forward(rows, offs, row_weights, gate_up, down, lora, lora_weights, rebuilt), bags)
