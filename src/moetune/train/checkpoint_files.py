"""Checkpoint file work of the trainer: atomic writes and renames, pruning, and the checks made before a resume
(layout, listing and completeness are run_dir.py's).

Everything here is plain file work and runs without a process group (auto-resume, `moetune export`, tests).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from moetune.config import config_hash, dump_hash
from moetune.errors import CheckpointError, ConfigError
from moetune.run_dir import (CONFIG, METADATA, TRAINER_STATE, damaged_checkpoints, latest_checkpoint, read_trainer_state,
                             verify_checkpoint)

log = logging.getLogger("moetune")

# The sections that decide what is trained and its shapes: a resume that changes them is refused.
FROZEN_SECTIONS = ("model", "finetune", "lora")


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
    cfg_file = path / CONFIG
    if not cfg_file.is_file():  # older or hand-made checkpoint: only the hash can be compared
        if saved_hash and saved_hash != config_hash(cfg):
            raise CheckpointError(f"cannot resume from {path}: the model/finetune/lora settings differ from the "
                                  f"checkpoint's (config hash {saved_hash} ≠ {config_hash(cfg)})")
        return []
    try:
        saved = yaml.safe_load(cfg_file.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise CheckpointError(f"{cfg_file}: cannot read the checkpoint's config ({type(e).__name__}); the "
                              "checkpoint is damaged: resume from an earlier one (resume: PATH)") from None
    # A file cut at a line boundary still parses: its hash, written at the same moment, tells it is incomplete
    if not isinstance(saved, dict) or (saved_hash and _hash_or_none(saved) != saved_hash):
        raise CheckpointError(f"{cfg_file}: damaged (it does not match the config hash in {TRAINER_STATE}); "
                              "resume from an earlier checkpoint (resume: PATH)")
    refused, allowed = config_changes(saved, cfg.model_dump(mode="json"))
    if refused:
        raise CheckpointError(
            f"cannot resume from {path}: the config changes what is trained ({'; '.join(refused)}). "
            "Resume with the checkpoint's values, or start a new run (another run.name, or resume: none)")
    return allowed


def _hash_or_none(dump: dict) -> str | None:
    try:
        return dump_hash(dump)
    except ConfigError:  # a section is missing: the file is cut short
        return None


@dataclass
class ResumePlan:
    path: Path
    trainer_state: dict
    allowed_changes: list[str]


def plan_resume(cfg, world_size: int, dp_size: int) -> ResumePlan | None:
    """Everything about a resume that files can tell, before anything is built or written: which checkpoint, that
    it is complete and undamaged, and that the config may continue it. None: start from scratch."""
    if cfg.resume == "auto":
        for p, missing in damaged_checkpoints(cfg.run_dir / "checkpoints"):
            log.warning("resume: auto skips %s: %s missing (a damaged checkpoint)", p, " and ".join(missing))
    path = resolve_resume(cfg.resume, cfg.run_dir)
    if path is None:
        if cfg.resume == "auto":
            log.info("resume: auto found no checkpoint in %s: starting from scratch", cfg.run_dir / "checkpoints")
        return None
    verify_checkpoint(path)
    saved = read_trainer_state(path)
    allowed = check_config(path, cfg, saved.get("config_hash"))
    plan = ResumePlan(path, saved, allowed)
    global_batch = dp_size * cfg.train.micro_batch_size * cfg.train.grad_accum
    if saved.get("global_batch") not in (None, global_batch):
        log.warning("resume: the checkpoint's run took %d sequences per step, this one takes %d (%d data-parallel "
                    "ranks × micro_batch_size %d × grad_accum %d): the optimizer sees a different batch; set "
                    "train.grad_accum (or micro_batch_size) to keep %d", saved["global_batch"], global_batch, dp_size,
                    cfg.train.micro_batch_size, cfg.train.grad_accum, saved["global_batch"])
    if saved.get("world_size") not in (None, world_size):
        log.info("resume: checkpoint written by %s processes, loaded by %d (DCP reshards; ranks the checkpoint's run "
                 "did not have keep their seeded RNG)", saved.get("world_size"), world_size)
    return plan


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


def remove_debris(root: Path) -> None:
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and (p.name.endswith(".tmp") or p.name.startswith(".trash-")):
                log.info("removing unfinished checkpoint %s", p)
                shutil.rmtree(p, ignore_errors=True)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
