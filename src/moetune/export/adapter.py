"""Export a moetune adapter for PEFT (transformers) or vLLM.

    export_adapter("runs/x/adapter", "out/peft", format="peft")   # PeftModel.from_pretrained(Glm4MoeForCausalLM, out)
    export_adapter("runs/x", "out/vllm", format="vllm")           # vllm serve ... --lora-modules x=out/vllm

Layouts: peft_layout.py (PEFT's fused-expert `target_parameters` layout) and vllm_layout.py (per-expert).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors.torch import load_file, save_file

from moetune.model.adapter_io import ADAPTER_FORMAT, read_adapter_config
from moetune.errors import ExportError  # noqa: F401  (re-exported)

FORMATS = ("peft", "vllm")




def resolve_adapter_dir(path: str) -> str:
    """A moetune adapter dir from what a user may pass: the adapter dir itself, a run dir holding `adapter/`,
    a training checkpoint (DCP, `checkpoints/step_XXXXXX`), or a run dir with checkpoints but no adapter yet
    (a run still going or stopped early: its newest complete checkpoint)."""
    from moetune.train.checkpoint_files import latest_checkpoint

    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, ".metadata")):
        return adapter_from_checkpoint(path)
    if not os.path.isdir(os.path.join(path, "adapter")):
        newest = latest_checkpoint(Path(path) / "checkpoints") if os.path.isdir(os.path.join(path, "checkpoints")) else None
        if newest is not None:
            return adapter_from_checkpoint(str(newest))
    for cand in (path, os.path.join(path, "adapter")):
        cfg = os.path.join(cand, "adapter_config.json")
        if os.path.isfile(cfg):
            with open(cfg) as f:
                fmt = json.load(f).get("format")
            if fmt == ADAPTER_FORMAT:
                return cand
            if cand == path:
                raise ExportError(f"{cfg}: not a moetune adapter (format {fmt!r}); it looks already exported")
    raise ExportError(f"{path}: no moetune adapter here (expected adapter_config.json with format "
                      f"{ADAPTER_FORMAT!r}, or a run directory containing adapter/)")


def adapter_from_checkpoint(ckpt: str) -> str:
    """Write the LoRA tensors of a DCP training checkpoint as a native adapter (in a temporary directory), with
    the LoRA settings of the config.yaml saved beside them, and return that directory."""
    import tempfile

    from moetune.config import load_config
    from moetune.model.adapter_io import save_adapter
    from moetune.train.checkpoint_files import load_model_state

    if not os.path.isfile(os.path.join(ckpt, "config.yaml")):
        raise ExportError(f"{ckpt}: a DCP directory without config.yaml is not a complete moetune checkpoint")
    cfg = load_config(os.path.join(ckpt, "config.yaml"))
    if cfg.finetune.mode != "lora":
        raise ExportError(f"{ckpt} is a full fine-tuning checkpoint: it has no adapter to export")
    state = {k: v.float() for k, v in load_model_state(ckpt).items() if ".lora" in k}
    c = cfg.lora
    out = tempfile.mkdtemp(prefix="moetune-adapter-")
    save_adapter(state, out, dict(rank=c.rank, alpha=c.alpha, dropout=c.dropout, rslora=c.rslora,
                                  targets=list(c.targets)), base_model=cfg.model.path)
    return out


def read_native_adapter(adapter_dir: str) -> tuple[dict, dict]:
    """(our LoRA tensors in fp32, adapter meta) of a moetune adapter dir."""
    meta = read_adapter_config(adapter_dir)
    state = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    return state, meta


def _write_adapter(out_dir: str, state: dict, config: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, ".adapter_model.safetensors.tmp")
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


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
    state, meta = read_native_adapter(src)
    if meta.get("dropout"):
        # Both targets apply no dropout at inference; PEFT's expert wrapper even refuses a nonzero value.
        meta = dict(meta, dropout=0.0)
    base = base_model_path or meta.get("base_model")
    try:
        tensors, config = convert_adapter(state, meta, format, base)
    except ValueError as e:
        raise ExportError(f"{src}: cannot export as {format}: {e}") from None
    _write_adapter(out_dir, tensors, config)
    report = {"out_dir": os.fspath(out_dir), "format": format, "tensors": len(tensors), "verify": None}
    if verify:
        if not base:
            raise ExportError("verify needs the base model: pass base_model_path (the adapter names none)")
        from moetune.export import verify as v

        fn = v.verify_peft_adapter if format == "peft" else v.verify_vllm_adapter
        report["verify"] = fn(src, out_dir, base)
    return report
