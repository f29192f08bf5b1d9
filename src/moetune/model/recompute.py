"""Activation checkpointing ("recompute") of a piece of a layer: `full` keeps only the inputs and recomputes
everything in backward; `selective` keeps what the GEMMs and attention produced and recomputes only the cheap
element-wise ops (norms, RoPE, SwiGLU, casts, permutation gathers) and the products as cheap as those (LoRA's B:
`selective_checkpoint_context`); `attention` (a layer mode, `split_modes`) recomputes the attention block in full
and keeps the MLP's or MoE's activations.

`Rebuilt` keeps, in place of some large tensors autograd would save, a way to rebuild them cheaply in backward
(a gather, an element-wise op): recompute of single tensors, not of a whole piece."""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from moetune.names import SELECTIVE_RECOMPUTE_MAX_K

# torch 2.15 asks whether what selective recompute saves goes through the saved-tensor hooks around it (Rebuilt, below)
# and will say yes by default later: kept as measured, SAC holding its tensors itself (eager only; compiled regions
# never route them).
_SAC_KEEPS_ITS_TENSORS = ({"respect_saved_tensors_hooks": False}
                          if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters else {})


@functools.cache
def _aten_saved_ops() -> frozenset:
    aten = torch.ops.aten
    return frozenset({aten.mm.default, aten.addmm.default, aten._grouped_mm.default, aten._scaled_mm.default,
                      aten._scaled_grouped_mm.default, aten._scaled_dot_product_flash_attention.default,
                      aten._scaled_dot_product_efficient_attention.default,
                      aten._scaled_dot_product_cudnn_attention.default})


# Our own product ops (custom ops: LoRA linears, frozen expert stacks), registered by the modules that define them
# (`register_product`): op -> the argument whose last dimension they reduce over, as _products.
_OUR_PRODUCTS: dict = {}


def register_product(op, reduces_over: int = 0) -> None:
    """Selective recompute keeps `op`'s outputs as it keeps aten's GEMMs' (a product reducing over the last dimension
    of argument `reduces_over`)."""
    _OUR_PRODUCTS[op] = reduces_over


def _saved_ops() -> frozenset:
    return _aten_saved_ops() | _OUR_PRODUCTS.keys()


def _products() -> dict:
    """The saved ops that are products, and which argument's last dimension is the one they reduce over: mm(a [M, K],
    b), addmm(bias, a [M, K], b), _grouped_mm(a [M, K] or [G, M, K], b, offs), and ours (register_product)."""
    aten = torch.ops.aten
    return {aten.mm.default: 0, aten.addmm.default: 1, aten._grouped_mm.default: 0, **_OUR_PRODUCTS}


def selective_checkpoint_context():
    """Keep the GEMM and attention outputs, recompute the rest; but recompute a product that reduces over at most
    SELECTIVE_RECOMPUTE_MAX_K (64) elements, which in a GLM model only LoRA's B does (its K is the rank; the smallest
    base GEMM reduces over MLA's kv_lora_rank, 512).

    Such a product does 2K FLOPs per output element: at most 64 per byte written in bf16, under a third of an H100's
    or H200's ridge point (~990 dense bf16 TFLOP/s over 3.35-4.8 TB/s: 200-300 FLOPs per byte). It runs at the speed
    of memory like the element-wise ops recomputed anyway, and its recompute costs 2·tokens·r·out FLOPs (3 % of a
    512-wide base GEMM's at r 16), while its output is as large as that of the base GEMM it is added to: keeping it
    made selective keep more than no recompute on GLM-5's LoRA'd MLA projections. The recompute reads x·Aᵀ
    ([tokens, r]), which stays kept (its K is the LoRA input's width): B's weight gradient reads it too, so keeping it
    costs b·r bytes a token, while recomputing it would cost the product with A and need LoRA's input. With LoRA
    dropout the recompute draws the forward's mask again: the checkpoint restores the RNG state (torch's
    preserve_rng_state, on by default). A rank above 64 keeps B's output: from 128 FLOPs per byte on the product nears
    the ridge point. A LoRA linear on a bf16 base as one op (lora.LORA_LINEAR "op") keeps its one output, the base
    output with B's product added, and x·Aᵀ, which it returns to save for its backward: what the traced form keeps."""
    saved, products, bound = _saved_ops(), _products(), SELECTIVE_RECOMPUTE_MAX_K

    def policy(ctx, op, *args, **kwargs):
        if op not in saved or (op in products and args[products[op]].shape[-1] <= bound):
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return create_selective_checkpoint_contexts(policy)


