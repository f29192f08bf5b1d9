"""Numbers a user trusts: metrics.jsonl, tokens/s, MFU, memory, expert load per layer."""

from __future__ import annotations

import json
import math
import os
import time

import torch

from moetune.model.config import ModelConfig

# Dense bf16 peak of the datasheet (MFU's denominator, as in ../shared/reference); None = unknown device.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "B200": 2250e12}


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def active_matmul_params(cfg: ModelConfig) -> int:
    """Matmul parameters one token passes through: attention, dense MLP or (top-k + shared) experts and
    router, lm_head. Embedding lookups and norms are not matmuls."""
    H, D = cfg.hidden_size, cfg.head_dim
    attn = H * D * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
    total = cfg.vocab_size * H
    for i in range(cfg.num_hidden_layers):
        total += attn
        if cfg.is_moe_layer(i):
            expert = 3 * H * cfg.moe_intermediate_size
            total += expert * (cfg.num_experts_per_tok + cfg.n_shared_experts) + cfg.n_routed_experts * H
        else:
            total += 3 * H * cfg.intermediate_size
    return total


def mfu(tokens_per_s: float, cfg: ModelConfig, full_finetune: bool, peak: float | None) -> float | None:
    """MFU with 4·P flops per token for LoRA (no weight gradients of the frozen base), 6·P for full tuning."""
    if not peak:
        return None
    return (6 if full_finetune else 4) * active_matmul_params(cfg) * tokens_per_s / peak


def memory_gib(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # host peak RSS (KiB on Linux)
    except ImportError:  # pragma: no cover
        return None


def expert_load_stats(counts: torch.Tensor) -> dict:
    """Per-layer statistics of tokens-per-expert counts [L, E] summed over a logging interval."""
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


class MetricsWriter:
    """metrics.jsonl, one JSON object per line, written by rank 0 only and flushed each line, so that
    `moetune plot` and `tail -f` work on a run that is still going."""

    def __init__(self, path: str | os.PathLike, enabled: bool, append: bool = False):
        self.enabled = enabled
        self._f = open(path, "a" if append else "w") if enabled else None

    def write(self, record: dict) -> None:
        if self._f is not None:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()

    def close(self):
        if self._f is not None:
            self._f.close()


class Throughput:
    def __init__(self):
        self.t = time.perf_counter()

    def lap(self, device: torch.device) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt
