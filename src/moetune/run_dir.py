"""The run directory on disk: its layout, the lock that keeps it to one trainer, and its checkpoints.

    RUN/config.yaml          the resolved config (written once the run is known to start)
        metrics.jsonl        one JSON object per line
        adapter/             the final LoRA adapter (native format)
        checkpoints/step_000200/          complete: only a finished save is ever renamed to this name
                    step_000300.tmp/      being written (or debris of a crash): never resumed from
                    .trash-step_000100/   being deleted (renamed first, so a half-deleted one never looks complete)
        tensorboard/  data/  wandb_run_id
        .lock                the trainer that owns the directory: {"host", "pid", "started"}

Both train/ and export/ use this module; it needs no process group.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import socket
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from moetune.checkpoint_reading import DCP_INDEX, dcp_load, read_dcp_index
from moetune.errors import CheckpointError, ConfigError, RunDirInUse
from moetune.output_dir import is_writer_file

log = logging.getLogger("moetune")

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
ADAPTER = "adapter"
CHECKPOINTS = "checkpoints"
LOCK = ".lock"
TRAINER_STATE = "trainer_state.json"
METADATA = DCP_INDEX  # written last by DCP itself
STEP_RE = re.compile(r"^step_(\d{6,})$")


class RunDir:
    """Paths of one run directory (nothing is created by naming them)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    config = property(lambda self: self.path / CONFIG)
    metrics = property(lambda self: self.path / METRICS)
    adapter = property(lambda self: self.path / ADAPTER)
    checkpoints = property(lambda self: self.path / CHECKPOINTS)
    tensorboard = property(lambda self: self.path / "tensorboard")
    data = property(lambda self: self.path / "data")
    lock = property(lambda self: self.path / LOCK)

    def holds_a_run(self) -> bool:
        """Whether an earlier run left anything here besides the lock (and the demo data, which is regenerated)."""
        return self.path.is_dir() and any(p.name not in (LOCK, "data") for p in self.path.iterdir())


# ------------------------------------------------------------------------------------------ the lock
class RunLock:
    """One trainer per run directory: an exclusive flock on RUN/.lock, held while the process lives (the kernel
    drops it when the process dies, however it dies), with the holder's host and pid in the file for the message.
    A .lock file whose flock is free is stale: a trainer that was killed. It is named in the log and taken over."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK
        self._fd: int | None = None
        self.created_dir = False  # this lock created the run directory (a refused start removes it again)

    def acquire(self) -> "RunLock":
        # A folder that is plainly no run (a project folder with the run's name) is refused before the lock file
        # is written into it and before minutes of data and model work; one that mixes a run's files with others
        # may still be resumed, and is refused only where a new run would move it aside.
        if self.run_dir.is_dir() and not any((self.run_dir / name).exists() for name in RUN_SIGNATURE):
            refuse_foreign(self.run_dir)
        try:
            self.created_dir = not self.run_dir.exists()
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"run directory {self.run_dir}: cannot create it or write in it ({e.strerror}); "
                              "check run.output_dir and its permissions") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError(f"{self.path}: cannot lock the run directory ({e.strerror})") from None
            raise RunDirInUse(f"run directory {self.run_dir} is in use by another trainer ({_describe(holder)}); "
                              "wait for it or stop it, or train under another run.name") from None
        previous = _read_holder(fd)
        if previous:
            log.warning("run directory %s: taking over the stale lock of a trainer that is gone (%s)", self.run_dir,
                        _describe(previous))
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)  # an empty lock file is not stale: nobody is named as gone
        except OSError:
            pass
        os.close(self._fd)  # closing drops the flock
        self._fd = None

    def abandon_created_dir(self) -> None:
        """A start that was refused: remove the run directory again if this lock created it and it holds nothing
        else, so that a refused command leaves no trace."""
        self.release()
        if self.created_dir:
            try:
                self.path.unlink(missing_ok=True)
                self.run_dir.rmdir()
            except OSError:
                pass


def _read_holder(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0)
        return json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
        return {"unreadable": True}


def _describe(holder: dict) -> str:
    if not holder:
        return "its host and pid are not recorded"
    if holder.get("unreadable"):
        return "its lock file is unreadable"
    return f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started')}"


# what a run writes into its directory (trackers: tensorboard/, wandb/ and its id; export: base/)
RUN_ENTRIES = frozenset({CONFIG, METRICS, ADAPTER, CHECKPOINTS, LOCK, "tensorboard", "data", "wandb", "wandb_run_id",
                         "base"})


# the files only a run writes; a folder with none of them holds no run
RUN_SIGNATURE = (CONFIG, METRICS, CHECKPOINTS, ADAPTER)
DEMO_DATA_FILES = {"train.jsonl", "eval.jsonl"}  # what the demo writes into RUN/data/


def foreign_entries(run_dir: Path) -> list[str]:
    """What in ``run_dir`` a moetune run did not write: names a run never writes, a config.yaml that is not a
    run's resolved config (a project folder's own config.yaml, say), a data/ holding more than the demo's files."""
    foreign = sorted(p.name for p in run_dir.iterdir() if p.name not in RUN_ENTRIES
                     and not any(is_writer_file(p.name, folder) for folder in (ADAPTER, "base")))
    config = run_dir / CONFIG
    if config.exists() and not _is_run_config(config):
        foreign.insert(0, f"{CONFIG} (not a moetune run's config)")
    data = run_dir / "data"
    if data.exists() and not (data.is_dir() and {p.name for p in data.iterdir()} <= DEMO_DATA_FILES):
        foreign.insert(0, "data/ (not the demo's data)")
    return foreign


