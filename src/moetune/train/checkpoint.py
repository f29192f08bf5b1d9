"""Checkpoints: save every N steps and at the end, atomically; load one for an exact resume.

A checkpoint is what a run needs to continue as if it had never stopped, written with
torch.distributed.checkpoint (DCP) so that any number of processes can load it (DCP reshards). What it holds is
given as Stateful parts (states.py: model, optim, scheduler, loader, rng); this module knows none of their fields.
Beside them: trainer_state.json (step, tokens seen, config hash, moetune version) and the run's config.yaml, which
the resume checks compare (checkpoint_files.py). Saves are atomic: written to step_XXXXXX.tmp, fsynced, renamed.
Nothing non-finite is ever written: the trainable tensors are checked first (one fused check, all ranks).
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter

from moetune.checkpoint_reading import dcp_load, first_failure, read_dcp_index
from moetune.errors import CheckpointError, CheckpointWriteError, NumericalFault
from moetune.run_dir import METADATA, TRAINER_STATE, complete_checkpoints, step_dir_name
from moetune.tensors import all_finite
from moetune.train.checkpoint_files import dir_bytes, publish, remove_dir, write_synced

log = logging.getLogger("moetune")

_ERRORS = (Exception, CheckpointException)  # DCP's collective error derives from BaseException, not Exception
_SINGLE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"  # DCP's warning on every call


@dataclass
class _Save:
    step: int
    tmp: Path
    final: Path
    trainer_state: dict
    t0: float
    future: object = None  # async saves: DCP's future
    blocking_s: float = 0.0


def load_checkpoint(path: Path, states: dict, dist) -> None:
    """Load `states` (Stateful parts) in place from the checkpoint at `path` (already verified). A part whose
    entries the checkpoint lacks for this rank (rng of a rank the saving run did not have) keeps its state."""
    saved = read_dcp_index(path / METADATA).state_dict_metadata
    wanted = {name: part for name, part in states.items() if name != "rng" or f"rng.{part.key}" in saved}
    try:
        dcp_load(wanted, path, no_dist=not dist.initialized)
    except CheckpointError:
        raise
    except _ERRORS as e:
        raise CheckpointError(f"cannot load checkpoint {path}: {_root_cause(e)}") from e


class Checkpointer:
    """Writes checkpoints of `states` under `root`. `files()` gives the small text files to add ({name: text});
    `on_saved(record)` receives {"step", "checkpoint_s", "checkpoint_bytes"[, "checkpoint_blocking_s"]}."""

    def __init__(self, root: Path, cfg_checkpoint, dist, states: dict, trainable: list[torch.Tensor],
                 files: Callable[[], dict], on_saved: Callable[[dict], None] = lambda record: None):
        self.root, self.cfg, self.dist, self.states = root, cfg_checkpoint, dist, states
        self.trainable, self.files, self.on_saved = trainable, files, on_saved
        self._pending: _Save | None = None  # an async save still being written
        self.saved_step: int | None = None
        # Async writes run collectives from a background thread: they get their own gloo group so that they
        # never interleave with the training collectives of the main thread.
        self._async_group = None
        if cfg_checkpoint.async_save and dist.initialized:
            import torch.distributed as tdist

            self._async_group = tdist.new_group(backend="gloo")

    def agree(self, signalled: bool) -> bool:
        """Called by every rank after every step: one tiny all-reduce tells all ranks whether any was signalled
        (so all stop at the same step) and whether an async save has finished everywhere. Returns the stop."""
        busy = self._pending is not None and not self._pending.future.done()
        flags = torch.tensor([float(signalled), float(busy)], device=self.dist.device)
        self.dist.all_reduce_sum(flags)
        if self._pending is not None and flags[1] == 0:
            self._finish_pending()
        return bool(flags[0] > 0)

    def due(self, step: int, last: bool, stop: bool) -> bool:
        every = self.cfg.every
        return (last or stop or bool(every and step % every == 0)) and self.saved_step != step

    def save(self, step: int, trainer_state: dict) -> Path:
        """Write a checkpoint of step `step` (all ranks). Synchronous unless checkpoint.async_save."""
        if self._pending is not None:
            self._finish_pending()  # one write at a time
        bad = (~all_finite(self.trainable)).float().reshape(1).to(self.dist.device)
        if self.dist.all_reduce_sum(bad).item():
            raise NumericalFault(f"not writing the checkpoint of step {step}: a trainable weight is not finite")
        name = step_dir_name(step)
        s = _Save(step, self.root / f"{name}.tmp", self.root / name, trainer_state, time.perf_counter())
        if self.dist.is_main:  # before DCP's first collective: no rank writes into tmp before this
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                remove_dir(s.tmp)
            except OSError as e:
                self._fail(s, e)
        writer = FileSystemWriter(str(s.tmp), sync_files=True)  # fsyncs every file it writes
        no_dist = not self.dist.initialized
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
                if self.cfg.async_save:
                    # stages a CPU copy first, so the optimizer may update the weights while the copy is written
                    s.future = dcp.async_save(self._state_dicts(), storage_writer=writer,
                                              process_group=self._async_group, no_dist=no_dist)
                else:
                    dcp.save(self.states, storage_writer=writer, no_dist=no_dist)
        except _ERRORS as e:
            self._fail(s, e)
        s.blocking_s = time.perf_counter() - s.t0
        self.saved_step = step
        if s.future is not None:
            self._pending = s
        else:
            self._publish(s)
        return s.final

    def _state_dicts(self) -> dict:
        # async_save stages tensors from a plain state dict (a warning filter cannot reach its writer thread, so the
        # single-process warning is silenced where it is raised: see load_checkpoint and save)
        return {name: part.state_dict() for name, part in self.states.items()}

    def finish(self) -> None:
        if self._pending is not None:
            self._finish_pending()

    def _finish_pending(self) -> None:
        s, self._pending = self._pending, None
        try:
            s.future.result()
            error = None
        except _ERRORS as e:
            error = e
        if not self._all_ok(error is None):
            self._fail(s, error)
        self._publish(s)

    def _publish(self, s: _Save) -> None:
        """Rank 0 adds trainer_state.json and the config and renames; every rank learns whether it worked."""
        error, nbytes = None, 0
        if self.dist.is_main:
            try:
                write_synced(s.tmp / TRAINER_STATE, json.dumps(s.trainer_state, indent=2))
                for fname, text in self.files().items():
                    write_synced(s.tmp / fname, text)
                publish(s.tmp, s.final)
                nbytes = dir_bytes(s.final)
            except OSError as e:
                error = e
            if error is None:
                self._prune(keep=s.final)  # only once the new checkpoint is safe
        if not self._all_ok(error is None):
            self._fail(s, error)
        seconds = time.perf_counter() - s.t0
        if self.dist.is_main:
            record = {"step": s.step, "checkpoint_s": round(seconds, 3), "checkpoint_bytes": nbytes}
            if s.future is not None:
                record["checkpoint_blocking_s"] = round(s.blocking_s, 3)  # what training waited for
            self.on_saved(record)
            log.info("checkpoint %s: %.1f MB in %.2f s", s.final, nbytes / 1e6, seconds)

    def _prune(self, keep: Path) -> None:
        done = [p for _, p in complete_checkpoints(self.root) if p != keep]
        for p in done[: max(0, len(done) - (self.cfg.keep_last - 1))]:
            try:
                remove_dir(p)
            except OSError as e:  # an old checkpoint that stays is no reason to stop
                log.warning("could not delete the old checkpoint %s (checkpoint.keep_last): %s", p, e)

    def _all_ok(self, ok: bool) -> bool:
        failed = torch.tensor([0.0 if ok else 1.0], device=self.dist.device)
        return self.dist.all_reduce_sum(failed).item() == 0

    def _fail(self, s: _Save, error) -> None:
        if self.dist.is_main:
            try:
                remove_dir(s.tmp)
            except OSError:
                pass  # debris is harmless: it is never resumed from, and the next save replaces it
        previous = complete_checkpoints(self.root)
        kept = f"the previous checkpoint {previous[-1][1]} is intact" if previous else "there is no earlier checkpoint"
        if error is not None and isinstance(first_failure(error), KeyboardInterrupt):
            # DCP wraps a Ctrl-C in its own exception: it is the user's stop, not a storage fault (the CLI says
            # what is kept, exit 130)
            raise KeyboardInterrupt from error
        cause = _root_cause(error) if error is not None else "another rank failed (see its error)"
        raise CheckpointWriteError(f"could not write the checkpoint of step {s.step} to {s.final}: {cause}. The run "
                                   f"stops; {kept} (free space or fix permissions, then resume: auto)")


def _root_cause(e: BaseException) -> str:
    e = first_failure(e)
    return f"{type(e).__name__}: {e}"
