"""Python's garbage collector during training, as torchtitan does it: automatic collection off, a young-generation
collection every `train.gc_every` steps, the previous setting back when the trainer closes.

Why: automatic collection starts whenever allocations pass a threshold, which a step passes many times, mostly in the
forward pass, where the host launching kernels is what the GPU waits for on a host-bound step (GLM-4.7-Flash's many
small MLA kernels); a collection there is a pause of the GPU, and an older generation's walks every long-lived object
(modules, compiled graphs, data). Measured on one H200, same call: GLM-4.7-Flash through `moetune train` 17,761
tokens/s with it, 16,370 with Python's automatic collection; on a GPU-bound step (an EP-8 rank of GLM-4.5-Air) no
difference (BENCHMARKS.md, ninth session). A step must then make no reference cycle that holds a tensor: it would
live until the next collection (tests/unit/test_step_api.py)."""

from __future__ import annotations

import gc


class GarbageCollection:
    def __init__(self, every: int):
        self.every = every  # 0: Python's automatic collection, untouched
        self.was_enabled = gc.isenabled()
        if every > 0:
            gc.disable()
            gc.collect(1)

    def step(self, step: int) -> None:
        """After step `step` (1-based)."""
        if self.every > 0 and step % self.every == 0:
            gc.collect(1)

    def close(self) -> None:
        if self.every > 0 and self.was_enabled:
            gc.enable()
