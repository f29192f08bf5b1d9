"""`moetune export adapter|merged --checkpoint RUN --out DIR [...]`."""

from __future__ import annotations

import logging
import sys

from moetune.cli.args import ArgumentParser
from moetune.errors import VerificationError

_CHECKPOINT_HELP = ("a run directory (runs/NAME), its adapter/, or a training checkpoint (checkpoints/step_XXXXXX); "
                    "a run still going or stopped early exports its newest checkpoint")
_BASE_HELP = ("the base HF checkpoint directory (default: the one the run trained on: model.path, or for a "
              "random-init run such as the demo its base rebuilt bit for bit into RUN/base/)")


def _parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="moetune export", description="Export what a run trained: an adapter for PEFT or "
        "vLLM, or a merged HF checkpoint. `moetune export adapter --help` / `moetune export merged --help` for each "
        "one's flags.")
    sub = p.add_subparsers(dest="what", required=True, metavar="{adapter,merged}", parser_class=ArgumentParser)
    ad = sub.add_parser(
        "adapter", help="write the run's LoRA adapter for PEFT or vLLM",
        description="Write a run's LoRA adapter in the layout PEFT (PeftModel.from_pretrained on transformers' "
        "Glm4MoeForCausalLM) or vLLM (--lora-modules, per-expert names) loads.")
    ad.add_argument("--checkpoint", required=True, help=_CHECKPOINT_HELP)
    ad.add_argument("--out", required=True, help="output directory (created; removed again if the export fails)")
    ad.add_argument("--format", choices=["peft", "vllm"], default="peft", help="the adapter layout")
    ad.add_argument("--base", default=None, help=_BASE_HELP + "; written as the adapter's base_model_name_or_path")
    ad.add_argument("--verify", action="store_true",
                    help="reload the export (PEFT on transformers) and compare its logits to moetune's; prints "
                         "PASS or FAIL against the tolerance (1e-4 relative) and exits 1 on FAIL")
    me = sub.add_parser(
        "merged", help="merge the adapter into its base and write an HF checkpoint",
        description="Merge a run's adapter into its base (or write a full fine-tuning run's weights) as an HF "
        "checkpoint in the hub's layout (per-expert names, <= 5 GB shards) that transformers, vLLM and SGLang load.")
    me.add_argument("--checkpoint", required=True, help=_CHECKPOINT_HELP + "; full fine-tuning runs too")
    me.add_argument("--out", required=True, help="output directory (created; removed again if the export fails)")
    me.add_argument("--base", default=None, help=_BASE_HELP)
    me.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "fp8"], default=None,
                    help="dtype of the written weights (default: the run's model.dtype, i.e. the base's); fp8: the "
                         "merged weights requantised in the FP8 base's own format (or the one model.quantize trained "
                         "on), the rest in bfloat16")
    me.add_argument("--verify", action="store_true",
                    help="reload the merged checkpoint with transformers and moetune and compare logits to base + "
                         "adapter; prints PASS or FAIL against the tolerance (1e-4 relative) and exits 1 on FAIL")
    return p


def export(argv: list[str]) -> int:
    from moetune.export import export_run
    from moetune.export.verify import TOLERANCE

    a = _parser().parse_args(argv)
    # progress (shards written, verify stages) on stderr: an export of a large model runs for minutes
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr, force=True)
    try:
        report = export_run(a.what, a.checkpoint, a.out, format=getattr(a, "format", None),
                            base=a.base, dtype=getattr(a, "dtype", None), verify=a.verify)
    except VerificationError as e:
        print(f"verify: FAIL (tolerance {TOLERANCE:g}, relative logit error): {e}", file=sys.stderr)
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
