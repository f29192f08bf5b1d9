"""Checkpoints: save every N steps and at the end, resume exactly, stop gracefully on a signal.

A checkpoint is what a run needs to continue as if it had never stopped, written with
torch.distributed.checkpoint (DCP) so that any number of processes can load it (DCP reshards):

    model      the trainable parameters (LoRA only, when the base is frozen; everything in full fine-tuning)
    optim      AdamW moments and step counts, keyed by parameter name
    scheduler  the schedule's position;  loader  the data position (epoch, packs served)
    rng        each rank's RNG states (torch CPU/CUDA, python, numpy), under rng.rank{R}

plus trainer_state.json (step, tokens seen, config hash, moetune version) and the run's config.yaml, which
the resume checks compare. Saves are atomic: written to step_XXXXXX.tmp, fsynced, renamed
(checkpoint_files.py). The final LoRA adapter goes to RUN/adapter/ in the native format, as before.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint import CheckpointException

import moetune
from moetune.config import config_hash, config_to_yaml
from moetune.model.adapter_io import gather_lora_state, save_adapter
from moetune.errors import CheckpointError, CheckpointWriteError, NumericalFault  # noqa: F401
from moetune.train.checkpoint_files import (CONFIG, TRAINER_STATE, check_config, complete_checkpoints, dir_bytes,
                                            publish, remove_debris, remove_dir, resolve_resume, set_aside,
                                            step_dir_name, verify_checkpoint, write_synced)

log = logging.getLogger("moetune")
# DCP warns on every single-process call that it is single-process, from async_save's thread too (where a
# catch_warnings() around the call cannot reach): filter that one message, process-wide.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

# TrainState fields a resume restores (bad_streak is not one: a resumed run gets its full allowance again).
RESTORED_FIELDS = ("step", "tokens", "best_eval_loss", "eval_losses", "skipped_steps")
# Test hook, "step_000004:30": rank 0 sleeps 30 s before publishing that checkpoint, so that a test can kill
# or signal the run at a known point of a save.
PAUSE_ENV = "MOETUNE_TEST_PAUSE_BEFORE_RENAME"


_ERRORS = (Exception, CheckpointException)  # DCP's collective error derives from BaseException, not Exception


@dataclass
class _Save:
    step: int
    tmp: Path
    final: Path
    trainer_state: dict
    t0: float
    future: object = None  # async saves: DCP's future
    blocking_s: float = 0.0


class Checkpointer:
    def __init__(self, cfg, dist, model, optimizer, scheduler, loader):
        self.cfg, self.dist, self.model = cfg, dist, model
        self.optimizer, self.scheduler, self.loader = optimizer, scheduler, loader
        self.root = cfg.run_dir / "checkpoints"
        self.full = cfg.finetune.mode == "full"
        self.metrics = None  # the loop's MetricsWriter, once metrics.jsonl is open
        self._pending: _Save | None = None  # an async save still being written
        self._saved_step: int | None = None
        self._signal: int | None = None  # received by this rank
        self._stop = False  # agreed by all ranks
        # Async writes run collectives from a background thread: they get their own gloo group so that they
        # never interleave with the training collectives of the main thread.
        self._async_group = None
        if cfg.checkpoint.async_save and dist.initialized:
            import torch.distributed as tdist

            self._async_group = tdist.new_group(backend="gloo")
        self._old_handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    # ------------------------------------------------------------------------------------------ resume
    def resume(self, state):
        path = resolve_resume(self.cfg.resume, self.cfg.run_dir)
        if self.dist.is_main:
            remove_debris(self.root)  # unfinished saves of an earlier process: never resumed from
            if self.cfg.resume == "none" and (earlier := set_aside(self.root)):
                log.warning("resume: none: the checkpoints of an earlier run in this directory are moved to %s",
                            earlier)
            elif path is None and self.cfg.resume == "auto":
                log.info("resume: auto found no checkpoint in %s: starting from scratch", self.root)
        if path is None:
            return state
        verify_checkpoint(path)
        saved = json.loads((path / TRAINER_STATE).read_text())
        allowed = check_config(path, self.cfg, saved.get("config_hash"))
        if self.dist.is_main:
            for line in allowed:
                log.info("resume: changed since the checkpoint (applied): %s", line)
            if saved.get("moetune_version") != moetune.__version__:
                log.warning("resume: checkpoint written by moetune %s, this is %s",
                            saved.get("moetune_version"), moetune.__version__)
        self._load(path)
        for name in RESTORED_FIELDS:
            if name in saved:
                setattr(state, name, saved[name])
        state.eval_losses = [tuple(x) for x in state.eval_losses]
        if self.dist.is_main:
            _truncate_metrics(self.cfg.run_dir / "metrics.jsonl", state.step)
            if saved.get("world_size") != self.dist.world_size:
                log.info("resume: checkpoint written by %s processes, loaded by %d (DCP reshards; ranks the "
                         "checkpoint's run did not have keep their seeded RNG)", saved.get("world_size"),
                         self.dist.world_size)
            log.info("resumed from %s at step %d", path, state.step)
        self._saved_step = state.step
        return state

    def _load(self, path: Path) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        import torch.distributed.checkpoint as dcp

        rng_key = f"rank{self.dist.rank}"
        has_rng = f"rng.{rng_key}" in FileSystemReader(str(path)).read_metadata().state_dict_metadata
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        sd = self._state_dict(rng=has_rng)  # the tensors DCP fills in place; the bytes entries it replaces
        try:
            dcp.load(sd, storage_reader=FileSystemReader(str(path)), no_dist=not self.dist.initialized)
        except _ERRORS as e:
            raise CheckpointError(f"cannot load checkpoint {path}: {_root_cause(e)}") from e
        set_model_state_dict(self.model, sd["model"], options=_model_options(self.full, loading=True))
        set_optimizer_state_dict(self.model, self.optimizer, sd["optim"])
        self.scheduler.load_state_dict(pickle.loads(sd["scheduler"]))
        self.loader.load_state_dict(pickle.loads(sd["loader"]))
        self._apply_config_hyperparameters(hyper)
        if has_rng:  # a rank the checkpoint's run did not have keeps its seeded state
            _set_rng_state(pickle.loads(sd["rng"][rng_key]), self.dist.device)

    def _apply_config_hyperparameters(self, hyper: list[dict]) -> None:
        """Hyperparameters come from the current config (a changed lr or schedule is allowed on resume);
        the state (moments, step counts, position in the schedule) from the checkpoint. Unchanged, this
        recomputes bit for bit what the checkpoint holds."""
        sched = self.scheduler
        for group, h in zip(self.optimizer.param_groups, hyper):
            group.update({k: v for k, v in h.items() if k != "lr"})
        sched.base_lrs = [g["initial_lr"] for g in self.optimizer.param_groups]
        lrs = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        sched._last_lr = lrs

    # ------------------------------------------------------------------------------------------ save
    def maybe_save(self, state, last: bool = False) -> None:
        """Called by every rank after every step: agree on a stop, finish an async save, save when due."""
        busy = self._pending is not None and not self._pending.future.done()
        flags = torch.tensor([float(self._signal is not None), float(busy)], device=self.dist.device)
        self.dist.all_reduce_sum(flags)  # one tiny all-reduce per step: all ranks stop at the same step
        self._stop = self._stop or bool(flags[0] > 0)
        if self._pending is not None and flags[1] == 0:
            self._finish_pending()
        every = self.cfg.checkpoint.every
        if (last or self._stop or (every and state.step % every == 0)) and self._saved_step != state.step:
            self.save(state)
        if self._stop and self.dist.is_main:
            log.warning("stopping at step %d on %s; resume with resume: auto", state.step,
                        signal.Signals(self._signal).name if self._signal else "another rank's signal")

    def stop_requested(self) -> bool:
        return self._stop

    def save(self, state) -> Path:
        """Write a checkpoint of `state` (all ranks). Synchronous unless checkpoint.async_save."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        if self._pending is not None:
            self._finish_pending()  # one write at a time
        name = step_dir_name(state.step)
        s = _Save(state.step, self.root / f"{name}.tmp", self.root / name, self._trainer_state(state),
                  time.perf_counter())
        if self.dist.is_main:  # before DCP's first collective: no rank writes into tmp before this
            self.root.mkdir(parents=True, exist_ok=True)
            remove_dir(s.tmp)
        writer = FileSystemWriter(str(s.tmp), sync_files=True)  # fsyncs every file it writes
        no_dist = not self.dist.initialized
        try:
            if self.cfg.checkpoint.async_save:
                # stages a CPU copy first, so the optimizer may update the weights while the copy is written
                s.future = dcp.async_save(self._state_dict(), storage_writer=writer,
                                          process_group=self._async_group, no_dist=no_dist)
            else:
                dcp.save(self._state_dict(), storage_writer=writer, no_dist=no_dist)
        except _ERRORS as e:
            self._fail(s, e)
        s.blocking_s = time.perf_counter() - s.t0
        self._saved_step = state.step
        if s.future is not None:
            self._pending = s
        else:
            self._publish(s)
        return s.final

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
        """Rank 0 adds trainer_state.json and config.yaml and renames; every rank learns whether it worked."""
        error, nbytes = None, 0
        if self.dist.is_main:
            try:
                write_synced(s.tmp / TRAINER_STATE, json.dumps(s.trainer_state, indent=2))
                write_synced(s.tmp / CONFIG, config_to_yaml(self.cfg))
                _test_pause(s.final.name)
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
            if self.metrics is not None:
                self.metrics.write(record)
            log.info("checkpoint %s: %.1f MB in %.2f s", s.final, nbytes / 1e6, seconds)

    def _prune(self, keep: Path) -> None:
        done = [p for _, p in complete_checkpoints(self.root) if p != keep]
        for p in done[: max(0, len(done) - (self.cfg.checkpoint.keep_last - 1))]:
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
        cause = _root_cause(error) if error is not None else "another rank failed (see its error)"
        self.close()
        raise CheckpointWriteError(f"could not write the checkpoint of step {s.step} to {s.final}: {cause}. The run "
                                    f"stops; {kept} (free space or fix permissions, then resume: auto)")

    def _state_dict(self, rng: bool = True) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        model = get_model_state_dict(self.model, options=_model_options(self.full))
        if not self.full:  # the frozen base (and its buffers) is reloaded from the HF checkpoint, not saved
            trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
            model = {k: v for k, v in model.items() if k in trainable}
        sd = {"model": model, "optim": get_optimizer_state_dict(self.model, self.optimizer),
              # small python state as pickled bytes: one opaque entry each, whatever keys torch adds over time
              "scheduler": pickle.dumps(self.scheduler.state_dict()),
              "loader": pickle.dumps(self.loader.state_dict())}
        if rng:
            sd["rng"] = {f"rank{self.dist.rank}": pickle.dumps(_rng_state(self.dist.device))}
        return sd

    def _trainer_state(self, state) -> dict:
        return {**{k: getattr(state, k) for k in RESTORED_FIELDS},
                "config_hash": config_hash(self.cfg), "moetune_version": moetune.__version__,
                "torch_version": torch.__version__, "finetune_mode": self.cfg.finetune.mode,
                "world_size": self.dist.world_size, "data_position": self.loader.state_dict(),
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    # ------------------------------------------------------------------------------------------ stopping
    def _on_signal(self, signum, frame) -> None:
        if self._signal is not None:  # the second signal: exit at once, as if we had no handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._signal = signum
        print(f"moetune: {signal.Signals(signum).name}: saving a checkpoint at the end of this step, then exiting "
              "(send it again to exit at once)", file=sys.stderr, flush=True)

    def stop_on_numerical_fault(self, state) -> None:
        """Save (the weights are those of the last good step: skipped steps change nothing) and stop."""
        k = self.cfg.checkpoint.max_bad_steps
        path = self.save(state)
        if self._pending is not None:
            self._finish_pending()
        self.close()
        raise NumericalFault(
            f"stopping: {state.bad_streak} consecutive steps ({state.step - state.bad_streak + 1}-{state.step}) had a "
            f"non-finite loss or gradient norm (checkpoint.max_bad_steps: {k}). The weights of step "
            f"{state.step - state.bad_streak} are saved in {path}; resume from it (resume: auto) with a lower "
            "optim.lr or train.max_grad_norm, or look at the data of those steps")

    def finish(self, state) -> None:
        if self._pending is not None:
            self._finish_pending()
        self.close()
        if self.cfg.finetune.mode == "lora":
            lora = gather_lora_state(self.model)
            if self.dist.is_main:
                c = self.cfg.lora
                meta = dict(rank=c.rank, alpha=c.alpha, dropout=c.dropout, rslora=c.rslora, targets=list(c.targets))
                save_adapter(lora, self.cfg.run_dir / "adapter", meta, base_model=self.cfg.model.path)

    def close(self) -> None:
        """Give the signal handlers back (matters when train() runs inside a longer-lived process)."""
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers = {}


# ---------------------------------------------------------------------------------------------- helpers
def _model_options(full: bool, loading: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # LoRA: the frozen base is not part of the checkpoint, so loading must not expect it (strict=False); DCP
    # itself still fails on any requested tensor the checkpoint lacks.
    return StateDictOptions(ignore_frozen_params=not full, strict=full or not loading)


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    if "numpy" in sys.modules:  # only if something imported it: never import numpy for this
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop the records of steps after the checkpoint (a killed run logged them; the resumed run redoes them)."""
    if not path.is_file():
        return
    lines = [ln for ln in path.read_text().splitlines() if _record_step(ln) <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    write_synced(tmp, "".join(ln + "\n" for ln in lines))
    os.replace(tmp, path)


def _record_step(line: str) -> float:
    try:
        return json.loads(line).get("step", 0)
    except ValueError:  # empty, or the torn last line of a killed process
        return float("inf")


def _root_cause(e: BaseException) -> str:
    """The first rank's underlying error of a DCP CheckpointException (whose str is every rank's traceback)."""
    failures = getattr(e, "failures", None)
    if failures:
        e = next(iter(failures.values()))
        e = e[0] if isinstance(e, tuple) else e
    return f"{type(e).__name__}: {e}"


def _test_pause(name: str) -> None:
    spec = os.environ.get(PAUSE_ENV, "")
    if spec.partition(":")[0] == name:
        time.sleep(float(spec.partition(":")[2] or 60))
