"""PNGs of a run (`moetune plot RUN_DIR`), written next to its metrics.jsonl.

    loss.png         training loss (raw and smoothed) and evaluation loss
    lr.png           learning rate and gradient norm
    throughput.png   tokens/s per GPU and MFU
    memory.png       peak memory
    expert_load.png  layer × expert heatmap of the tokens each expert received over the run, and each layer's
                     max/mean load over time

Works on a run that is still going: a partial last line is skipped, and a figure whose data does not exist yet
(no evaluation so far, expert statistics off) is left out with a note. A resumed run appends the steps it redoes;
the later record of a step wins.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from moetune.errors import MissingDependency, OutputError, RunContentsError

FIGSIZE = (9, 4.8)
DPI = 120


def read_metrics(path: Path) -> tuple[list[dict], int]:
    """Records of metrics.jsonl and how many lines could not be parsed (a line still being written, usually)."""
    records, bad = [], 0
    with open(path, "rb") as f:
        for raw in f:
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                bad += 1
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), (int, float)):
                records.append(rec)
    return records, bad


def series(records: list[dict], key: str) -> tuple[list[int], list]:
    """(steps, values) of `key`, one value per step (the last one written), in step order."""
    by_step = {}
    for r in records:
        if r.get(key) is not None:
            by_step[int(r["step"])] = r[key]
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def smooth(values: list[float], window: int, median: bool = False) -> list[float]:
    """Centred moving average (or median: robust to warm-up and checkpoint outliers), the window shrinking at the
    ends. Centred, so a curve does not lag behind its points the way an exponential average does."""
    half, out = window // 2, []
    for i in range(len(values)):
        w = sorted(values[max(0, i - half): i + half + 1]) if median else values[max(0, i - half): i + half + 1]
        out.append(w[len(w) // 2] if median else sum(w) / len(w))
    return out


def _window(n: int) -> int:
    return max(5, n // 40)


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise MissingDependency("plotting needs matplotlib: pip install 'moetune[viz]'") from None

    matplotlib.use("Agg")  # no display needed: plots are written to files
    import matplotlib.pyplot as plt

    plt.rcParams.update({"axes.spines.top": False, "axes.spines.right": False, "axes.grid": True,
                         "grid.alpha": 0.3, "font.size": 10, "axes.titlesize": 11, "legend.frameon": False})
    return plt


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        fig.savefig(path, dpi=DPI)
    except OSError as e:  # a full disk, a read-only run directory
        raise OutputError(f"{path}: cannot write the figure ({e.strerror or e})") from None
    finally:
        plt.close(fig)
    return path


def _robust_top(values: list[float]) -> float | None:
    """An upper y-limit that a warm-up or compile outlier cannot blow up: 1.2 × the 98th percentile."""
    vals = sorted(v for v in values if v is not None and math.isfinite(v))
    if len(vals) < 10:
        return None
    return 1.2 * vals[int(0.98 * (len(vals) - 1))]


def plot_loss(records, out: Path, title: str):
    steps, loss = series(records, "loss")
    ev_steps, ev = series(records, "eval_loss")
    if not steps and not ev_steps:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    if steps:
        many = len(steps) >= 20
        ax.plot(steps, loss, color="C0", lw=0.8, alpha=0.35 if many else 1.0, label="train loss")
        if many:
            ax.plot(steps, smooth(loss, _window(len(loss))), color="C0", lw=1.8, label="train loss (smoothed)")
    if ev_steps:
        ax.plot(ev_steps, ev, "o-", color="C3", lw=1.6, ms=4, label="eval loss")
        ax.annotate(f"{ev[-1]:.4f}", (ev_steps[-1], ev[-1]), textcoords="offset points", xytext=(6, 6),
                    color="C3", fontsize=9)
    finite = [v for v in loss + ev if math.isfinite(v)]
    top = _robust_top(loss[len(loss) // 20:]) if len(loss) > 40 else None
    if top and finite:
        ax.set_ylim(max(0.0, min(finite) - 0.05 * (top - min(finite))), max(top, max(ev, default=0) * 1.05))
    ax.set(xlabel="step", ylabel="loss", title=f"{title}: loss")
    ax.legend()
    return _save(fig, out / "loss.png")


def plot_lr(records, out: Path, title: str):
    steps, lr = series(records, "lr")
    gsteps, gn = series(records, "grad_norm")
    if not steps:
        return None
    plt = _plt()
    fig, axes = plt.subplots(2 if gsteps else 1, 1, figsize=(FIGSIZE[0], FIGSIZE[1] * (1.3 if gsteps else 1)),
                             sharex=True, squeeze=False)
    ax = axes[0][0]
    ax.plot(steps, lr, color="C2", lw=1.6)
    ax.set(ylabel="learning rate", title=f"{title}: learning rate" + (" and gradient norm" if gsteps else ""))
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if gsteps:
        ax2 = axes[1][0]
        ax2.plot(gsteps, gn, color="C4", lw=0.9)
        top = _robust_top(gn)
        if top:
            ax2.set_ylim(0, top)
        ax2.set(ylabel="gradient norm (before clipping)")
    axes[-1][0].set_xlabel("step")
    return _save(fig, out / "lr.png")


def plot_throughput(records, out: Path, title: str):
    key = "tokens_per_s_per_gpu" if series(records, "tokens_per_s_per_gpu")[0] else "tokens_per_s"
    steps, tps = series(records, key)
    if not steps:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    ax.plot(steps, tps, color="C0", lw=0.8, alpha=0.4 if len(steps) >= 20 else 1.0)
    if len(steps) >= 20:
        ax.plot(steps, smooth(tps, _window(len(tps)), median=True), color="C0", lw=1.8)
    ax.set_ylim(0, _robust_top(tps) or max(tps) * 1.1)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s per GPU" if key == "tokens_per_s_per_gpu" else "tokens/s")
    steady = sorted(tps[len(tps) // 10:])  # the first steps include compilation and warm-up
    label = f"median {steady[len(steady) // 2]:,.0f} tokens/s" if steady else ""
    # MFU is tokens/s per GPU times a constant (flops per token / peak flops): a second scale on the same curve
    # says it exactly, where a second curve on a twin axis would only repeat the first one.
    ratios = [r["mfu"] / r[key] for r in records if r.get("mfu") and r.get(key)]
    if ratios and key == "tokens_per_s_per_gpu":
        k = 100 * sorted(ratios)[len(ratios) // 2]
        sec = ax.secondary_yaxis("right", functions=(lambda x: x * k, lambda y: y / k))
        sec.set_ylabel("MFU (%)")
        label += f", MFU {k * steady[len(steady) // 2]:.1f}%" if steady else ""
    ax.set_title(f"{title}: throughput" + (f" ({label})" if label else ""))
    return _save(fig, out / "throughput.png")


def plot_memory(records, out: Path, title: str):
    steps, mem = series(records, "mem_gib")
    if not steps:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    ax.plot(steps, mem, color="C5", lw=1.6)
    ax.set_ylim(0, max(mem) * 1.15)
    ax.axhline(max(mem), color="C5", ls=":", lw=1)
    ax.annotate(f"peak {max(mem):.2f} GiB", (steps[-1], max(mem)), textcoords="offset points", xytext=(-4, 5),
                ha="right", color="C5")
    ax.set(xlabel="step", ylabel="GiB (GPU: max allocated; CPU: peak RSS)", title=f"{title}: peak memory per process")
    return _save(fig, out / "memory.png")


def plot_expert_load(records, out: Path, title: str, layer_ids: list[int] | None):
    import numpy as np
    from matplotlib.colors import LogNorm

    steps, counts = series(records, "expert_counts")
    if not steps:
        return None
    c = np.asarray(counts, dtype=np.float64)  # [intervals, layers, experts]
    total = c.sum(0)
    ratio = total / np.maximum(total.mean(-1, keepdims=True), 1e-9)
    L, E = total.shape
    names = [str(i) for i in layer_ids] if layer_ids and len(layer_ids) == L else [f"moe {i}" for i in range(L)]
    _, mom = series(records, "expert_max_over_mean")
    plt = _plt()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(min(16, 7 + 0.06 * E + 0.03 * len(steps)), max(3.5, 1.6 + 0.16 * L)),
                                  gridspec_kw={"width_ratios": [max(E, 14), max(16, min(len(steps), E))]})
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="black")  # bad = masked = an expert that got no token at all
    norm = LogNorm(vmin=0.25, vmax=4, clip=True)
    im = ax.imshow(np.ma.masked_equal(ratio, 0), aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
    ax.grid(False)
    ax.set(xlabel="expert", ylabel="layer", title=f"tokens per expert ÷ layer mean, up to step {steps[-1]}\n"
           "(blue: fewer, red: more; black: no token at all)")
    if E <= 16 and L <= 16:  # few cells: print the numbers too
        for (i, j), v in np.ndenumerate(ratio):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8,
                    color="white" if v == 0 or abs(math.log2(max(v, 1e-9))) > 1 else "black")
    _layer_ticks(ax, names)
    ax.set_xticks(_every(E, 16))
    cb = fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02)
    cb.set_ticks([0.25, 0.5, 1, 2, 4])
    cb.set_ticklabels(["¼×", "½×", "1×", "2×", "4×"])
    cb.ax.minorticks_off()
    m = np.asarray(mom, dtype=np.float64).T  # [layers, intervals]
    im2 = ax2.imshow(m, aspect="auto", cmap="YlOrRd", vmin=1, vmax=max(2.0, float(np.percentile(m, 99))),
                     interpolation="nearest", extent=(-0.5, len(steps) - 0.5, L - 0.5, -0.5))
    ax2.grid(False)
    ax2.set(xlabel="step", title="busiest expert ÷ mean load, per interval")
    ticks = _every(len(steps), 8)
    ax2.set_xticks(ticks)
    ax2.set_xticklabels([str(steps[i]) for i in ticks])
    _layer_ticks(ax2, names)
    fig.colorbar(im2, ax=ax2, fraction=0.04, pad=0.02, label="max / mean")
    fig.suptitle(f"{title}: expert load", fontsize=12)
    return _save(fig, out / "expert_load.png")


def _every(n: int, most: int) -> list[int]:
    step = max(1, math.ceil(n / most))
    return list(range(0, n, step))


def _layer_ticks(ax, names: list[str]) -> None:
    idx = _every(len(names), 24)
    ax.set_yticks(idx)
    ax.set_yticklabels([names[i] for i in idx], fontsize=8 if len(names) > 12 else 10)


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> tuple[list[Path], list[str]]:
    """Write the PNGs; returns (files written, notes about what was left out)."""
    run_dir = Path(run_dir)
    metrics = run_dir if run_dir.is_file() else run_dir / "metrics.jsonl"
    run_dir = metrics.parent
    if not metrics.is_file():
        raise RunContentsError(f"{run_dir}: no metrics.jsonl (not a run directory, or a run that has not logged a "
                               "step yet)")
    records, bad = read_metrics(metrics)
    if not records:
        raise RunContentsError(f"{metrics} holds no metrics yet")
    _plt()  # matplotlib is an extra: say so before anything is written
    out = Path(out) if out else run_dir
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file of that name, no permission
        raise OutputError(f"--out {out}: cannot make the folder ({e.strerror or e})") from None
    title, layer_ids = _run_info(run_dir)
    notes = [f"{bad} unreadable line(s) skipped (a line being written?)"] if bad else []
    written = []
    for name, fn in (("loss", plot_loss), ("lr", plot_lr), ("throughput", plot_throughput), ("memory", plot_memory)):
        path = fn(records, out, title)
        written.append(path) if path else notes.append(f"{name}.png: no data yet")
    path = plot_expert_load(records, out, title, layer_ids)
    written.append(path) if path else notes.append("expert_load.png: no expert statistics (logging.expert_stats_every)")
    return written, notes


def _run_info(run_dir: Path) -> tuple[str, list[int] | None]:
    try:
        from moetune.config import load_config
        from moetune.train.metrics import moe_layer_ids

        cfg = load_config(run_dir / "config.yaml")
        return cfg.run.name, moe_layer_ids(cfg)
    except Exception:  # no or unreadable config.yaml: still plot, with a plain title and MoE-layer numbering
        return run_dir.name, None

