"""The training loop. Reads top to bottom: take the run directory, check what files can tell (resume), build data and
model, load the checkpoint, then for each step: train_step, log, evaluate, checkpoint; then the adapter."""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field

import torch

from moetune.version import __version__
from moetune.config import Config, config_hash, config_to_yaml
from moetune.errors import NumericalFault, RunDirInUse
from moetune.model.adapter_io import gather_lora_state, save_adapter
from moetune.model.lora import format_trainable_table
from moetune.model.random_base import base_recipe
from moetune.names import IGNORE_INDEX
from moetune.parallel.grads import clip_grad_norm as clip_global_grad_norm, fsdp_micro_batch, sync_replicated_grads
from moetune.parallel.layout import Layout, memory_limit, resolve_layout
from moetune.parallel.mesh import Dist, init_distributed, launch_world_size
from moetune.run_dir import CONFIG, RunDir, RunLock, move_earlier_run_aside
from moetune.train.bad_steps import StepGuard
from moetune.train.checkpoint import Checkpointer, load_checkpoint
from moetune.train.checkpoint_files import plan_resume, remove_debris
from moetune.train.data_setup import setup_data
from moetune.train.metrics import (MetricsWriter, Throughput, device_peak_flops, expert_load_stats, memory_gib,
                                   mfu)
from moetune.train.optim import build_optimizer, build_scheduler
from moetune.train.progress import progress
from moetune.train.setup import setup_model
from moetune.train.signals import StopSignals
from moetune.train.states import JsonState, ModelState, OptimizerState, RngState, SchedulerState
from moetune.train.trackers import check_trackers

log = logging.getLogger("moetune")

# TrainState fields a checkpoint stores and a resume restores
RESTORED_FIELDS = ("step", "tokens", "best_eval_loss", "eval_losses", "skipped_steps")


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    tokens: int = 0  # tokens seen (all ranks, padding included: what the GPUs processed)
    best_eval_loss: float | None = None
    eval_losses: list = field(default_factory=list)
    skipped_steps: int = 0


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    aux_loss: float | None
    tokens: int
    good: bool  # the update was kept


def train(cfg: Config) -> TrainState:
    # Routing resizes the expert buffers every step; the caching allocator's fixed segments then fragment (3.6 GiB
    # reserved but unusable at the OOM of a full-size Air run on 2 GPUs). Before CUDA starts; the user's setting wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    # the layout is resolved once, from the config, the world size and the GPU's memory; all that follows takes it
    layout = resolve_layout(cfg, launch_world_size(), memory_limit(cfg, int(os.environ.get("LOCAL_RANK", 0))))
    dist = init_distributed(layout)
    setup_logging(dist)
    if dist.is_main:
        log.info(layout.describe())
    lock = take_run_dir(cfg, dist)  # one trainer per run directory, before anything in it is read or touched
    signals = StopSignals()  # installed until the adapter is written: a late signal changes nothing
    try:
        return _train(cfg, dist, layout, signals, lock)
    finally:
        signals.close()
        lock.release()


