"""The expert stacks' transposed copies made one MoE layer ahead of the backward, on a second stream.

Hopper's fp8 GEMMs read both operands K-major, so the input gradient through a frozen fp8 stack [E, out, in] reads it
as [E, in, out] (model/quant/matmul.py). Kept for the run, the copies take the stacks' bytes again (GLM-4.7-Flash:
27.3 GiB, more than fits beside the rest within 50 GiB); made in each layer's backward, they sit on the critical path
(13.6 ms of Flash's 222 ms step, BENCHMARKS.md eighteenth session). Here every MoE layer but the last reads its copies
from one pair of slots that the layers share (one layer's copies: Flash 0.56 GiB), and the backward fills them one
layer ahead: once MoE layer i's experts have their input gradient, layer i-1's stacks are copied into the slots on a
side stream while the main stream runs layer i's attention backward; layer i's input gradient waits for the copy (the
join), so layer i-1's experts find it made. The last MoE layer, the first the backward reaches, copies its own.

The fork and the join are identity autograd nodes whose backward is an opaque op, both inside the layer: in a
compiled layer, and in a CUDA graph's capture, a forked stream rejoins within the same graph. The copy writes the
slots outside the graph's view (not a declared mutation, and not through an argument): nothing in a graph that forks
reads them after the fork, and the layer that reads them runs after the join. The slots are looked up by device and
shape, so every model of those shapes shares one pair; backward passes never interleave on one stream.
"""

from __future__ import annotations

import weakref

import torch

from moetune.model.grouped_gemm import k_major_copy
from moetune.model.quant.modules import AHEAD, TRANSPOSED
from moetune.tensors import local_tensor

STACKS = ("gate_up_proj", "down_proj")

_SLOTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # (device, shape, dtype) -> slot
_STREAMS: dict = {}


def _slot(like: torch.Tensor) -> torch.Tensor:
    """The shared slot for the transposed copy of a stack like `like` (made on first use)."""
    shape = (*like.shape[:-2], like.shape[-1], like.shape[-2])
    key = (like.device, shape, like.dtype)
    slot = _SLOTS.get(key)
    if slot is None:
        slot = torch.empty(shape, dtype=like.dtype, device=like.device)
        if slot.is_cuda:
            torch._dynamo.mark_static_address(slot)  # a CUDA graph reads it where it is, never a copy of it
        _SLOTS[key] = slot
    return slot


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def _fill(stacks) -> None:
    # through .data: autograd's version counter of a slot saved for a backward stays as it was (the slot is refilled
    # for each reader, before it reads)
    for w in stacks:
        k_major_copy(w, out=_slot(w).data)


@torch.library.custom_op("moetune::copies_ahead", mutates_args=())
def _copies_ahead(grad: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Fork: the two stacks' transposed copies into their slots, on the side stream once the work queued so far (this
    layer's experts' backward) is done; `grad` passes through (a fresh tensor: an op's output may not alias)."""
    if grad.is_cuda:
        main, side = torch.cuda.current_stream(grad.device), _side_stream(grad.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            _fill((gate_up, down))
    else:
        _fill((gate_up, down))
    return grad.clone()


@_copies_ahead.register_fake
def _(grad, gate_up, down):
    return torch.empty_like(grad)


@torch.library.custom_op("moetune::copies_joined", mutates_args=())
def _copies_joined(grad: torch.Tensor) -> torch.Tensor:
    """Join: what the main stream queues next waits for the side stream's copies."""
    if grad.is_cuda:
        torch.cuda.current_stream(grad.device).wait_stream(_side_stream(grad.device))
    return grad.clone()


@_copies_joined.register_fake
def _(grad):
    return torch.empty_like(grad)


class _Fork(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate_up, down):
        ctx.save_for_backward(gate_up, down)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        gate_up, down = ctx.saved_tensors
        return torch.ops.moetune.copies_ahead(g.contiguous(), gate_up, down), None, None


class _Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return torch.ops.moetune.copies_joined(g.contiguous())


def stacks_ahead(mlp) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The stacks a layer's backward copies for the MoE layer before it (its MLP's experts), or None."""
    experts = getattr(mlp, "experts", None)
    d = {} if experts is None else experts.__dict__
    stacks = tuple(d.get(name + AHEAD) for name in STACKS)
    return None if stacks[0] is None else stacks


def fork(x: torch.Tensor, stacks) -> torch.Tensor:
    """x, whose gradient, once complete, starts the copies of `stacks` (the MoE input: its experts are done)."""
    return _Fork.apply(x, *stacks)


def join(x: torch.Tensor) -> torch.Tensor:
    """x, whose gradient, once complete, waits for the copies (the layer's input: its attention is done)."""
    return _Join.apply(x)


@torch.no_grad()
def copy_ahead(model) -> int:
    """Give the MoE layers with row-scaled fp8 stacks (as this rank computes with them) shared slots for their
    transposed copies, filled one layer ahead of the backward; returns the bytes of the slots (0: fewer than two such
    layers, nothing to overlap). Not with kept copies (quant.modules.keep_transposed_copies), not for weights FSDP
    shards (Layout.fp8_copies_ahead is never set there)."""
    moe = []
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        quant = getattr(experts, "quant", None)
        if quant is not None and quant.block is None:
            moe.append(experts)
    if len(moe) < 2:
        return 0
    slots = set()
    # every MoE layer holds both keys, None where it has nothing: a compiled layer guards on a key it found, not on
    # one it did not (a layer compiled without the key would otherwise be reused for one that has it)
    for name in STACKS:
        moe[-1].__dict__[name + TRANSPOSED] = moe[0].__dict__[name + AHEAD] = None
    for before, experts in zip(moe, moe[1:]):
        for name in STACKS:
            stack = local_tensor(getattr(before, name))
            slot = _slot(stack)
            before.__dict__[name + TRANSPOSED] = slot
            experts.__dict__[name + AHEAD] = stack
            slots.add(slot)
    return sum(s.numel() * s.element_size() for s in slots)

