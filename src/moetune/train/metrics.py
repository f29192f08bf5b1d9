"""Numbers a user trusts: metrics.jsonl, tokens/s, MFU, memory, expert load per layer."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

import torch

from moetune.errors import OutputError
from moetune.model.config import GLM_MOE_DSA, ModelConfig

log = logging.getLogger("moetune")

# Dense bf16 peak of the datasheet (MFU's denominator, as in ../shared/reference); None = unknown device.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "B200": 2250e12}


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def attention_matmul_params(cfg: ModelConfig, layer_idx: int) -> int:
    """Weights of one layer's attention projections (biases aside). GQA: q, k, v, o. MLA: q_proj, or q_a_proj +
    q_b_proj through q_lora_rank; kv_a_proj_with_mqa (latent + the one shared RoPE key), kv_b_proj, o_proj. A DSA
    layer that computes its own top-k ("full") adds its indexer's wq_b, wk and weights_proj."""
    H, nH = cfg.hidden_size, cfg.num_attention_heads
    if not cfg.is_mla:
        return H * cfg.head_dim * (2 * nH + 2 * cfg.num_key_value_heads)
    q = H * nH * cfg.qk_head_dim if cfg.q_lora_rank is None else cfg.q_lora_rank * (H + nH * cfg.qk_head_dim)
    kv = H * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * nH * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return q + kv + nH * cfg.v_head_dim * H + indexer_matmul_params(cfg, layer_idx)


def indexer_matmul_params(cfg: ModelConfig, layer_idx: int) -> int:
    """A DSA layer's indexer projections (wq_b, wk, weights_proj) when it computes its own top-k ("full")."""
    if cfg.model_type != GLM_MOE_DSA or cfg.indexer_type(layer_idx) != "full":
        return 0
    H, nI, dI = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
    return cfg.q_lora_rank * nI * dI + H * dI + H * nI


def active_matmul_params(cfg: ModelConfig) -> int:
    """Matmul parameters one token passes through: attention (with the DSA indexer's projections), dense MLP or
    (top-k + shared) experts and router, lm_head. Embedding lookups, norms and biases are not counted, nor the
    attention's and the indexer's score products (they grow with the sequence, not with the parameters)."""
    H = cfg.hidden_size
    total = cfg.vocab_size * H
    for i in range(cfg.num_hidden_layers):
        total += attention_matmul_params(cfg, i)
        if cfg.is_moe_layer(i):
            expert = 3 * H * cfg.moe_intermediate_size
            total += expert * (cfg.num_experts_per_tok + cfg.n_shared_experts) + cfg.n_routed_experts * H
        else:
            total += 3 * H * cfg.intermediate_size
    return total


def mfu(tokens_per_s: float, cfg: ModelConfig, full_finetune: bool, peak: float | None) -> float | None:
    """MFU with 4·P flops per token for LoRA (no weight gradients of the frozen base), 6·P for full tuning; 2·P for
    the DSA indexer's projections, which run without backward."""
    if not peak:
        return None
    indexer = sum(indexer_matmul_params(cfg, i) for i in range(cfg.num_hidden_layers))
    flops = (6 if full_finetune else 4) * (active_matmul_params(cfg) - indexer) + 2 * indexer
    return flops * tokens_per_s / peak