def _train(cfg: Config, dist: Dist, layout: Layout, signals: StopSignals, lock: RunLock) -> TrainState:
    run = RunDir(cfg.run_dir)
    torch.manual_seed(cfg.run.seed)
    # Inputs first: a refused resume, bad data or a bad checkpoint stops the run before the run dir is written.
    try:
        plan = plan_resume(cfg, dist.world_size, dist.dp_size)  # files only: nothing built yet
        check_trackers(cfg)  # a missing tracker package fails now, not after minutes of model building
        data = setup_data(cfg, dist)
        model = setup_model(cfg, dist, layout)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = build_optimizer(params, cfg.optim, dist.device)
        scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
        states = {"model": ModelState(model, cfg.finetune.mode == "full"), "optim": OptimizerState(model, optimizer),
                  "scheduler": SchedulerState(scheduler), "loader": JsonState(data.loader, "loader"),
                  "rng": RngState(dist.rank, dist.device)}
        state = TrainState()
        if plan is not None:
            load_checkpoint(plan.path, states, dist)
            for name in RESTORED_FIELDS:
                if name in plan.trainer_state:
                    setattr(state, name, plan.trainer_state[name])
            state.eval_losses = [tuple(x) for x in state.eval_losses]
    except BaseException:
        if dist.is_main:
            lock.abandon_created_dir()  # a refused start leaves no trace
        raise

    # ---- the run starts: from here on it writes into its directory
    if dist.is_main:
        start_run_dir(cfg, run, plan)
        log.info("trainable parameters:\n%s", format_trainable_table(model))
    metrics = MetricsWriter(run.metrics, dist.is_main, append=plan is not None, cfg=cfg, resumed_step=state.step)
    ckpt = Checkpointer(run.checkpoints, cfg.checkpoint, dist, states, params,
                        files=lambda: {CONFIG: config_to_yaml(cfg)}, on_saved=metrics.write)
    ckpt.saved_step = state.step if plan is not None else None
    guard = StepGuard(params, optimizer, dist, rollback=cfg.finetune.mode == "lora")
    meter = ExpertMeter(model, dist, cfg.logging.expert_stats_every)
    peak = device_peak_flops(dist.device)
    bar = progress(cfg, dist.is_main, state.step)
    timer = Throughput()
    t_start = time.time()

    while state.step < cfg.train.steps:
        step = state.step + 1
        batches = [to_device(data.loader.next_batch(), dist.device) for _ in range(cfg.train.grad_accum)]
        result = train_step(model, optimizer, guard, batches, step, cfg, dist, meter)
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        state.step, state.tokens = step, state.tokens + result.tokens
        state.skipped_steps += not result.good
        last = step == cfg.train.steps

        # ---- log
        tps = result.tokens / timer.lap(dist.device)
        record = {"step": step, "loss": round(result.loss, 6), "lr": lr, "grad_norm": round(result.grad_norm, 6),
                  "tokens": state.tokens, "tokens_per_s": round(tps, 1),
                  "tokens_per_s_per_gpu": round(tps / dist.world_size, 1), "mem_gib": _r(memory_gib(dist.device))}
        if peak:
            record["mfu"] = round(mfu(tps / dist.world_size, model.config, cfg.finetune.mode == "full", peak), 4)
        if result.aux_loss is not None:
            record["aux_loss"] = round(result.aux_loss, 6)
        record.update(meter.record(step))
        if step % cfg.logging.every == 0 or last:
            metrics.write(record)
        bar.update(step, record)

        # ---- evaluate, stop, checkpoint
        if data.eval_batches and ((cfg.eval.every and step % cfg.eval.every == 0) or last):
            ev = evaluate(model, data.eval_batches, dist, cfg.eval.max_batches)
            state.eval_losses.append((step, ev))
            state.best_eval_loss = ev if state.best_eval_loss is None else min(state.best_eval_loss, ev)
            metrics.write({"step": step, "eval_loss": round(ev, 6)})
            bar.write(f"step {step}: eval loss {ev:.4f}")
        if guard.should_stop(cfg.checkpoint.max_bad_steps):
            stop_on_numerical_fault(cfg, state, guard, ckpt, trainer_state(cfg, state, dist, data.loader))
        stop = ckpt.agree(signals.received is not None)  # all ranks stop at the same step; async saves complete
        if ckpt.due(step, last, stop):
            ckpt.save(step, trainer_state(cfg, state, dist, data.loader))
        if stop:
            if dist.is_main:
                log.warning("stopping at step %d on %s; resume with resume: auto", step, signals.name())
            break
        timer.lap(dist.device)  # evaluation and checkpoint time are not training throughput

    bar.close()
    ckpt.finish()
    if cfg.finetune.mode == "lora":
        write_adapter(cfg, model, dist)
    metrics.close()
    if dist.is_main:
        summary(cfg, state, time.time() - t_start)
    return state


def train_step(model, optimizer, guard: StepGuard, batches: list[dict], step: int, cfg: Config, dist: Dist,
               meter: "ExpertMeter") -> StepResult:
    """One optimizer step. The loss is the mean over every target token of every micro-batch on every rank (not a mean
    of means), so 4 micro-batches of 1 equal 1 batch of 4 and 2 ranks equal 1. A non-finite loss, gradient norm or
    updated weight makes the step change nothing (bad_steps.py)."""
    model.train()
    moe_layers = model.moe_layers()
    n_targets = dist.all_reduce_sum(sum((b["labels"] != IGNORE_INDEX).sum() for b in batches).float())
    loss_sum = torch.zeros((), device=dist.device)
    aux_total = torch.zeros((), device=dist.device)
    for i, b in enumerate(batches):
        fsdp_micro_batch(model, last=i == len(batches) - 1, defer_reduce=cfg.finetune.mode != "full",
                         keep_gathered=not cfg.parallel.reshard_after_forward)
        ce = model(b["input_ids"], b["position_ids"], labels=b["labels"])
        loss = ce * dist.dp_size / n_targets.clamp(min=1)  # FSDP averages gradients over dp ranks
        if cfg.train.aux_loss_coef > 0:
            aux = torch.stack([m.last_aux_loss for m in moe_layers]).mean() / cfg.train.grad_accum
            loss = loss + cfg.train.aux_loss_coef * aux
            aux_total += aux.detach()
        loss.backward()
        loss_sum += ce.detach()
        meter.add()
    sync_replicated_grads(guard.params, dist)
    grad_norm = clip_grad_norm(guard.params, cfg.train.max_grad_norm)
    loss_val = (dist.all_reduce_sum(loss_sum) / n_targets.clamp(min=1)).item()
    good, applied, reason = math.isfinite(loss_val) and math.isfinite(grad_norm), False, ""
    if good:
        guard.before_update(step)
        optimizer.step()
        applied = True
        good = guard.weights_finite()
        reason = "" if good else "the update made a trainable weight non-finite"
    else:
        reason = f"non-finite loss {loss_val} / grad norm {grad_norm}"
    optimizer.zero_grad(set_to_none=True)
    guard.record(step, good, applied, reason)
    aux = dist.all_reduce_sum(aux_total).item() / dist.world_size if cfg.train.aux_loss_coef > 0 else None
    tokens = sum(b["input_ids"].numel() for b in batches) * dist.dp_size
    return StepResult(loss_val, grad_norm, aux, tokens, good)


def clip_grad_norm(params, max_norm: float) -> float:
    """Global gradient norm (DTensor-aware, expert parallelism included), clipped when max_norm > 0."""
    return clip_global_grad_norm(params, max_norm)


# ---------------------------------------------------------------------------------------------- the run directory
def take_run_dir(cfg: Config, dist: Dist) -> RunLock:
    """Rank 0 locks the run directory; every rank learns whether it could (one all-reduce)."""
    lock = RunLock(cfg.run_dir)
    error = None
    if dist.is_main:
        try:
            lock.acquire()
        except Exception as e:  # raised below on rank 0; the other ranks stop with it
            error = e
    failed = torch.tensor([0.0 if error is None else 1.0], device=dist.device)
    if dist.all_reduce_sum(failed).item():
        if error is not None:
            raise error
        raise RunDirInUse(f"rank 0 could not take the run directory {cfg.run_dir} (see its error)")
    return lock


def start_run_dir(cfg: Config, run: RunDir, plan) -> None:
    """The run is known to start (rank 0): a fresh run moves an earlier run's files aside (never overwrites them),
    removes unfinished saves of earlier processes, and writes the resolved config."""
    if plan is None and (earlier := move_earlier_run_aside(run.path)) is not None:
        log.warning("%s held an earlier run (resume: %s): it is moved, whole, to %s", run.path, cfg.resume, earlier)
    remove_debris(run.checkpoints)  # unfinished saves of an earlier process: never resumed from
    run.config.write_text(config_to_yaml(cfg))
    if plan is not None:
        for line in plan.allowed_changes:
            log.info("resume: changed since the checkpoint (applied): %s", line)
        log.info("resumed from %s at step %d", plan.path, plan.trainer_state.get("step", 0))
        if plan.trainer_state.get("step", 0) >= cfg.train.steps:
            log.warning("the checkpoint is at step %d and train.steps is %d: nothing to train; raise train.steps to "
                        "continue", plan.trainer_state.get("step", 0), cfg.train.steps)


