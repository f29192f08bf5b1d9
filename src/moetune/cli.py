"""`moetune train | export | inspect | plot` — thin: parse arguments, call the function that does the work."""

from __future__ import annotations

import argparse
import sys

from moetune.errors import MoetuneError


def _train(argv):
    from moetune.config import ConfigError, load_config

    config_path = None
    if argv and not argv[0].startswith("--"):
        config_path, argv = argv[0], argv[1:]
    try:
        cfg = load_config(config_path, argv)
    except ConfigError as e:
        print(f"moetune: {e}", file=sys.stderr)
        return 2
    from moetune.train.loop import train

    try:
        train(cfg)
    except MoetuneError as e:
        print(f"moetune: error: {e}", file=sys.stderr)
        return e.exit_code
    finally:
        _shutdown_distributed()
    return 0


def _shutdown_distributed():
    """Free the (sharded) model while its process groups still exist, then destroy them. FSDP/DTensor modules
    sit in reference cycles, so without the collect they outlive the groups and gloo aborts at interpreter exit
    ("terminate called without an active exception"), seen with expert parallelism."""
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        except Exception:  # a failed run: other ranks may be gone; still tear down
            pass
        gc.collect()
        dist.destroy_process_group()


def _export(argv):
    p = argparse.ArgumentParser(prog="moetune export")
    p.add_argument("what", choices=["adapter", "merged"])
    p.add_argument("--checkpoint", required=True,
                   help="a run directory, its adapter/, or a training checkpoint (checkpoints/step_XXXXXX); "
                        "full fine-tuning runs export merged from their checkpoint")
    p.add_argument("--out", required=True)
    p.add_argument("--format", choices=["peft", "vllm"], default="peft")
    p.add_argument("--base", default=None, help="base HF checkpoint (default: the adapter's base_model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--verify", action="store_true", help="reload the export with transformers/PEFT and compare logits")
    a = p.parse_args(argv)
    from moetune.export import cli_export

    return cli_export(a)


def _inspect(argv):
    from moetune.inspect import main as inspect_main

    return inspect_main(argv)


def _plot(argv):
    from moetune.plot import main as plot_main

    return plot_main(argv)


COMMANDS = {"train": _train, "export": _export, "inspect": _inspect, "plot": _plot}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: moetune {train [CONFIG.yaml] [--section.key value ...] | export adapter|merged ... | "
              "inspect CONFIG.yaml | plot RUN_DIR}\n"
              "  moetune train            trains the embedded tiny demo on this machine\n"
              "  torchrun --nproc-per-node 8 -m moetune train CONFIG.yaml   for many GPUs", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
