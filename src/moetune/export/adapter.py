"""Export a moetune adapter for PEFT (transformers) or vLLM.

    export_adapter("runs/x/adapter", "out/peft", format="peft")   # PeftModel.from_pretrained(Glm4MoeForCausalLM, out)
    export_adapter("runs/x", "out/vllm", format="vllm")           # vllm serve ... --lora-modules x=out/vllm

Layouts: peft_layout.py (PEFT's fused-expert `target_parameters` layout) and vllm_layout.py (per-expert).
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError

from moetune.errors import ExportError, OutputError  # noqa: F401  (ExportError re-exported)
from moetune.export.verify import verify_peft_adapter, verify_vllm_adapter
from moetune.model.adapter_io import (ADAPTER_FILES, ADAPTER_FORMAT, read_adapter, read_adapter_config, save_adapter,
                                      write_adapter_files)
from moetune.model.config import ModelConfig
from moetune.output_dir import atomic_output_dir, check_replaceable
from moetune.run_dir import latest_checkpoint, load_model_state

FORMATS = ("peft", "vllm")


def resolve_adapter_dir(path: str) -> str:
    """A moetune adapter dir from what a user may pass: the adapter dir itself, a run dir holding `adapter/`,
    a training checkpoint (DCP, `checkpoints/step_XXXXXX`), or a run dir with checkpoints but no adapter yet
    (a run still going or stopped early: its newest complete checkpoint)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ExportError(f"{path}: no such directory (no moetune adapter, run or checkpoint there)")
    if os.path.isfile(os.path.join(path, ".metadata")):
        return adapter_from_checkpoint(path)
    if not os.path.isdir(os.path.join(path, "adapter")):
        newest = latest_checkpoint(Path(path) / "checkpoints") if os.path.isdir(os.path.join(path, "checkpoints")) else None
        if newest is not None:
            return adapter_from_checkpoint(str(newest))
    for cand in (path, os.path.join(path, "adapter")):
        cfg = os.path.join(cand, "adapter_config.json")
        if os.path.isfile(cfg):
            try:
                with open(cfg) as f:
                    meta = json.load(f)
                fmt = meta.get("format")
            except (OSError, ValueError, AttributeError) as e:
                raise ExportError(f"{cfg}: cannot read it ({e})") from None
            if fmt == ADAPTER_FORMAT:
                return cand
            if cand == path:
                what = "a PEFT or vLLM adapter, already exported" if "peft_type" in meta else f"format {fmt!r}"
                raise ExportError(f"{cfg}: not a moetune adapter ({what}); pass the run directory (runs/NAME) or "
                                  "its adapter/")
    raise ExportError(f"{path}: no moetune adapter here (expected adapter_config.json with format "
                      f"{ADAPTER_FORMAT!r}, or a run directory containing adapter/)")


def adapter_from_checkpoint(ckpt: str) -> str:
    """Write the LoRA tensors of a DCP training checkpoint as a native adapter (in a temporary directory), with
    the LoRA settings of the config.yaml saved beside them, and return that directory."""
    from moetune.config import load_config
    from moetune.model.random_base import base_recipe

    if not os.path.isfile(os.path.join(ckpt, "config.yaml")):
        raise ExportError(f"{ckpt}: a DCP directory without config.yaml is not a complete moetune checkpoint")
    cfg = load_config(os.path.join(ckpt, "config.yaml"))
    if cfg.finetune.mode != "lora":
        raise ExportError(f"{ckpt} is a full fine-tuning checkpoint: it has no adapter to export")
    state = {k: v.float() for k, v in load_model_state(ckpt).items() if ".lora" in k}
    c = cfg.lora
    out = tempfile.mkdtemp(prefix="moetune-adapter-")
    meta = dict(rank=c.rank, alpha=c.alpha, dropout=c.dropout, rslora=c.rslora, targets=list(c.targets))
    if cfg.model.quantize:
        meta["base_quantize"] = cfg.model.quantize
    if (recipe := base_recipe(cfg, _trained_on(ckpt))) is not None:
        meta["base_init"] = recipe
    save_adapter(state, out, meta, base_model=cfg.model.path)
    return out


