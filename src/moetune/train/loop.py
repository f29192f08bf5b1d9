"""The training loop. Reads top to bottom: set up, then for each step accumulate, clip, step, log, evaluate,
checkpoint; then save the adapter and say where everything is."""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field

import torch

from moetune.config import Config, config_to_yaml
from moetune.model.lora import format_trainable_table
from moetune.names import IGNORE_INDEX
from moetune import parallel
from moetune.parallel import Dist, init_distributed
from moetune.train.data_setup import setup_data
from moetune.train.metrics import (MetricsWriter, Throughput, device_peak_flops, expert_load_stats, memory_gib,
                                   mfu)
from moetune.train.optim import build_optimizer, build_scheduler
from moetune.train.setup import setup_model
from moetune.train.trackers import check_trackers

log = logging.getLogger("moetune")


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    tokens: int = 0  # tokens seen (all ranks, padding included: what the GPUs processed)
    best_eval_loss: float | None = None
    eval_losses: list = field(default_factory=list)
    skipped_steps: int = 0
    bad_streak: int = 0  # consecutive non-finite steps; checkpoint.max_bad_steps of them stop the run


def train(cfg: Config) -> TrainState:
    dist = init_distributed(cfg.parallel.ep, cfg.parallel.dp_shard)
    setup_logging(dist)
    run_dir = cfg.run_dir
    torch.manual_seed(cfg.run.seed)

    # Inputs first: bad data or a bad checkpoint stops the run before anything in the run dir is touched.
    check_trackers(cfg)  # a missing tracker package fails now, not after minutes of model building
    data = setup_data(cfg, dist)
    model = setup_model(cfg, dist)
    if dist.is_main:
        os.makedirs(run_dir, exist_ok=True)
        (run_dir / "config.yaml").write_text(config_to_yaml(cfg))
    full = cfg.finetune.mode == "full"
    if dist.is_main:
        log.info("trainable parameters:\n%s", format_trainable_table(model))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg.optim, dist.device)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    moe_layers = model.moe_layers()
    for moe in moe_layers:
        moe.compute_aux_loss = cfg.train.aux_loss_coef > 0
        moe.track_router_entropy = cfg.logging.expert_stats_every > 0

    from moetune.train.checkpoint import Checkpointer

    ckpt = Checkpointer(cfg, dist, model, optimizer, scheduler, data.loader)
    state = ckpt.resume(TrainState())
    metrics = MetricsWriter(run_dir / "metrics.jsonl", dist.is_main, append=state.step > 0, cfg=cfg)
    ckpt.metrics = metrics  # each save logs {"step", "checkpoint_s", "checkpoint_bytes"}
    peak = device_peak_flops(dist.device)
    expert_counts = torch.zeros(len(moe_layers), model.config.n_routed_experts, device=dist.device, dtype=torch.long)
    entropy_sum = torch.zeros(len(moe_layers) + 1, device=dist.device, dtype=torch.float64)  # per layer + count
    bar = progress_bar(cfg, dist, state.step)
    timer = Throughput()
    t_start = time.time()

    while state.step < cfg.train.steps:
        model.train()
        # ---- one optimizer step: the loss is the mean over every target token of every micro-batch on every
        # rank (not a mean of means), so 4 micro-batches of 1 equal 1 batch of 4 and 2 ranks equal 1.
        batches = [to_device(data.loader.next_batch(), dist.device) for _ in range(cfg.train.grad_accum)]
        n_targets = dist.all_reduce_sum(sum((b["labels"] != IGNORE_INDEX).sum() for b in batches).float())
        loss_sum = torch.zeros((), device=dist.device)
        aux_total = torch.zeros((), device=dist.device)
        for i, b in enumerate(batches):
            parallel.fsdp_micro_batch(model, last=i == len(batches) - 1, defer_reduce=not full,
                                      keep_gathered=not cfg.parallel.reshard_after_forward)
            ce = model(b["input_ids"], b["position_ids"], labels=b["labels"])
            loss = ce * dist.dp_size / n_targets.clamp(min=1)  # FSDP averages gradients over dp ranks
            if cfg.train.aux_loss_coef > 0:
                aux = torch.stack([m.last_aux_loss for m in moe_layers]).mean() / cfg.train.grad_accum
                loss = loss + cfg.train.aux_loss_coef * aux
                aux_total += aux.detach()
            loss.backward()
            loss_sum += ce.detach()
            for i, m in enumerate(moe_layers):
                expert_counts[i] += m.last_counts
                if m.track_router_entropy:
                    entropy_sum[i] += m.last_router_entropy
            entropy_sum[-1] += 1
        parallel.sync_replicated_grads(params, dist)
        grad_norm = clip_grad_norm(params, cfg.train.max_grad_norm)
        loss_val = (dist.all_reduce_sum(loss_sum) / n_targets.clamp(min=1)).item()
        if not (math.isfinite(loss_val) and math.isfinite(grad_norm)):
            optimizer.zero_grad(set_to_none=True)  # a numerical fault: skip the update, count it
            state.skipped_steps += 1
            state.bad_streak += 1
            log.warning("step %d: non-finite loss %s / grad norm %s: update skipped", state.step + 1, loss_val, grad_norm)
        else:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            state.bad_streak = 0
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        state.step += 1
        step_tokens = sum(b["input_ids"].numel() for b in batches) * dist.dp_size
        state.tokens += step_tokens

        # ---- log
        dt = timer.lap(dist.device)
        tps = step_tokens / dt
        record = {"step": state.step, "loss": round(loss_val, 6), "lr": lr, "grad_norm": round(grad_norm, 6),
                  "tokens": state.tokens, "tokens_per_s": round(tps, 1),
                  "tokens_per_s_per_gpu": round(tps / dist.world_size, 1), "mem_gib": _r(memory_gib(dist.device))}
        if peak:
            record["mfu"] = round(mfu(tps / dist.world_size, model.config, full, peak), 4)
        if cfg.train.aux_loss_coef > 0:
            record["aux_loss"] = round(dist.all_reduce_sum(aux_total).item() / dist.world_size, 6)
        if cfg.logging.expert_stats_every and state.step % cfg.logging.expert_stats_every == 0 and moe_layers:
            record.update(expert_load_stats(dist.all_reduce_sum(expert_counts).cpu()))
            ent = dist.all_reduce_sum(entropy_sum).cpu()
            record["router_entropy"] = [round(float(x), 4) for x in ent[:-1] / ent[-1].clamp(min=1)]
            expert_counts.zero_()
            entropy_sum.zero_()
        if state.step % cfg.logging.every == 0 or state.step == cfg.train.steps:
            metrics.write(record)
        bar.update(1, loss=loss_val, tps=tps)

        # ---- evaluate, checkpoint
        last = state.step == cfg.train.steps
        if data.eval_batches and ((cfg.eval.every and state.step % cfg.eval.every == 0) or last):
            ev = evaluate(model, data.eval_batches, dist, cfg.eval.max_batches)
            state.eval_losses.append((state.step, ev))
            state.best_eval_loss = ev if state.best_eval_loss is None else min(state.best_eval_loss, ev)
            metrics.write({"step": state.step, "eval_loss": round(ev, 6)})
            bar.write(f"step {state.step}: eval loss {ev:.4f}")
        if state.bad_streak >= cfg.checkpoint.max_bad_steps:
            ckpt.stop_on_numerical_fault(state)  # saves the last good weights, then raises NumericalFault
        ckpt.maybe_save(state, last=last)  # also: all ranks agree on a stop signal, an async save completes
        if ckpt.stop_requested():
            break
        timer.lap(dist.device)  # evaluation and checkpoint time are not training throughput

    bar.close()
    ckpt.finish(state)
    metrics.close()
    if dist.is_main:
        summary(cfg, state, time.time() - t_start)
    return state


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def clip_grad_norm(params, max_norm: float) -> float:
    """Global gradient norm (DTensor-aware, expert parallelism included), clipped when max_norm > 0."""
    return parallel.clip_grad_norm(params, max_norm)