class AllocatorPressure:
    """The CUDA caching allocator's retries: a request it could only serve after freeing its whole cache (a
    synchronising cudaFree of every cached block, then cudaMalloc again). A few are harmless; one per step means
    the run lives at its memory limit and each step pays for it. The count goes into each record, and the first
    step that had any says so once."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.warned = False

    def record(self, step: int) -> dict:
        if not self.cuda:
            return {}
        stats = torch.cuda.memory_stats(self.device)
        retries = stats.get("num_alloc_retries", 0)
        out = {"mem_reserved_gib": round(torch.cuda.max_memory_reserved(self.device) / 2**30, 3),
               "alloc_retries": retries}
        if retries and not self.warned:
            self.warned = True
            log.warning("step %d: the CUDA allocator freed its cache to serve a request (%d time(s) so far): the run "
                        "is at its memory limit, and a step that does this waits on it. More activation "
                        "checkpointing (train.activation_checkpointing, or parallel.layout auto with a smaller "
                        "parallel.gpu_memory_gib) trades a little compute for the headroom", step, retries)
        return out


def memory_gib(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # host peak RSS (KiB on Linux)
    except ImportError:  # pragma: no cover
        return None


def expert_load_stats(counts: torch.Tensor) -> dict:
    """Per-layer statistics of tokens-per-expert counts [L, E] (MoE layers only) summed over a logging interval.

    expert_counts        tokens (token-expert assignments) each expert received
    expert_max_over_mean the busiest expert's load over the mean load (1.0 = perfectly balanced)
    expert_cv            coefficient of variation of the loads (std / mean, population std)
    expert_dead          experts that received no token in the interval
    expert_load_entropy  entropy of the load distribution over the experts, normalised by log E (1.0 = uniform,
                         0.0 = everything to one expert). Not the per-token router entropy (how sure the router
                         is of each choice): the loop logs that beside these as `router_entropy`, from the
                         router's normalised scores (MoE.last_router_entropy).
    """
    c = counts.double()
    mean = c.mean(-1)
    std = c.std(-1, unbiased=False)
    p = c / c.sum(-1, keepdim=True).clamp(min=1)
    entropy = -(p * p.clamp(min=1e-30).log()).sum(-1) / math.log(c.shape[-1])
    r4 = lambda t: [round(float(x), 4) for x in t]  # noqa: E731
    return {
        "expert_max_over_mean": r4(c.max(-1).values / mean.clamp(min=1e-9)),
        "expert_cv": r4(std / mean.clamp(min=1e-9)),
        "expert_dead": [int(x) for x in (c == 0).sum(-1)],
        "expert_load_entropy": r4(entropy),
        "expert_counts": [[int(x) for x in row] for row in counts.long()],
    }


def moe_layer_ids(cfg) -> list[int] | None:
    """Decoder-layer index of each row of expert_counts (the dense layers come first), or None if the model's config
    cannot be resolved (e.g. a checkpoint path that is not on this machine)."""
    from moetune.model.config import resolve_model_config

    try:
        m = resolve_model_config(cfg.model.path, cfg.model.effective_config, cfg.model.num_hidden_layers)
    except (OSError, ValueError):
        return None
    return [i for i in range(m.num_hidden_layers) if m.is_moe_layer(i)]


class ExpertLoadMonitor:
    """Alarms on expert load: an expert that gets no token for `dead_intervals` intervals in a row, or a layer whose
    busiest expert gets more than `max_over_mean` times the mean load. Each condition is reported once when it
    starts (and again only after it has cleared), so a persistent problem is one line, not one line per interval."""

    def __init__(self, dead_intervals: int, max_over_mean: float, layer_ids: list[int] | None = None):
        self.dead_intervals, self.max_over_mean, self.layer_ids = dead_intervals, max_over_mean, layer_ids
        self.dead_streak: list[list[int]] | None = None
        self.imbalanced: list[bool] | None = None

    def _name(self, i: int) -> str:
        return f"layer {self.layer_ids[i]}" if self.layer_ids and i < len(self.layer_ids) else f"MoE layer {i}"

    def update(self, record: dict) -> str | None:
        """The alarm text for this interval's record, or None."""
        counts = record.get("expert_counts")
        if not counts:
            return None
        if self.dead_streak is None or len(self.dead_streak) != len(counts):
            self.dead_streak = [[0] * len(row) for row in counts]
            self.imbalanced = [False] * len(counts)
        dead, hot = [], []
        for i, row in enumerate(counts):
            streak = self.dead_streak[i]
            newly = []
            for e, c in enumerate(row):
                streak[e] = streak[e] + 1 if c == 0 else 0
                if self.dead_intervals and streak[e] == self.dead_intervals:
                    newly.append(e)
            if newly:
                dead.append(f"{self._name(i)} {_short_list(newly)}")
            mom = record["expert_max_over_mean"][i]
            over = bool(self.max_over_mean) and mom > self.max_over_mean
            if over and not self.imbalanced[i]:
                hot.append(f"{self._name(i)} ({mom:.1f}x, expert {max(range(len(row)), key=row.__getitem__)})")
            self.imbalanced[i] = over
        parts = []
        if dead:
            parts.append(f"experts with no token for {self.dead_intervals} intervals: " + _short_join(dead))
        if hot:
            parts.append(f"busiest expert above {self.max_over_mean:g}x the mean load: " + _short_join(hot))
        return "; ".join(parts) or None


def _short_list(xs: list[int], n: int = 8) -> str:
    return "[" + ", ".join(map(str, xs[:n])) + (f", +{len(xs) - n} more" if len(xs) > n else "") + "]"


def _short_join(items: list[str], n: int = 6) -> str:
    return ", ".join(items[:n]) + (f" (+{len(items) - n} more layers)" if len(items) > n else "")


