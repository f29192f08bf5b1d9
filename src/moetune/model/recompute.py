"""Activation checkpointing ("recompute") of a piece of a layer: `full` keeps only the inputs and recomputes
everything in backward; `selective` keeps what the GEMMs and attention produced and recomputes only the cheap
element-wise ops (norms, RoPE, SwiGLU, casts, permutation gathers); `attention` (a layer mode, `split_modes`)
recomputes the attention block in full and keeps the MLP's or MoE's activations.

`Rebuilt` keeps, in place of some large tensors autograd would save, a way to rebuild them cheaply in backward
(a gather, an element-wise op): recompute of single tensors, not of a whole piece."""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


@functools.cache
def _saved_ops() -> frozenset:
    aten = torch.ops.aten
    return frozenset({aten.mm.default, aten.addmm.default, aten._grouped_mm.default,
                      aten._scaled_dot_product_flash_attention.default,
                      aten._scaled_dot_product_efficient_attention.default,
                      aten._scaled_dot_product_cudnn_attention.default})


def selective_checkpoint_context():
    saved = _saved_ops()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def recompute(fn, mode: str, *args):
    """fn(*args), with its activations recomputed in backward as `mode` ("none", "full", "selective") says."""
    if mode == "none":
        return fn(*args)
    kw = {"context_fn": selective_checkpoint_context} if mode == "selective" else {}
    return checkpoint(fn, *args, use_reentrant=False, **kw)


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