def _recompute_every_op(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def full_checkpoint_context():
    """`full` under torch.compile, said op by op: recompute everything. The plain checkpoint tags the nodes Dynamo
    traced, and before torch 2.12 (pytorch#177396) not the ops inside a custom autograd.Function's forward — the fp8
    base's matmuls (model/quant/matmul.py) — so the partitioner kept their outputs (full-size Air with expert LoRA,
    torch 2.11: every MoE layer's gate_up output and q projection, 11.7 GiB in all). The selective path tags ops as
    they dispatch, inside autograd.Functions too; the tag is the plain checkpoint's."""
    return create_selective_checkpoint_contexts(_recompute_every_op)


def recompute(fn, mode: str, *args):
    """fn(*args), with its activations recomputed in backward as `mode` ("none", "full", "selective") says."""
    if mode == "none":
        return fn(*args)
    if mode == "selective":
        kw = {"context_fn": selective_checkpoint_context}
    else:  # eager, the plain checkpoint reruns fn as it is (no dispatch mode in the way)
        kw = {"context_fn": full_checkpoint_context} if torch.compiler.is_compiling() else {}
    return checkpoint(fn, *args, use_reentrant=False, **_SAC_KEEPS_ITS_TENSORS, **kw)


def split_modes(mode: str, expert_parallel: bool) -> tuple[str, str] | None:
    """How a decoder layer applies its mode (ac_modes.AC_MODES): None to recompute the layer as one piece, else the
    modes of its attention block and of its MLP/MoE half. Under expert parallelism a whole-layer recompute would
    repeat the all-to-all, so attention and the local expert work recompute apart and the exchange's rows are kept.

    Locally a MoE layer under `full` recomputes whole, routing and sort included: a split (attention and expert work
    apart, the routing kept) measured 80% of the no-recompute rate on AIR-8 expert LoRA against 60% whole, but keeps the
    residual after attention, the normed input and the routing besides the layer input (~3× what `full` keeps per MoE
    layer), and `full` is the mode of last resort for memory: with it GLM-5 on an fp8 base no longer fit 16 H200s.
    `layout: auto` recomputes the attention of as few layers as fit first ({attention: n, none: rest})."""
    if mode == "attention":
        return "full", "none"
    if mode != "none" and expert_parallel:
        return mode, mode
    return None


class _Recipe:
    __slots__ = ("rebuild",)

    def __init__(self, rebuild):
        self.rebuild = rebuild


class Rebuilt(torch.autograd.graph.saved_tensors_hooks):
    """While active, a tensor registered with `add(t, rebuild)` is saved for backward as `rebuild` (which must
    return t's values from what backward keeps anyway) instead of its memory; every other tensor is saved as
    usual. Tensors are matched by storage, offset, shape, stride and dtype: autograd may hand the hook another
    Python object for the same tensor.

    The hooks hold the recipe table, not this object: a bound method would make a reference cycle that only
    Python's collector frees, keeping every recipe's tensors allocated until it runs. The table is emptied on exit:
    what was packed holds its own recipe."""

    def __init__(self):
        self._recipes: dict[tuple, Callable[[], torch.Tensor]] = {}
        super().__init__(functools.partial(_pack, self._recipes), _unpack)

    def add(self, t: torch.Tensor, rebuild: Callable[[], torch.Tensor]) -> torch.Tensor:
        self._recipes[_key(t)] = rebuild
        return t

    def __exit__(self, *exc):
        self._recipes.clear()
        return super().__exit__(*exc)


def _key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _pack(recipes: dict, t):
    rebuild = recipes.get(_key(t))
    return t if rebuild is None else _Recipe(rebuild)


def _unpack(saved):
    return saved.rebuild() if isinstance(saved, _Recipe) else saved