# metrics.jsonl key -> tracker tag; other numeric keys go under "other/"
SCALAR_TAGS = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "tokens": "train/tokens",
    "aux_loss": "train/aux_loss", "eval_loss": "eval/loss", "tokens_per_s": "perf/tokens_per_s",
    "tokens_per_s_per_gpu": "perf/tokens_per_s_per_gpu", "mfu": "perf/mfu", "mem_gib": "perf/mem_gib",
    "mem_reserved_gib": "perf/mem_reserved_gib", "alloc_retries": "perf/alloc_retries",
    "checkpoint_s": "checkpoint/seconds", "checkpoint_bytes": "checkpoint/bytes",
}
EXPERT_LISTS = {"expert_max_over_mean": "max_over_mean", "expert_cv": "cv", "expert_dead": "dead",
                "expert_load_entropy": "load_entropy", "router_entropy": "router_entropy"}


def tracker_scalars(record: dict, layer_ids: list[int] | None = None) -> dict:
    """Flatten one metrics.jsonl record into tracker scalars: per-step values, per-layer expert statistics
    (experts_by_layer/<stat>/layer_NN) and their summaries over layers (experts/<summary>)."""
    out = {}
    for k, v in record.items():
        if k == "step" or isinstance(v, bool) or v is None:
            continue
        if isinstance(v, (int, float)):
            out[SCALAR_TAGS.get(k, f"other/{k}")] = v
        elif k in EXPERT_LISTS and v:
            for i, x in enumerate(v):
                layer = layer_ids[i] if layer_ids and i < len(layer_ids) else i
                out[f"experts_by_layer/{EXPERT_LISTS[k]}/layer_{layer:02d}"] = x
    if record.get("expert_max_over_mean"):
        out["experts/max_over_mean_worst_layer"] = max(record["expert_max_over_mean"])
        out["experts/cv_mean_over_layers"] = sum(record["expert_cv"]) / len(record["expert_cv"])
        out["experts/dead_total"] = sum(record["expert_dead"])
        out["experts/load_entropy_worst_layer"] = min(record["expert_load_entropy"])
    return out


