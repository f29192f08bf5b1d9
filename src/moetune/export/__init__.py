"""Export what moetune trained: a PEFT or vLLM adapter, or a merged HF checkpoint.

    from moetune.export import export_adapter, export_merged
    export_adapter("runs/x", "out/peft", format="peft", verify=True)
    export_merged("ckpts/GLM-4.5-Air", "runs/x/adapter", "out/merged", dtype="bfloat16")
    export_merged_from_checkpoint("runs/full", "out/merged")   # a full fine-tuning run
    export_merged_from_model(model, "out/merged")              # in a running job, on every rank
"""

from __future__ import annotations

import os
import shutil
import sys

from moetune.export.adapter import (ADAPTER_FILES, ExportError, check_out_dir, convert_adapter, export_adapter,
                                    resolve_adapter_dir)
from moetune.export.merged import check_base_dir, export_merged
from moetune.export.merged_sources import export_merged_from_checkpoint, export_merged_from_model, full_checkpoint
from moetune.errors import MoetuneError

__all__ = ["ExportError", "convert_adapter", "export_adapter", "export_merged", "export_merged_from_checkpoint",
           "export_merged_from_model", "resolve_adapter_dir", "cli_export"]


def cli_export(a) -> int:
    """`moetune export adapter|merged` on parsed arguments (what, checkpoint, out, format, base, dtype, verify).
    A run on a random-init base (the demo) needs no --base: its base is rebuilt from the adapter's recipe. --verify
    prints PASS or FAIL against its tolerance. --out must be new or empty (an adapter export may replace an earlier
    one); a failed export leaves nothing in it (adapters are staged and renamed; a merged export's files are
    removed, or, when --out existed and --verify failed, marked EXPORT_FAILED)."""
    from moetune.export.verify import TOLERANCE

    existed = os.path.exists(a.out)
    try:
        # before any work (a random base is rebuilt first): a --out of the user's is never written into
        check_out_dir(a.out, ADAPTER_FILES if a.what == "adapter" else ())
        if a.base is not None:
            check_base_dir(a.base, "--base")
    except MoetuneError as e:
        print(f"moetune: error: {e}", file=sys.stderr)
        return 1
    try:
        report = _run_export(a)
    except MoetuneError as e:
        if a.what == "merged":
            _discard(a.out, mark=existed and str(e).startswith("verify"), why=str(e), existed=existed)
        if str(e).startswith("verify"):
            print(f"verify: FAIL (tolerance {TOLERANCE:g}, relative logit error): {e}", file=sys.stderr)
        print(f"moetune: error: {e}", file=sys.stderr)
        return 1
    except BaseException:
        if a.what == "merged":
            _discard(a.out, mark=False, why="interrupted", existed=existed)
        raise
    print(f"exported {a.what} to {report['out_dir']}" + (f" ({a.format})" if a.what == "adapter" else "")
          + (f", {report['dtype']}" if report.get("dtype") else ""))
    if report.get("base"):
        print(f"base: {report['base']}")
    for note in report.get("notes", []):
        print(f"note: {note}")
    if report.get("verify"):
        print(f"verify: PASS (tolerance {TOLERANCE:g}, relative logit error): "
              + ", ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}" for k, v in report["verify"].items()))
    return 0


def _run_export(a) -> dict:
    from moetune.export.run_base import resolve_base
    from moetune.model.adapter_io import read_adapter_config

    if a.what == "merged" and (ckpt := full_checkpoint(a.checkpoint)) is not None:  # full fine-tuning: no base
        if a.verify:
            print("moetune: note: --verify compares against base + adapter; a full fine-tuning export has "
                  "none, so it is skipped", file=sys.stderr)
        dtype = a.dtype or _run_dtype(ckpt)
        return dict(export_merged_from_checkpoint(ckpt, a.out, dtype=dtype), dtype=dtype)
    adapter = resolve_adapter_dir(a.checkpoint)
    meta = read_adapter_config(adapter)
    base = resolve_base(adapter, meta, a.base)
    if base and not a.base and (a.verify or a.what == "merged") and not os.path.isdir(base):
        raise ExportError(f"{adapter}: the base it was trained on, {base} (model.path), is not on this machine: "
                          "pass --base DIR")
    if a.what == "adapter":
        if a.verify and not base:
            raise ExportError(f"{adapter}: the adapter names no base model to verify against: pass --base")
        report = export_adapter(adapter, a.out, format=a.format, base_model_path=base, verify=a.verify)
    else:
        if not base:
            raise ExportError(f"{adapter}: the adapter names no base model: pass --base")
        dtype = a.dtype or (meta.get("base_init") or {}).get("dtype") or _config_dtype(base)
        report = export_merged(base, adapter, a.out, dtype=dtype, verify=a.verify)
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


def _discard(out: str, mark: bool, why: str, existed: bool) -> None:
    """After a failed merged export (its --out was new or empty: check_out_dir): mark a folder that existed before
    and now holds an export that failed --verify; otherwise remove what the export wrote — the whole folder when it
    created it, the folder's contents when it was there, empty, before (interrupted half-written shards)."""
    if not os.path.isdir(out):
        return
    if mark:
        with open(os.path.join(out, "EXPORT_FAILED"), "w") as f:
            f.write(f"this export failed verification and must not be used: {why}\n")
        return
    shutil.rmtree(out, ignore_errors=True)
    if existed:
        os.makedirs(out, exist_ok=True)
