"""Export what moetune trained: a PEFT or vLLM adapter, or a merged HF checkpoint.

    from moetune.export import export_adapter, export_merged
    export_adapter("runs/x", "out/peft", format="peft", verify=True)
    export_merged("ckpts/GLM-4.5-Air", "runs/x/adapter", "out/merged", dtype="bfloat16")
    export_merged_from_checkpoint("runs/full", "out/merged")   # a full fine-tuning run
    export_merged_from_model(model, "out/merged")              # in a running job, on every rank
"""

from __future__ import annotations

import os

from moetune.export.adapter import (ADAPTER_FILES, ExportError, check_out_dir, convert_adapter, export_adapter,
                                    resolve_adapter_dir)
from moetune.export.merged import check_base_dir, export_merged
from moetune.export.merged_sources import export_merged_from_checkpoint, export_merged_from_model, full_checkpoint

__all__ = ["ExportError", "convert_adapter", "export_adapter", "export_merged", "export_merged_from_checkpoint",
           "export_merged_from_model", "resolve_adapter_dir", "export_run"]


def export_run(what: str, checkpoint: str, out: str, format: str = "peft", base: str | None = None,
               dtype: str | None = None, verify: bool = False) -> dict:
    """Export what a run trained: `what` "adapter" (in `format` peft or vllm) or "merged" (in `dtype`, default the
    run's), from a run directory, its adapter/ or a training checkpoint. A run on a random-init base (the demo) needs
    no `base`: its base is rebuilt from the adapter's recipe. `out` must be new or empty (an adapter export may
    replace an earlier one); a failed export leaves nothing in it (every export is written into a locked temporary
    sibling and renamed into place when complete and verified: output_dir.py). Returns the report: out_dir, base,
    dtype, notes, verify (the measured errors)."""
    # before any work (a random base is rebuilt first): a --out of the user's is never written into
    check_out_dir(out, ADAPTER_FILES if what == "adapter" else ())
    if base is not None:
        check_base_dir(base, "--base")
    return _run_export(what, checkpoint, out, format, base, dtype, verify)


def _run_export(what, checkpoint, out, format, base_arg, dtype, verify) -> dict:
    from moetune.export.run_base import resolve_base
    from moetune.model.adapter_io import read_adapter_config

    if what == "merged" and (ckpt := full_checkpoint(checkpoint)) is not None:  # full fine-tuning: no base
        dtype = dtype or _run_dtype(ckpt)
        report = dict(export_merged_from_checkpoint(ckpt, out, dtype=dtype), dtype=dtype)
        if verify:
            report.setdefault("notes", []).append(
                "--verify compares against base + adapter; a full fine-tuning export has none, so it was skipped")
        return report
    adapter = resolve_adapter_dir(checkpoint)
    meta = read_adapter_config(adapter)
    base = resolve_base(adapter, meta, base_arg)
    if base and not base_arg and (verify or what == "merged") and not os.path.isdir(base):
        raise ExportError(f"{adapter}: the base it was trained on, {base} (model.path), is not on this machine: "
                          "pass --base DIR")
    if what == "adapter":
        if verify and not base:
            raise ExportError(f"{adapter}: the adapter names no base model to verify against: pass --base")
        report = export_adapter(adapter, out, format=format, base_model_path=base, verify=verify)
    else:
        if not base:
            raise ExportError(f"{adapter}: the adapter names no base model: pass --base")
        dtype = dtype or (meta.get("base_init") or {}).get("dtype") or _config_dtype(base)
        report = export_merged(base, adapter, out, dtype=dtype, verify=verify)
        report["dtype"] = str(dtype)
    report["base"] = base
    return report


def _config_dtype(base: str) -> str:
    """The dtype the base checkpoint is stored in (its config.json), else bfloat16."""
    import json

    try:
        with open(os.path.join(base, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return "bfloat16"
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    return dtype if dtype in ("float32", "bfloat16", "float16") else "bfloat16"


def _run_dtype(ckpt: str) -> str:
    """A full fine-tuning run's model.dtype (its compute dtype), from the checkpoint's config.yaml."""
    from moetune.config import load_config

    return load_config(os.path.join(ckpt, "config.yaml")).model.dtype