def _trained_on(ckpt: str) -> str:
    """The device type a checkpoint was trained on (checkpoints before it was recorded: cpu)."""
    try:
        with open(os.path.join(ckpt, "trainer_state.json")) as f:
            return json.load(f).get("device", "cpu")
    except (OSError, ValueError):
        return "cpu"


def _base_config(base: str | None):
    """The base's ModelConfig when its config.json is on this machine (the adapter is then checked against it)."""
    if base and os.path.isfile(os.path.join(base, "config.json")):
        try:
            return ModelConfig.from_json(base)
        except (OSError, ValueError) as e:
            raise ExportError(f"{base}: cannot read the base model's config.json ({e})") from None
    return None


def check_out_dir(out_dir: str | os.PathLike, allowed: tuple[str, ...] = ()) -> None:
    """An export's --out must be new, empty, or hold only files named in `allowed`: nothing of the user's is ever
    overwritten or mixed into an export (checked again, under the writer's lock, when it is written)."""
    check_replaceable(out_dir, allowed, label=f"--out {out_dir}")


# what a full disk, a quota, a read-only or foreign folder raise: the user's to fix, not a bug
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG)


@contextmanager
def output_errors(out_dir: str | os.PathLike, what: str = "the export"):
    """An OSError of writing (disk full, permissions) inside: an OutputError naming the file, or else `out_dir`."""
    try:
        yield
    except OSError as e:
        if e.errno not in _WRITE_ERRNOS:
            raise
        raise OutputError(f"{e.filename or out_dir}: cannot write {what} ({e.strerror})") from None


def convert_adapter(state: dict, meta: dict, format: str = "peft", base_model: str | None = None) -> tuple[dict, dict]:
    """(tensors, adapter_config) of `format` for our LoRA `state` and its meta, without touching the disk."""
    if format == "peft":
        from moetune.export.peft_layout import to_peft_state_dict

        return to_peft_state_dict(state, meta, base_model)
    if format == "vllm":
        from moetune.export.vllm_layout import to_vllm_state_dict

        return to_vllm_state_dict(state, meta, base_model)
    raise ExportError(f"unknown adapter format {format!r}; choose from {list(FORMATS)}")


def export_adapter(adapter_dir_or_checkpoint: str, out_dir: str, format: str = "peft",
                   base_model_path: str | None = None, verify: bool = False) -> dict:
    """Write the adapter at `adapter_dir_or_checkpoint` (adapter dir or run dir) to `out_dir` in `format`.

    base_model_path goes into `base_model_name_or_path` (default: the base the adapter was trained on) and is
    what `verify` loads: it reloads the export with transformers/PEFT and compares logits to moetune's model
    with the native adapter (whole models in fp32 on the CPU: meant for proxies and small models).
    Returns {"out_dir", "format", "tensors", "verify": {...} or None}.
    """
    if format not in FORMATS:
        raise ExportError(f"unknown adapter format {format!r}; choose from {list(FORMATS)}")
    src = resolve_adapter_dir(adapter_dir_or_checkpoint)
    meta = read_adapter_config(src)
    base = base_model_path or meta.get("base_model")
    if verify and not base:
        raise ExportError("verify needs the base model: pass base_model_path (the adapter names none)")
    state, meta = read_adapter(src, _base_config(base))  # shapes, ranks, finiteness: before anything is written
    if meta.get("dropout"):
        # Both targets apply no dropout at inference; PEFT's expert wrapper even refuses a nonzero value.
        meta = dict(meta, dropout=0.0)
    try:
        tensors, config = convert_adapter(state, meta, format, base)
    except ValueError as e:
        raise ExportError(f"{src}: cannot export as {format}: {e}") from None
    report = {"out_dir": os.fspath(out_dir), "format": format, "tensors": len(tensors), "verify": None}
    with output_errors(out_dir), atomic_output_dir(out_dir, ADAPTER_FILES, label=f"--out {out_dir}") as tmp:
        try:
            write_adapter_files(tmp, tensors, config)
        except SafetensorError as e:  # safetensors' own error for a failed write (disk full); OSError: output_errors
            raise OutputError(f"{out_dir}: cannot write the export ({e})") from None
        if verify:
            fn = verify_peft_adapter if format == "peft" else verify_vllm_adapter
            report["verify"] = fn(src, tmp, base)  # a failed verify raises: the export is not kept
    return report