def refuse_foreign(run_dir: Path) -> None:
    """A ConfigError when ``run_dir`` holds what a moetune run does not write (see foreign_entries)."""
    foreign = foreign_entries(run_dir)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ConfigError(f"run directory {run_dir} exists and holds what a moetune run does not write ({shown}): "
                          "nothing is moved or written there; choose another run.name or run.output_dir")


def _is_run_config(path: Path) -> bool:
    import yaml

    try:
        cfg = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(cfg, dict) and {"run", "model", "data", "train"} <= cfg.keys()


def move_earlier_run_aside(run_dir: Path) -> Path | None:
    """A new run (nothing to resume) where an earlier run left its files: move all of them (except the lock) into
    a sibling RUN.earlier-<time>/, so that nothing of the earlier run is overwritten or mixed into the new one.

    Only a moetune run is moved: a directory holding anything a run does not write (a project folder that happens
    to have the run's name) is refused with a ConfigError, and nothing is moved. A run directory that is a symlink
    (to another file system, say) has its earlier run moved beside the directory it points to, so every move is a
    rename within one file system; a move that fails halfway is undone."""
    rd = RunDir(run_dir)
    if not rd.holds_a_run():
        return None
    refuse_foreign(run_dir)
    real = Path(os.path.realpath(run_dir))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved, dest = [], None
    try:
        for i in range(1000):  # mkdir, not exists(): two trainers starting at once cannot pick the same name
            try:
                dest = real.with_name(f"{real.name}.earlier-{stamp}-{i}")
                dest.mkdir()
                break
            except FileExistsError:
                dest = None
        if dest is None:
            raise FileExistsError(errno.EEXIST, "no free name", str(real.with_name(f"{real.name}.earlier-{stamp}-*")))
        for p in sorted(real.iterdir()):
            if p.name != LOCK:
                os.rename(p, dest / p.name)
                moved.append(p.name)
    except OSError as e:
        for name in reversed(moved):
            os.rename(dest / name, real / name)
        if dest is not None:
            dest.rmdir()
        raise ConfigError(f"run directory {run_dir}: cannot move the earlier run aside ({e.strerror or e}); nothing "
                          "is moved; choose another run.name, or resume it") from None
    return dest


# ------------------------------------------------------------------------------------------ checkpoints
def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    found = []
    if root.is_dir():
        for p in root.iterdir():
            m = STEP_RE.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
    return sorted(found)


def missing_files(path: Path) -> list[str]:
    return [name for name in (METADATA, TRAINER_STATE) if not (path / name).is_file()]


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints under root, oldest first; .tmp and .trash debris is skipped."""
    return [(s, p) for s, p in _step_dirs(root) if not missing_files(p)]


def damaged_checkpoints(root: Path) -> list[tuple[Path, list[str]]]:
    """step_N directories (a published name, so once complete) that lost a file since: (path, missing files)."""
    return [(p, miss) for _, p in _step_dirs(root) if (miss := missing_files(p))]


def latest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def verify_checkpoint(path: Path) -> None:
    """Refuse, by file name, a checkpoint whose index or shard files are missing or shorter than the index
    says. Cheap (metadata and file sizes only) and worth it: DCP itself would fail deep in a reader thread."""
    if not Path(path).is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    for name in missing_files(Path(path)):
        raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing{_earlier(path)}")
    try:
        md = read_dcp_index(Path(path) / METADATA)
    except CheckpointError as e:
        raise CheckpointError(f"{e}{_earlier(path)}") from None
    needed: dict[str, int] = {}
    for info in md.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for fname, size in sorted(needed.items()):
        f = Path(path) / fname
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is damaged: shard file {fname} is missing{_earlier(path)}")
        if (have := f.stat().st_size) < size:
            raise CheckpointError(f"checkpoint {path} is damaged: shard file {fname} is truncated "
                                  f"({have} bytes, the index needs {size}){_earlier(path)}")


def _earlier(path: Path) -> str:
    """What to do about a damaged checkpoint: the newest complete one before it, if its run has one."""
    m = STEP_RE.match(Path(path).name)
    older = [p for s, p in complete_checkpoints(Path(path).parent) if m and s < int(m.group(1))]
    return f"; to go on from the newest complete one before it: resume: {older[-1]}" if older else ""


def read_trainer_state(path: Path) -> dict:
    f = Path(path) / TRAINER_STATE
    try:
        state = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f}: cannot read the checkpoint's trainer state ({e}); the checkpoint is damaged"
                              + (_earlier(path) or ": resume from an earlier one (resume: PATH)")) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{f}: not a JSON object; the checkpoint is damaged")
    return state


def load_model_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model tensors of a checkpoint, whole and on CPU, without a process group (export, tests): the
    trainable LoRA tensors of a LoRA run, every weight of a full fine-tuning run."""
    path = Path(path)
    verify_checkpoint(path)
    md = read_dcp_index(path / METADATA)
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    try:
        dcp_load(state, path)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - DCP wraps what a reader thread raised
        raise CheckpointError(f"checkpoint {path} is damaged: {type(e).__name__}: {str(e)[:300]}") from None
    return {k.removeprefix("model."): v for k, v in state.items()}