def trainer_state(cfg: Config, state: TrainState, dist: Dist, loader) -> dict:
    return {**{k: getattr(state, k) for k in RESTORED_FIELDS},
            "config_hash": config_hash(cfg), "moetune_version": __version__,
            "torch_version": torch.__version__, "finetune_mode": cfg.finetune.mode,
            "world_size": dist.world_size, "device": dist.device.type,
            "global_batch": dist.dp_size * cfg.train.micro_batch_size * cfg.train.grad_accum,
            "data_position": loader.state_dict(), "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def stop_on_numerical_fault(cfg: Config, state: TrainState, guard: StepGuard, ckpt: Checkpointer, saved_state: dict):
    k = cfg.checkpoint.max_bad_steps
    what = (f"{guard.streak} bad steps (non-finite loss, gradient norm or weights; up to step {state.step}) without "
            f"two good steps in a row between them (checkpoint.max_bad_steps: {k})")
    if not guard.rollback:  # full fine-tuning: the weights may come from an update whose forward pass was not finite
        ckpt.finish()
        raise NumericalFault(f"stopping: {what}. Nothing is saved now; the newest checkpoint in "
                             f"{ckpt.root} is the last good state: resume from it with a lower optim.lr or "
                             "train.max_grad_norm, or look at the data of those steps")
    path = ckpt.save(state.step, saved_state)
    ckpt.finish()
    raise NumericalFault(
        f"stopping: {what}. The last good weights (those of step {guard.good_step}, whose forward pass was finite) "
        f"are saved in {path}; resume from it (resume: auto) with a lower optim.lr or train.max_grad_norm, or look "
        "at the data of those steps")


def write_adapter(cfg: Config, model, dist: Dist) -> None:
    lora = gather_lora_state(model)  # collective: every rank
    if dist.is_main:
        c = cfg.lora
        meta = dict(rank=c.rank, alpha=c.alpha, dropout=c.dropout, rslora=c.rslora, targets=list(c.targets))
        if cfg.model.quantize:
            meta["base_quantize"] = cfg.model.quantize
        if (recipe := base_recipe(cfg, dist.device.type)) is not None:
            meta["base_init"] = recipe  # a random-init base: what rebuilds it for export (model/random_base.py)
        save_adapter(lora, RunDir(cfg.run_dir).adapter, meta, base_model=cfg.model.path)


# ---------------------------------------------------------------------------------------------- measuring
class ExpertMeter:
    """Tokens per expert and router entropy per MoE layer, summed over a logging interval (`every` steps; 0 = off)."""

    def __init__(self, model, dist: Dist, every: int):
        self.layers, self.dist, self.every = model.moe_layers(), dist, every
        n_experts = model.config.n_routed_experts
        self.counts = torch.zeros(len(self.layers), n_experts, device=dist.device, dtype=torch.long)
        self.entropy = torch.zeros(len(self.layers) + 1, device=dist.device, dtype=torch.float64)  # + micro-batches

    def add(self) -> None:
        for i, m in enumerate(self.layers):
            self.counts[i] += m.last_counts
            if m.track_router_entropy:
                self.entropy[i] += m.last_router_entropy
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


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


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


def summary(cfg, state: TrainState, seconds: float) -> None:
    run = RunDir(cfg.run_dir)
    best = f"{state.best_eval_loss:.4f}" if state.best_eval_loss is not None else "n/a"
    print(f"done: {state.step} steps, {state.tokens:,} tokens in {seconds:.1f}s; best eval loss {best}"
          + (f"; {state.skipped_steps} steps skipped (non-finite)" if state.skipped_steps else ""))
    print(f"  run dir:  {run.path}")
    print(f"  metrics:  {run.metrics}")
    if cfg.finetune.mode == "lora":
        print(f"  adapter:  {run.adapter}")
    else:
        print(f"  weights:  {run.checkpoints}")


def _r(x):
    return None if x is None else round(x, 3)
