"""`moetune train | export | inspect | plot | generate | chat` — thin: parse arguments, call the function that does
the work."""

from __future__ import annotations

import argparse
import difflib
import logging
import sys

from moetune.errors import MoetuneError
from moetune.help_format import HelpFormatter

CONFIG_REFERENCE = ("the configuration reference is the table in README.md (section 'Configuration reference'); "
                    "`moetune train --print-config` prints every key with its default")

USAGE = """\
usage: moetune [--version] [--help] COMMAND [ARGS]

Fine-tune GLM-4.5-family mixture-of-experts models (LoRA or full), on one CPU, one GPU or many.

commands:
  train [CONFIG.yaml] [--section.key VALUE ...]
                  train (no CONFIG: the embedded tiny demo on this machine); torchrun/srun/accelerate for many GPUs:
                  torchrun --nproc-per-node 8 -m moetune train CONFIG.yaml
  export adapter  write a run's adapter for PEFT (transformers) or vLLM     (moetune export adapter --help)
  export merged   merge a run's adapter into its base: an HF checkpoint     (moetune export merged --help)
  generate        generate text from a run directory or an HF model         (moetune generate --help)
  chat            chat with a run directory or an HF model in the terminal   (moetune chat --help)
  inspect         preflight a config: parameter counts, memory estimate, a masked sample
  plot            PNGs of a run's metrics (loss, lr, throughput, memory, expert load)

Run `moetune COMMAND --help` for a command's flags. Configuration: see README.md ('Configuration reference');
`moetune train --print-config` prints the defaults, `moetune train CONFIG.yaml --print-config` the resolved config.
"""

TRAIN_HELP = """\
usage: moetune train [CONFIG.yaml] [--section.key VALUE ...] [--print-config]

Train a GLM-4.5-family MoE model with LoRA or fully. Without CONFIG.yaml: the embedded demo (a tiny random-init
GLM-4.5 learning to upper-case words, ~25 s on 2 CPU cores). The run directory (run.output_dir/run.name,
default runs/demo) receives config.yaml, metrics.jsonl, checkpoints/ and adapter/.

arguments:
  CONFIG.yaml             a YAML file with sections run, model, finetune, lora, data, train, optim, eval,
                          logging, checkpoint, parallel, resume (configs/ holds recipes for GLM-4.5-Air,
                          GLM-4.5, GLM-4.7-Flash and GLM-5)
  --section.key VALUE     override one key, e.g. --optim.lr 2e-4 --lora.targets [q_proj,v_proj] (also
                          --section.key=VALUE; values are YAML)
  --print-config          print the resolved config (defaults < file < overrides) as YAML and exit
  -h, --help              show this help and exit

Many GPUs or nodes: torchrun --nproc-per-node 8 -m moetune train CONFIG.yaml (or srun / accelerate launch).
Afterwards: moetune export adapter|merged --checkpoint RUN_DIR ..., moetune generate RUN_DIR --prompt TEXT,
moetune plot RUN_DIR.
{reference}.
"""


def _train(argv):
    from moetune.config import ConfigError, check_paths, config_to_yaml, load_config

    if any(a in ("-h", "--help") for a in argv):
        print(TRAIN_HELP.format(reference=CONFIG_REFERENCE[0].upper() + CONFIG_REFERENCE[1:]))
        return 0
    print_config = "--print-config" in argv
    argv = [a for a in argv if a != "--print-config"]
    config_path = None
    if argv and not argv[0].startswith("--"):
        config_path, argv = argv[0], argv[1:]
    try:
        cfg = load_config(config_path, argv)
        if print_config:
            print(config_to_yaml(cfg), end="")
            return 0
        check_paths(cfg)  # a typo or a placeholder path: one line now, not a hub traceback after model building
    except ConfigError as e:
        print(f"moetune: error: {e}", file=sys.stderr)
        return 2
    from moetune.train.loop import train

    try:
        train(cfg)
    except MoetuneError as e:
        print(f"moetune: error: {e}", file=sys.stderr)
        _shutdown_distributed(finished=False)
        return e.exit_code
    _shutdown_distributed(finished=True)  # anything else keeps its traceback and exits: see there
    return 0


