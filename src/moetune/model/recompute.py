"""Activation checkpointing ("recompute") of a piece of a layer: `full` keeps only the inputs and recomputes
everything in backward; `selective` keeps what the GEMMs and attention produced and recomputes only the cheap
element-wise ops (norms, RoPE, SwiGLU, casts, permutation gathers)."""

from __future__ import annotations

import functools

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
