"""Python's garbage collector during training, as torchtitan does it: automatic collection off, a young-generation
collection every `train.gc_every` steps, the previous setting back when the trainer closes.

Why: automatic collection starts whenever allocations pass a threshold, which a step reaches many times, mostly in
the forward pass, where the host launching kernels is what the GPU waits for (GLM-4.7-Flash on one H200: ~10% of the
step is GPU idle behind the host) — every pause there is a pause of the GPU. The model, compiled graphs and data make
millions of long-lived objects, so an older generation's pass is long. Automatic collection off, GLM-4.7-Flash through
`moetune train` ran 14,535 tokens/s against 13,891 (BENCHMARKS.md, ninth session)."""

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
