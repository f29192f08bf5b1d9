"""The checkpoint directory on disk: names, completeness, atomic renames, and the checks made before a resume.

    RUN/checkpoints/step_000200/        complete: only a finished save is ever renamed to this name
                    step_000300.tmp/    being written (or debris of a crash): never resumed from
                    .trash-step_000100/ being deleted (renamed first, so a half-deleted one never looks complete)

Everything here is plain file work and runs without a process group (auto-resume, `moetune export`, tests).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
import warnings
from pathlib import Path

import torch
import yaml

from moetune.model.hf_io import CheckpointError

log = logging.getLogger("moetune")

STEP_RE = re.compile(r"^step_(\d{6,})$")
TRAINER_STATE = "trainer_state.json"
CONFIG = "config.yaml"
METADATA = ".metadata"  # DCP's index; written last by DCP itself
# The sections that decide what is trained and its shapes: a resume that changes them is refused.
FROZEN_SECTIONS = ("model", "finetune", "lora")


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints under root, oldest first; .tmp and .trash debris is skipped."""
    found = []
    if root.is_dir():
        for p in root.iterdir():
            m = STEP_RE.match(p.name)
            if m and p.is_dir() and (p / METADATA).is_file() and (p / TRAINER_STATE).is_file():
                found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def resolve_resume(spec: str, run_dir: Path) -> Path | None:
    """`resume:` → the checkpoint directory to load, or None to start from scratch."""
    if spec == "none":
        return None
    if spec == "auto":
        return latest_checkpoint(run_dir / "checkpoints")
    path = Path(spec)
    if path.name.endswith(".tmp") or path.name.startswith(".trash"):
        raise CheckpointError(f"resume: {path} is an unfinished checkpoint (a save that never completed)")
    if (path / TRAINER_STATE).is_file() or (path / METADATA).is_file():
        return path
    for root in (path / "checkpoints", path):  # a run directory, or its checkpoints/ folder
        if (latest := latest_checkpoint(root)) is not None:
            return latest
    raise CheckpointError(f"resume: {path} is neither a checkpoint directory (no {TRAINER_STATE}) "
                          "nor a run directory with complete checkpoints")


def verify_checkpoint(path: Path) -> None:
    """Refuse, by file name, a checkpoint whose index or shard files are missing or shorter than the index
    says. Cheap (metadata and file sizes only) and worth it: DCP itself would fail deep in a reader thread."""
    from torch.distributed.checkpoint import FileSystemReader

    for name in (METADATA, TRAINER_STATE):
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
    try:
        md = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a truncated pickle raises anything from EOFError to UnpicklingError
        raise CheckpointError(f"checkpoint {path} is damaged: cannot read {METADATA} ({type(e).__name__}: {e})")
    needed: dict[str, int] = {}
    for info in md.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for fname, size in sorted(needed.items()):
        f = path / fname
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is damaged: shard file {fname} is missing")
        if (have := f.stat().st_size) < size:
            raise CheckpointError(f"checkpoint {path} is damaged: shard file {fname} is truncated "
                                  f"({have} bytes, the index needs {size})")


def _flatten(d, prefix="") -> dict:
    out = {}
    for k, v in (d or {}).items():
        key = f"{prefix}{k}"
        out.update(_flatten(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def config_changes(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """Differences between the checkpoint's config.yaml and the current config, as 'key: old → new':
    (refused: model / finetune / lora, the last only when LoRA is trained; allowed: everything else)."""
    lora_matters = "lora" in {(saved.get("finetune") or {}).get("mode"), (current.get("finetune") or {}).get("mode")}
    refused, allowed = [], []
    for section in sorted(set(saved) | set(current)):
        if section == "resume" or (section == "lora" and not lora_matters):
            continue
        a, b = _flatten(saved.get(section), section + "."), _flatten(current.get(section), section + ".")
        for key in sorted(set(a) | set(b)):
            if a.get(key, "<unset>") != b.get(key, "<unset>"):
                line = f"{key}: {a.get(key, '<unset>')!r} → {b.get(key, '<unset>')!r}"
                (refused if section in FROZEN_SECTIONS else allowed).append(line)
    return refused, allowed


def check_config(path: Path, cfg, saved_hash: str | None) -> list[str]:
    """Refuse a resume that changes the model, what is trained or its shapes; return the allowed changes."""
    from moetune.config import config_hash

    cfg_file = path / CONFIG
    if not cfg_file.is_file():  # older or hand-made checkpoint: only the hash can be compared
        if saved_hash and saved_hash != config_hash(cfg):
            raise CheckpointError(f"cannot resume from {path}: the model/finetune/lora settings differ from the "
                                  f"checkpoint's (config hash {saved_hash} ≠ {config_hash(cfg)})")
        return []
    refused, allowed = config_changes(yaml.safe_load(cfg_file.read_text()) or {}, cfg.model_dump(mode="json"))
    if refused:
        raise CheckpointError(
            f"cannot resume from {path}: the config changes what is trained ({'; '.join(refused)}). "
            "Resume with the checkpoint's values, or start a new run (another run.name, or resume: none)")
    return allowed


# ------------------------------------------------------------------------------------------ atomic file work
def write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable: the directory entry is data too."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_dir(path: Path) -> None:
    """Rename out of the way, then delete: a crash mid-delete leaves .trash debris, never a partial step_X."""
    if not path.exists():
        return
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def publish(tmp: Path, final: Path) -> None:
    """tmp → final in one rename, after everything in tmp is on disk; an existing final (the same step saved
    again after resuming from an earlier checkpoint) is replaced."""
    fsync_dir(tmp)
    remove_dir(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def set_aside(root: Path) -> Path | None:
    """resume: none where an earlier run left checkpoints: keep them, but out of auto-resume's way (it would
    otherwise take an old step_N over the new run's smaller ones after a crash)."""
    if not complete_checkpoints(root):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = next(d for i in range(1000) if not (d := root.with_name(f"checkpoints.earlier-{stamp}-{i}")).exists())
    os.replace(root, dest)
    return dest


def remove_debris(root: Path) -> None:
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and (p.name.endswith(".tmp") or p.name.startswith(".trash-")):
                log.info("removing unfinished checkpoint %s", p)
                shutil.rmtree(p, ignore_errors=True)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# ------------------------------------------------------------------------------------------ reading weights
def load_model_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model tensors of a checkpoint, whole and on CPU, without a process group (export, tests): the
    trainable LoRA tensors of a LoRA run, every weight of a full fine-tuning run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    verify_checkpoint(path)
    md = FileSystemReader(str(path)).read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return {k.removeprefix("model."): v for k, v in state.items()}
