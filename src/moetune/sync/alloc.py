"""Accounting of the buffers the sender allocates during a sync.

On GPU, torch.cuda.max_memory_allocated measures a sync's memory; on CPU nothing does, so every buffer the sender
allocates goes through `Allocations`, which counts the bytes alive at once and their peak. A tensor is counted from
`empty`/`track` until it is garbage (a weakref finalizer), so the peak is what was really held together.
"""

from __future__ import annotations

import threading
import weakref

import torch


class Allocations:
    def __init__(self):
        self.live = 0
        self.peak = 0
        self._lock = threading.Lock()  # finalizers may run on another thread (gloo's, the garbage collector's)

    def reset(self) -> None:
        with self._lock:
            self.peak = self.live

    def track(self, t: torch.Tensor) -> torch.Tensor:
        n = t.untyped_storage().nbytes()
        with self._lock:
            self.live += n
            self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._release, n)
        return t

    def empty(self, shape, dtype, device) -> torch.Tensor:
        return self.track(torch.empty(shape, dtype=dtype, device=device))

    def _release(self, n: int) -> None:
        with self._lock:
            self.live -= n
