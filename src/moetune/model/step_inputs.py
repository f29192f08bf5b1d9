"""The layers' per-step inputs at addresses that stay put from step to step, for layers replayed as CUDA graphs.

CUDA graph trees replay a compiled backward with every input that is not a gradient at the address its recording saw
(torch/_inductor/compile_fx.py: the backward's static inputs are all but its tangents), the forward's inputs it saved
included. A forward input that each step makes anew (RoPE's cos and sin, the document mask's tensors and the document
ids its mask reads, the varlen kernels' document starts) moves between steps when the allocator's state differs, and
the backward re-records at every step ("static input data pointer changed", which no re-record limit stops: one EP-8
rank of GLM-4.5-Air ran at 751 tokens/s). Copied into buffers kept across steps, they stay put: a few hundred KB of
copies a step. A buffer is overwritten by the next step's copy, after that step's backward has run."""

from __future__ import annotations

import torch


def unstaged(name: str, t):
    return t


class StepInputs:
    """stage(name, t) -> t's values in the buffer kept for `name` and t's shape, dtype and device (made on first use):
    batches of another shape (an evaluation's) get buffers of their own, so the training step's stay where its graphs
    saw them. Tensors that require gradients pass as they are: autograd would link the buffer to one step's graph."""

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}

    def __call__(self, name: str, t):
        if t is None or t.requires_grad:
            return t
        key = (name, tuple(t.shape), t.dtype, t.device)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        return buf.copy_(t)
