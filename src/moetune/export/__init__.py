"""Export what moetune trained: a PEFT or vLLM adapter, or a merged HF checkpoint.

    from moetune.export import export_adapter, export_merged
    export_adapter("runs/x", "out/peft", format="peft", verify=True)
    export_merged("ckpts/GLM-4.5-Air", "runs/x/adapter", "out/merged", dtype="bfloat16")
    export_merged_from_checkpoint("runs/full", "out/merged")   # a full fine-tuning run
    export_merged_from_model(model, "out/merged")              # in a running job, on every rank
"""

from __future__ import annotations

import sys

from moetune.export.adapter import ExportError, convert_adapter, export_adapter, resolve_adapter_dir
from moetune.export.merged import export_merged
from moetune.export.merged_sources import export_merged_from_checkpoint, export_merged_from_model, full_checkpoint
from moetune.errors import MoetuneError

__all__ = ["ExportError", "convert_adapter", "export_adapter", "export_merged", "export_merged_from_checkpoint",
           "export_merged_from_model", "resolve_adapter_dir", "cli_export"]


def cli_export(a) -> int:
    """`moetune export adapter|merged` on parsed arguments (what, checkpoint, out, format, base, dtype, verify)."""
    try:
        if a.what == "adapter":
            report = export_adapter(a.checkpoint, a.out, format=a.format, base_model_path=a.base, verify=a.verify)
        elif (ckpt := full_checkpoint(a.checkpoint)) is not None:  # a full fine-tuning run: no adapter, no base
            if a.verify:
                print("moetune: note: --verify compares against base + adapter; a full fine-tuning export has "
                      "none, so it is skipped", file=sys.stderr)
            report = export_merged_from_checkpoint(ckpt, a.out, dtype=a.dtype)
        else:
            from moetune.model.adapter_io import read_adapter_config

            adapter = resolve_adapter_dir(a.checkpoint)
            base = a.base or read_adapter_config(adapter).get("base_model")
            if not base:
                raise ExportError("the adapter names no base model: pass --base")
            report = export_merged(base, adapter, a.out, dtype=a.dtype, verify=a.verify)
    except MoetuneError as e:
        print(f"moetune: error: {e}", file=sys.stderr)
        return 1
    print(f"exported {a.what} to {report['out_dir']}" + (f" ({a.format})" if a.what == "adapter" else ""))
    for note in report.get("notes", []):
        print(f"note: {note}")
    if report.get("verify"):
        print("verify: " + ", ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}"
                                     for k, v in report["verify"].items()))
    return 0