@torch.no_grad()
def evaluate(model, batches, dist: Dist, max_batches: int | None) -> float:
    """Token-mean loss over the held-out set; every rank runs the same number of batches (FSDP collectives)."""
    model.eval()
    total = torch.zeros(2, device=dist.device, dtype=torch.float64)
    for b in batches[:max_batches]:
        b = to_device(b, dist.device)
        total[0] += model(b["input_ids"], b["position_ids"], labels=b["labels"]).double()
        total[1] += (b["labels"] != IGNORE_INDEX).sum()
    dist.all_reduce_sum(total)
    model.train()
    return (total[0] / total[1].clamp(min=1)).item()


def setup_logging(dist: Dist) -> None:
    level = logging.INFO if dist.is_main else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", force=True)


class _NoBar:
    def update(self, n, **kw):
        pass

    def write(self, s):
        log.info(s)

    def close(self):
        pass


class _Bar:
    def __init__(self, total, initial):
        from tqdm.auto import tqdm

        self.t = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True)

    def update(self, n, loss, tps):
        self.t.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tps:,.0f}", refresh=False)
        self.t.update(n)

    def write(self, s):
        self.t.write(s)

    def close(self):
        self.t.close()


def progress_bar(cfg, dist: Dist, initial: int):
    return _Bar(cfg.train.steps, initial) if dist.is_main and cfg.logging.progress_bar else _NoBar()


def summary(cfg, state: TrainState, seconds: float) -> None:
    run_dir = cfg.run_dir
    best = f"{state.best_eval_loss:.4f}" if state.best_eval_loss is not None else "n/a"
    print(f"done: {state.step} steps, {state.tokens:,} tokens in {seconds:.1f}s; best eval loss {best}"
          + (f"; {state.skipped_steps} steps skipped (non-finite)" if state.skipped_steps else ""))
    print(f"  run dir:  {run_dir}")
    print(f"  metrics:  {run_dir / 'metrics.jsonl'}")
    if cfg.finetune.mode == "lora":
        print(f"  adapter:  {run_dir / 'adapter'}")
    else:
        print(f"  weights:  {run_dir / 'checkpoints'}")


def _r(x):
    return None if x is None else round(x, 3)
