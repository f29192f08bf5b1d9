"""Work that a stop signal may end at once.

The trainer's stop signals (train/signals.py) promise a checkpoint at the end of the current step. Before training
starts there is nothing to save, and some of that work is long: tokenising a large data set takes minutes to hours,
far past a scheduler's grace period. Such work runs inside ``interruptible(what)``; a stop signal that arrives
meanwhile raises at once (train/signals.py decides what is raised), so the work must leave nothing half-written that
would later be read as complete (the data cache writes under a temporary name and renames; see data/cache.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_phases: list[str] = []


@contextmanager
def interruptible(what: str) -> Iterator[None]:
    _phases.append(what)
    try:
        yield
    finally:
        _phases.pop()


def current() -> str | None:
    """What interruptible work runs now (the innermost), or None."""
    return _phases[-1] if _phases else None