def load_heatmap_image(counts: list[list[int]], width: int = 512):
    """An RGB uint8 image [H, W, 3] of load / mean load per (MoE layer row, expert column), log2 scale clipped to
    [1/4, 4]: blue under-loaded, white balanced, red over-loaded; black = no token. For a TensorBoard image slider."""
    import numpy as np

    c = np.asarray(counts, dtype=np.float64)
    ratio = c / np.maximum(c.mean(-1, keepdims=True), 1e-9)
    x = (np.clip(np.log2(np.maximum(ratio, 1e-9)), -2, 2) + 2) / 4  # 0 = 1/4 of the mean, 0.5 = mean, 1 = 4x
    rgb = np.stack([np.minimum(1, 2 * x), 1 - 2 * np.abs(x - 0.5), np.minimum(1, 2 - 2 * x)], -1)  # blue-white-red
    rgb[c == 0] = 0
    L, E = c.shape
    pw, ph = max(1, width // E), max(1, (width // 2) // max(L, 1))
    img = np.repeat(np.repeat(rgb, ph, axis=0), pw, axis=1)
    return (img * 255).astype(np.uint8)


class MetricsWriter:
    """metrics.jsonl, one JSON object per line, written by rank 0 only and flushed each line, so that
    `moetune plot` and `tail -f` work on a run that is still going.

    Given the run's config it also feeds the trackers of `logging.report_to` (TensorBoard, W&B: see trackers.py)
    and raises the expert-load alarms of `logging.alarm_*` as warning lines in the log."""

    def __init__(self, path: str | os.PathLike, enabled: bool, append: bool = False, cfg=None, resumed_step: int = 0):
        """append with resumed_step: the records of steps after it are dropped first (a killed run logged them; the
        resumed run redoes them)."""
        self.enabled = enabled
        self.path = Path(path)
        self._f = None
        if enabled:
            try:
                if append:
                    _truncate_after(self.path, resumed_step)
                self._f = open(path, "a" if append else "w")
            except OSError as e:
                raise OutputError(f"cannot write {path}: {e}") from None
        self.cfg, self.append, self.run_dir = cfg, append, Path(path).parent
        self._trackers: list | None = None if (enabled and cfg is not None) else []
        self._monitor = None
        self.layer_ids = None
        if enabled and cfg is not None:
            from moetune.train.trackers import check_trackers

            check_trackers(cfg)  # a tracker asked for and not installed fails now, not at the first step
            self.layer_ids = moe_layer_ids(cfg)
            self._monitor = ExpertLoadMonitor(cfg.logging.alarm_dead_intervals, cfg.logging.alarm_max_over_mean,
                                              self.layer_ids)

    def write(self, record: dict) -> None:
        if self._f is None:
            return
        try:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()
        except OSError as e:  # disk full: the run stops with a line that says so (its last checkpoint is intact)
            raise OutputError(f"cannot write {self.path}: {e}") from None
        if self._monitor is not None and "expert_counts" in record:
            alarm = self._monitor.update(record)
            if alarm:
                log.warning("step %s: expert load: %s", record.get("step"), alarm)
        self._to_trackers(record)

    def _to_trackers(self, record: dict) -> None:
        if self._trackers is None:  # created at the first record: a resumed run knows from which step to purge
            from moetune.train.trackers import build_trackers

            try:
                self._trackers = build_trackers(self.cfg, self.run_dir, self.append, int(record.get("step", 0)))
            except OSError as e:  # as for a failed log call below: a dashboard problem never ends a run
                log.warning("trackers could not start (%s): metrics go to metrics.jsonl only", e)
                self._trackers = []
        if not self._trackers or "step" not in record:
            return
        scalars = tracker_scalars(record, self.layer_ids)
        images = {"experts/load_heatmap": load_heatmap_image(record["expert_counts"])} if record.get("expert_counts") else None
        for t in list(self._trackers):
            try:
                t.log(int(record["step"]), scalars, images)
            except Exception as e:  # a dashboard hiccup must not end a training run; metrics.jsonl has it all
                log.warning("tracker %s failed (%s): no longer logging to it", type(t).__name__, e)
                self._trackers.remove(t)

    def close(self, failed: bool = False):
        """Close metrics.jsonl and the trackers: TensorBoard's writer thread writes what is queued and ends, W&B's run
        finishes. failed: the run ended in an error (W&B marks it so)."""
        try:
            if self._f is not None:
                f, self._f = self._f, None
                try:
                    f.close()
                except OSError as e:
                    raise OutputError(f"cannot write {self.path}: {e}") from None
        finally:
            for t in self._trackers or []:
                try:
                    t.close(failed)
                except Exception as e:  # a tracker's final flush (disk full): metrics.jsonl has everything
                    log.warning("tracker %s failed on close (%s)", type(t).__name__, e)
            self._trackers = []


def _truncate_after(path: Path, step: int) -> None:
    """Drop the records of steps after `step`, atomically (rewrite to a temporary name, rename)."""
    if not path.is_file():
        return
    lines = [ln for ln in path.read_text().splitlines() if _record_step(ln) <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w") as f:
        f.write("".join(ln + "\n" for ln in lines))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _record_step(line: str) -> float:
    try:
        return json.loads(line).get("step", 0)
    except ValueError:  # empty, or the torn last line of a killed process
        return float("inf")


class Throughput:
    def __init__(self):
        self.t = time.perf_counter()

    def lap(self, device: torch.device) -> float:
        """Seconds since the last lap, once the compute stream has run what was queued. Only that stream: a device-wide
        synchronize would also wait for the bad-step guard's copy of the LoRA state to host memory, which runs on its
        own stream under the next step's compute (with LoRA on the experts of AIR-8 it added 42 ms to a 119 ms step,
        BENCHMARKS.md)."""
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt


class ExpertMeter:
    """Tokens per expert and router entropy per MoE layer, summed over a logging interval (`every` steps; 0 = off)."""

    def __init__(self, model, dist, every: int):
        self.layers, self.dist, self.every = model.moe_layers(), dist, every
        n_experts = model.config.n_routed_experts
        self.counts = torch.zeros(len(self.layers), n_experts, device=dist.device, dtype=torch.long)
        self.entropy = torch.zeros(len(self.layers) + 1, device=dist.device, dtype=torch.float64)  # + micro-batches

    def add(self) -> None:
        # one stacked add, not one per layer: on a GPU each is a kernel launch the step's host time pays for
        if self.layers:
            self.counts += torch.stack([m.last_counts for m in self.layers])
        tracked = [i for i, m in enumerate(self.layers) if m.track_router_entropy]
        if tracked:
            self.entropy[tracked] += torch.stack([self.layers[i].last_router_entropy for i in tracked]).double()
        self.entropy[-1] += 1

    def record(self, step: int) -> dict:
        if not (self.every and step % self.every == 0 and self.layers):
            return {}
        out = expert_load_stats(self.dist.all_reduce_sum(self.counts).cpu())
        ent = self.dist.all_reduce_sum(self.entropy).cpu()
        out["router_entropy"] = [round(float(x), 4) for x in ent[:-1] / ent[-1].clamp(min=1)]
        self.counts.zero_()
        self.entropy.zero_()
        return out