def _shutdown_distributed(finished: bool):
    """Free the (sharded) model while its process groups still exist, then destroy them. FSDP/DTensor modules
    sit in reference cycles, so without the collect they outlive the groups and gloo aborts at interpreter exit
    ("terminate called without an active exception"), seen with expert parallelism.
    The barrier only after a finished run: a rank that failed alone would wait in it for ranks that wait in the
    collective it left, forever and before its error is printed (NCCL does not time out there) — how a failure on
    2 × H200 looked like a hang. Exiting shows the error and lets the launcher stop the others."""
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if finished:
            dist.barrier()
        gc.collect()
        dist.destroy_process_group()


_CHECKPOINT_HELP = ("a run directory (runs/NAME), its adapter/, or a training checkpoint (checkpoints/step_XXXXXX); "
                    "a run still going or stopped early exports its newest checkpoint")
_BASE_HELP = ("the base HF checkpoint directory (default: the one the run trained on: model.path, or for a "
              "random-init run such as the demo its base rebuilt bit for bit into RUN/base/)")


def _export_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moetune export", description="Export what a run trained: an adapter for PEFT or vLLM, or a merged "
        "HF checkpoint. `moetune export adapter --help` / `moetune export merged --help` for each one's flags.")
    sub = p.add_subparsers(dest="what", required=True, metavar="{adapter,merged}")
    ad = sub.add_parser(
        "adapter", help="write the run's LoRA adapter for PEFT or vLLM",
        description="Write a run's LoRA adapter in the layout PEFT (PeftModel.from_pretrained on transformers' "
        "Glm4MoeForCausalLM) or vLLM (--lora-modules, per-expert names) loads.",
        formatter_class=HelpFormatter)
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
        "checkpoint in the hub's layout (per-expert names, <= 5 GB shards) that transformers, vLLM and SGLang load.",
        formatter_class=HelpFormatter)
    me.add_argument("--checkpoint", required=True, help=_CHECKPOINT_HELP + "; full fine-tuning runs too")
    me.add_argument("--out", required=True, help="output directory (created; removed again if the export fails)")
    me.add_argument("--base", default=None, help=_BASE_HELP)
    me.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="dtype of the written weights (default: the run's model.dtype, i.e. the base's)")
    me.add_argument("--verify", action="store_true",
                    help="reload the merged checkpoint with transformers and moetune and compare logits to base + "
                         "adapter; prints PASS or FAIL against the tolerance (1e-4 relative) and exits 1 on FAIL")
    return p


def _export(argv):
    a = _export_parser().parse_args(argv)
    # progress (shards written, verify stages) on stderr: an export of a large model runs for minutes
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr, force=True)
    if a.what == "adapter":
        a.dtype = None
    else:
        a.format = None
    from moetune.export import cli_export

    return cli_export(a)


def _inspect(argv):
    from moetune.inspect import main as inspect_main

    return inspect_main(argv)


def _plot(argv):
    from moetune.plot import main as plot_main

    return plot_main(argv)


def _generate(argv):
    from moetune.inference import generate_main

    return _user_errors(generate_main, argv)


def _chat(argv):
    from moetune.inference import chat_main

    return _user_errors(chat_main, argv)


def _user_errors(fn, argv):
    try:
        return fn(argv)
    except MoetuneError as e:
        print(f"moetune: error: {e}", file=sys.stderr)
        return e.exit_code


COMMANDS = {"train": _train, "export": _export, "inspect": _inspect, "plot": _plot, "generate": _generate,
            "chat": _chat}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        from moetune import __version__

        print(f"moetune {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        guess = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
        hint = f"did you mean {guess[0]!r}?" if guess else f"the commands are {', '.join(COMMANDS)}"
        print(f"moetune: unknown command {argv[0]!r}: {hint} (`moetune --help` describes them)", file=sys.stderr)
        return 2
    try:
        return COMMANDS[argv[0]](argv[1:]) or 0
    except KeyboardInterrupt:
        # Ctrl-C is the user's, not a bug: one line, the shell's exit status for SIGINT. Nothing half-written counts:
        # checkpoints and adapter exports are renamed into place when complete, a merged export is removed.
        hint = (": checkpoints already written are complete (resume: auto continues from the newest); SIGTERM or "
                "SIGUSR1 instead saves one at the next step" if argv[0] == "train" else "")
        print(f"\nmoetune: interrupted{hint}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
