"""`moetune inspect [CONFIG.yaml] [--world-size N] [--gpu-mem-gib G] [--section.key VALUE ...]`."""

from __future__ import annotations

import argparse
import os
import sys

from moetune.cli.args import ArgumentParser
from moetune.cli.train import split_config_argument

DESCRIPTION = (
    "A preflight that needs no GPU. Prints the resolved config; the architecture and its parameter counts (total, "
    "active per token, trainable by module kind: the model is built on the meta device, LoRA applied there, nothing "
    "allocated); the parallel layout the run would use at that world size and GPU memory, and why; an estimate of "
    "peak memory per GPU of that layout; the data: statistics of the train and eval sets and the first packed sample "
    "with its trained tokens marked. Parts whose inputs do not exist (placeholder paths in the shipped configs) are "
    "skipped with a note instead of failing. Data problems and a layout that cannot fit make the exit status 1.")


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def inspect(argv: list[str]) -> int:
    from moetune.config import load_config
    from moetune.inspect import report

    p = ArgumentParser(prog="moetune inspect", usage="moetune inspect [CONFIG.yaml] [options] [--section.key VALUE ...]",
                       description=DESCRIPTION,
                       epilog="CONFIG.yaml: none means the embedded demo. Other --section.key VALUE arguments "
                              "override the config, as for `moetune train`.")
    p.add_argument("--world-size", type=_positive(int), default=1, help="GPUs the run will use, for the memory estimate")
    p.add_argument("--gpu-mem-gib", type=_positive(float), default=None,
                   help="memory of one GPU in GiB for the layout (an H200: 139.8, an H100 80GB: 79.1); default: "
                        "parallel.gpu_memory_gib, else this machine's GPU")
    p.add_argument("--color", choices=["auto", "always", "never"], default="auto",
                   help="mark trained tokens with ANSI colour (auto: on a terminal) or with [[brackets]]")
    p.add_argument("--sample-tokens", type=_positive(int), default=512, help="show at most this many tokens of the sample")
    config, rest = split_config_argument(argv)
    a, overrides = p.parse_known_args(rest)
    cfg = load_config(config, overrides)
    color = a.color == "always" or (a.color == "auto" and sys.stdout.isatty() and not os.environ.get("NO_COLOR"))
    return 0 if report(cfg, a.world_size, a.gpu_mem_gib, color, a.sample_tokens) else 1
