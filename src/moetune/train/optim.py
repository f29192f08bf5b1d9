"""AdamW (fused where the device has it) and the warm-up + decay schedule."""

from __future__ import annotations

import math

import torch

from moetune.errors import ConfigError


def build_optimizer(params, cfg_optim, device: torch.device) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ConfigError("nothing to train: no parameter requires grad (check finetune.mode and lora.targets)")
    fused = cfg_optim.fused if cfg_optim.fused is not None else device.type == "cuda"
    # Biases and norms get no weight decay, as usual. Expert-parallel experts outside FSDP are DTensors beside
    # plain replicated tensors, and the fused/foreach kernels cannot take both in one call: one group per kind.
    groups: dict[tuple[bool, bool], list] = {}
    for p in params:
        groups.setdefault((p.ndim >= 2, hasattr(p, "device_mesh")), []).append(p)
    return torch.optim.AdamW(
        [{"params": ps, "weight_decay": cfg_optim.weight_decay if decay else 0.0}
         for (decay, _), ps in sorted(groups.items(), key=lambda kv: (not kv[0][0], kv[0][1]))],
        lr=cfg_optim.lr, betas=tuple(cfg_optim.betas), eps=cfg_optim.eps, fused=fused or None)


def lr_lambda(step: int, total: int, warmup: int, kind: str, min_ratio: float) -> float:
    """Multiplier of the peak lr at `step` (0-based): linear warm-up, then cosine/linear decay to min_ratio."""
    warmup = min(warmup, total)
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    progress = min(progress, 1.0)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if kind == "cosine" else 1 - progress
    return min_ratio + (1 - min_ratio) * shape


def build_scheduler(optimizer, cfg_optim, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_lambda(s, total_steps, cfg_optim.warmup_steps, cfg_optim.scheduler, cfg_optim.min_lr_ratio),
    )
