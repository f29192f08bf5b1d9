"""`moetune plot RUN_DIR [--out DIR]`."""

from __future__ import annotations

import sys

from moetune.cli.args import ArgumentParser


def plot(argv: list[str]) -> int:
    from moetune.plot import plot_run

    p = ArgumentParser(prog="moetune plot", description="PNGs of a run's metrics.jsonl (works while it runs): loss, "
                       "learning rate and gradient norm, throughput and MFU, peak memory, expert load")
    p.add_argument("run_dir", help="a run directory (or its metrics.jsonl)")
    p.add_argument("--out", default=None, help="where to write the PNGs (default: next to metrics.jsonl)")
    a = p.parse_args(argv)
    written, notes = plot_run(a.run_dir, a.out)
    for path in written:
        print(path)
    for n in notes:
        print(f"  note: {n}", file=sys.stderr)
    return 0
