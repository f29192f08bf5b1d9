"""The step API: a `Trainer` built from a config, stepped by whoever holds the data. `moetune train` (loop.py) is one
user of it, an RL loop another (examples/rl_vllm.py).

    trainer = Trainer(load_config("run.yaml", ["--optim.lr", "1e-5"]), data=False)   # any world size (torchrun)
    with trainer:
        ref = trainer.reference_logprobs(batch)          # the base without the adapter (LoRA off: no extra memory)
        out = trainer.step({**batch, "ref_logprobs": ref}, loss_fn=my_loss)
        out.loss, out.metrics, out.logprobs              # logprobs of the given tokens, before the update
        if out.stop: ...                                 # a signal asked for a stop (a checkpoint is written)

A batch is a dict of [B, T] tensors (or a list of them: micro-batches of one optimizer step, gradients accumulated):
    input_ids     the tokens                           labels     the token each position predicts (already shifted,
    position_ids  optional (packing: restart at 0)                -100 = not a target)
    weights       optional per-token weights (default 1 on every target; 0 wherever labels is -100)
    anything else (advantages, behaviour logprobs, a reference's logprobs): handed to loss_fn, [B, T] or [B, ...]
`loss_fn(logprobs, weights, batch) -> per_token_loss` (or `(per_token_loss, {name: value})`, the values logged):
logprobs [B, T] are log p(labels) in fp32 with their graph (0 off target). The step minimises
Σ weights·per_token_loss / Σ weights over every token of every micro-batch on every rank, so micro-batches and
ranks change nothing (a per-sequence mean is weights = 1/len). Without loss_fn the loss is the weighted
cross-entropy; with neither loss_fn nor weights it is `moetune train`'s fused cross-entropy (no [T, V] logits).
Memory: logprobs come from each micro-batch's whole logits [B, T, V] (plus an fp32 copy of them when the model
computes in bf16): size micro-batches for that (151k vocabulary: ~0.6 MB fp32 per token); the fused path never
forms them.

Per step, as in `moetune train`: the bad-step guard (a non-finite loss, gradient norm or update changes nothing,
and too many stop with the last good weights saved), metrics.jsonl, evaluation (when built with data), checkpoints
every checkpoint.every steps and on a stop signal, resume (`resume: auto` continues at the saved step).
"""

from __future__ import annotations

import logging
import math
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch

from moetune.config import Config, config_hash, config_to_yaml
from moetune.errors import ConfigError, DataError, NumericalFault, OutputError, RunDirInUse
from moetune.model.adapter_io import gather_lora_state, save_adapter
from moetune.model.attention import check_attn_implementation
from moetune.model.lora import ExpertLoRA, LoRALinear, format_trainable_table
from moetune.model.random_base import base_recipe
from moetune.names import IGNORE_INDEX
from moetune.parallel.grads import clip_grad_norm as clip_global_grad_norm, fsdp_micro_batch, sync_replicated_grads
from moetune.parallel.layout import memory_limit, resolve_layout
from moetune.parallel.mesh import Dist, init_distributed, launch_world_size
from moetune.run_dir import CONFIG, RunDir, RunLock, move_earlier_run_aside
from moetune.train.bad_steps import StepGuard
from moetune.train.checkpoint import Checkpointer, load_checkpoint
from moetune.train.checkpoint_files import plan_resume, remove_debris
from moetune.train.data_setup import setup_data
from moetune.train.determinism import Determinism
from moetune.train.garbage import GarbageCollection
from moetune.train.memory_snapshot import MemorySnapshot
from moetune.train.metrics import (AllocatorPressure, ExpertMeter, MetricsWriter, Throughput, device_peak_flops,
                                   memory_gib, mfu)
from moetune.train.optim import build_optimizer, build_scheduler
from moetune.train.progress import progress
from moetune.train.setup import setup_model
from moetune.train.signals import StopSignals
from moetune.train.states import JsonState, ModelState, OptimizerState, RngState, SchedulerState
from moetune.train.step_profile import StepProfile, phase
from moetune.train.trackers import check_trackers
from moetune.version import __version__

log = logging.getLogger("moetune")

# TrainState fields a checkpoint stores and a resume restores
RESTORED_FIELDS = ("step", "tokens", "best_eval_loss", "eval_losses", "skipped_steps")
_BATCH_KEYS = ("input_ids", "labels", "position_ids", "weights")  # what the trainer reads; the rest is loss_fn's

LossFn = Callable[[torch.Tensor, torch.Tensor, dict], "torch.Tensor | tuple[torch.Tensor, dict]"]


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    tokens: int = 0  # tokens seen (all ranks, padding included: what the GPUs processed)
    best_eval_loss: float | None = None
    eval_losses: list = field(default_factory=list)
    skipped_steps: int = 0


@dataclass
class StepOutput:
    step: int
    loss: float  # the step's loss, averaged as it was minimised (all micro-batches, all ranks)
    metrics: dict  # the step's metrics.jsonl record (loss, lr, grad_norm, tokens/s, memory, loss_fn's values, ...)
    logprobs: list | torch.Tensor | None  # log p(labels) before the update: [B, T] (a list for micro-batches); None
    #                                       on the fused path, which never forms them
    good: bool  # the update was kept (False: the bad-step guard undid it)
    stop: bool = False  # a stop signal was received: a checkpoint is written; end the loop


class Trainer:
    def __init__(self, cfg: Config, data: bool = True):
        """data: build the config's data (train loader, eval set: what `next_batches` and evaluation use, and whose
        position checkpoints hold); False for a caller that brings every batch (RL)."""
        # Routing resizes the expert buffers every step; the caching allocator's fixed segments then fragment (3.6 GiB
        # reserved but unusable at the OOM of a full-size Air run on 2 GPUs). Before CUDA starts; the user's setting wins.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        self.cfg = cfg
        # the layout is resolved once, from the config, the world size and the GPU's memory; all that follows takes it
        self.layout = resolve_layout(cfg, launch_world_size(), memory_limit(cfg, int(os.environ.get("LOCAL_RANK", 0))))
        self.dist = dist = init_distributed(self.layout)
        setup_logging(dist)
        if dist.is_main:
            log.info(self.layout.describe())
        self.lock = take_run_dir(cfg, dist)  # one trainer per run directory, before anything in it is read or touched
        self.signals = StopSignals()  # installed until the adapter is written: a late signal changes nothing
        self.determinism = Determinism(cfg.train.deterministic)  # before anything is built or compiled
        try:
            self._build(data)
        except BaseException:
            self.determinism.close()
            self.signals.close()
            self.lock.release()
            raise

    def _build(self, with_data: bool) -> None:
        cfg, dist = self.cfg, self.dist
        run = RunDir(cfg.run_dir)
        torch.manual_seed(cfg.run.seed)
        # Inputs first: a refused resume, bad data or a bad checkpoint stops the run before the run dir is written.
        try:
            plan = plan_resume(cfg, dist.world_size, dist.dp_size)  # files only: nothing built yet
            check_trackers(cfg)  # a missing tracker package fails now, not after minutes of model building
            check_attn_implementation(cfg.model.attn_implementation, dist.device)  # so does a missing FA4
            self.data = setup_data(cfg, dist) if with_data else None
            check_recorded_steps(cfg, plan.trainer_state.get("step", 0) if plan is not None else 0)
            self.model = model = setup_model(cfg, dist, self.layout)
            self.params = [p for p in model.parameters() if p.requires_grad]
            # Under CUDA graphs a layer's weight gradients are the graph's own output buffers, which the next replay
            # overwrites: gradients that exist before backward are accumulated into instead of taken over (and stay).
            if cfg.train.cuda_graphs:
                for p in self.params:
                    p.grad = torch.zeros_like(p)
            self.optimizer = build_optimizer(self.params, cfg.optim, dist.device)
            self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
            states = {"model": ModelState(model, cfg.finetune.mode == "full"),
                      "optim": OptimizerState(model, self.optimizer), "scheduler": SchedulerState(self.scheduler),
                      "rng": RngState(dist.rank, dist.device)}
            if self.data is not None:
                states["loader"] = JsonState(self.data.loader, "loader")
            self.state = TrainState()
            if plan is not None:
                load_checkpoint(plan.path, states, dist)
                for name in RESTORED_FIELDS:
                    if name in plan.trainer_state:
                        setattr(self.state, name, plan.trainer_state[name])
                self.state.eval_losses = [tuple(x) for x in self.state.eval_losses]
        except BaseException:
            if dist.is_main:
                self.lock.abandon_created_dir()  # a refused start leaves no trace
            raise

        # ---- the run starts: from here on it writes into its directory
        if dist.is_main:
            start_run_dir(cfg, run, plan)
            log.info("trainable parameters:\n%s", format_trainable_table(model))
        self.metrics = MetricsWriter(run.metrics, dist.is_main, append=plan is not None, cfg=cfg,
                                     resumed_step=self.state.step)
        self.ckpt = Checkpointer(run.checkpoints, cfg.checkpoint, dist, states, self.params,
                                 files=lambda: {CONFIG: config_to_yaml(cfg)}, on_saved=self.metrics.write)
        self.ckpt.saved_step = self.state.step if plan is not None else None
        self.guard = StepGuard(self.params, self.optimizer, dist, rollback=cfg.finetune.mode == "lora")
        self.meter = ExpertMeter(model, dist, cfg.logging.expert_stats_every)
        self.peak = device_peak_flops(dist.device)
        self.bar = progress(cfg, dist.is_main, self.state.step)
        self.timer = Throughput()
        self.pressure = AllocatorPressure(dist.device)
        self.snapshot = MemorySnapshot(dist.device, cfg.logging.memory_snapshot_step,
                                       os.path.join(cfg.run_dir, "memory_snapshot"), dist.rank)
        self.profile = StepProfile(dist.device, cfg.logging.profile_step, os.path.join(cfg.run_dir, "profile"),
                                   dist.rank)
        self.gc = GarbageCollection(cfg.train.gc_every)
        self.t_start = time.time()
        self.stopped = False

    # ------------------------------------------------------------------------------------------ the API
    def next_batches(self) -> list[dict]:
        """The config's data: the micro-batches (train.grad_accum) of the next step."""
        if self.data is None:
            raise ConfigError("this Trainer was built with data=False: hand step() your own batches")
        return [self.data.loader.next_batch() for _ in range(self.cfg.train.grad_accum)]

    def step(self, batch: dict | list[dict], loss_fn: LossFn | None = None) -> StepOutput:
        """One optimizer step on `batch` (a dict, or a list of micro-batches), then what follows a step in
        `moetune train`: the metrics record, evaluation, the bad-step stop, checkpoint and stop-signal handling."""
        cfg, dist, state = self.cfg, self.dist, self.state
        batches = [to_device(b, dist.device) for b in check_batches(batch, self.model.config.vocab_size)]
        step = state.step + 1
        self.snapshot.begin(step)
        self.profile.begin(step)
        try:
            loss, grad_norm, aux, user, logprobs, good = self._compute(batches, step, loss_fn)
        finally:  # also when the step fails: an out-of-memory step's allocator history is the one to look at
            self.profile.end(step)
            self.snapshot.end(step)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        tokens = sum(b["input_ids"].numel() for b in batches) * dist.dp_size
        state.step, state.tokens = step, state.tokens + tokens
        state.skipped_steps += not good
        last = step == cfg.train.steps

        # ---- log
        tps = tokens / self.timer.lap(dist.device)
        record = {"step": step, "loss": round(loss, 6), "lr": lr, "grad_norm": round(grad_norm, 6),
                  "tokens": state.tokens, "tokens_per_s": round(tps, 1),
                  "tokens_per_s_per_gpu": round(tps / dist.world_size, 1), "mem_gib": _r(memory_gib(dist.device))}
        if self.peak:
            record["mfu"] = round(mfu(tps / dist.world_size, self.model.config, cfg.finetune.mode == "full", self.peak), 4)
        if aux is not None:
            record["aux_loss"] = round(aux, 6)
        record.update({k: round(v, 6) for k, v in user.items()})
        record.update(self.meter.record(step))
        record.update(self.pressure.record(step))
        if step % cfg.logging.every == 0 or last:
            self.metrics.write(record)
        self.bar.update(step, record)

        # ---- evaluate, stop, checkpoint
        data = self.data
        if data is not None and data.eval_batches and ((cfg.eval.every and step % cfg.eval.every == 0) or last):
            ev = evaluate(self.model, data.eval_batches, dist, cfg.eval.max_batches)
            state.eval_losses.append((step, ev))
            state.best_eval_loss = ev if state.best_eval_loss is None else min(state.best_eval_loss, ev)
            self.metrics.write({"step": step, "eval_loss": round(ev, 6)})
            self.bar.write(f"step {step}: eval loss {ev:.4f}")
        if self.guard.should_stop(cfg.checkpoint.max_bad_steps):
            stop_on_numerical_fault(cfg, state, self.guard, self.ckpt, self.trainer_state())
        stop = self.ckpt.agree(self.signals.received is not None)  # all ranks stop at one step; async saves complete
        if self.ckpt.due(step, last, stop):
            self.ckpt.save(step, self.trainer_state())
        if stop:
            self.stopped = True
            if dist.is_main:
                log.warning("stopping at step %d on %s; resume with resume: auto", step, self.signals.name())
        self.gc.step(step)
        self.timer.lap(dist.device)  # evaluation, checkpoint and collection time are not training throughput
        lp = logprobs[0] if logprobs is not None and isinstance(batch, dict) else logprobs
        return StepOutput(step, loss, record, lp, good, stop)

    @torch.no_grad()
    def logprobs(self, batch: dict, adapter: bool = True) -> torch.Tensor:
        """log p(labels) [B, T] (fp32, 0 off target) under the current weights, or (adapter=False) under the base."""
        if not isinstance(batch, dict):
            raise DataError("logprobs and reference_logprobs take one batch (a dict of [B, T] tensors)")
        (b,) = [to_device(b, self.dist.device) for b in check_batches(batch, self.model.config.vocab_size)]
        if not adapter and self.cfg.finetune.mode != "lora":
            raise ConfigError("reference logprobs are the base without the adapter: they need finetune.mode: lora "
                              "(full fine-tuning changes the base itself)")
        was_training = self.model.training
        self.model.eval()
        try:
            with lora_disabled(self.model) if not adapter else nullcontext():
                return self.model(b["input_ids"], b.get("position_ids"), labels=b["labels"], per_token=True)
        finally:
            self.model.train(was_training)

    def reference_logprobs(self, batch: dict) -> torch.Tensor:
        """log p(labels) [B, T] under the base model: the adapter switched off, no copy of any weight."""
        return self.logprobs(batch, adapter=False)

    def trainer_state(self) -> dict:
        cfg, loader = self.cfg, self.data.loader if self.data is not None else None
        return {**{k: getattr(self.state, k) for k in RESTORED_FIELDS},
                "config_hash": config_hash(cfg), "moetune_version": __version__,
                "torch_version": torch.__version__, "finetune_mode": cfg.finetune.mode,
                "world_size": self.dist.world_size, "device": self.dist.device.type,
                "global_batch": self.dist.dp_size * cfg.train.micro_batch_size * cfg.train.grad_accum,
                "data_position": loader.state_dict() if loader is not None else None,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    def close(self) -> None:
        """The end of a run: pending checkpoint writes complete, the adapter (LoRA) is written, the summary printed;
        the signal handlers and the run directory's lock are given back."""
        try:
            self.bar.close()
            self.ckpt.finish()
            if self.cfg.finetune.mode == "lora":
                write_adapter(self.cfg, self.model, self.dist)
            self.metrics.close()
            if self.dist.is_main:
                summary(self.cfg, self.state, time.time() - self.t_start)
        finally:
            self._release()

    def _release(self) -> None:
        self.determinism.close()
        self.gc.close()
        self.signals.close()
        self.lock.release()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        # a failed run writes no adapter from weights nobody checked; its checkpoints stay, and what it logged reaches
        # metrics.jsonl and the dashboards (the steps that led to the error are the ones its user reads)
        try:
            self.metrics.close(failed=True)
        except OutputError as e:  # the run's own error is the one to report
            log.warning("%s", e)
        finally:
            self._release()

    # ------------------------------------------------------------------------------------------ one step
    def _compute(self, batches: list[dict], step: int, loss_fn: LossFn | None):
        """Forward, backward and update. The loss is the weighted mean over every target token of every micro-batch on
        every rank (not a mean of means), so 4 micro-batches of 1 equal 1 batch of 4 and 2 ranks equal 1. A
        non-finite loss, gradient norm or updated weight makes the step change nothing (bad_steps.py)."""
        cfg, dist, model = self.cfg, self.dist, self.model
        if not model.training:  # train() walks every module (~10 ms of host time a step on GLM-4.7-Flash's 47 layers)
            model.train()
        fused = loss_fn is None and not any("weights" in b for b in batches)
        weights = [b["weights"].float() * (b["labels"] != IGNORE_INDEX) if "weights" in b
                   else (b["labels"] != IGNORE_INDEX).float() for b in batches]
        total = dist.all_reduce_sum(sum(w.sum() for w in weights).float())
        denom = total.clamp(min=1) if fused else torch.where(total > 0, total, torch.ones_like(total))
        moe_layers = model.moe_layers()
        loss_sum = torch.zeros((), device=dist.device)
        aux_total = torch.zeros((), device=dist.device)
        user_sums: dict[str, torch.Tensor] = {}
        logprobs = None if fused else []
        for i, (b, w) in enumerate(zip(batches, weights)):
            fsdp_micro_batch(model, last=i == len(batches) - 1, defer_reduce=cfg.finetune.mode != "full",
                             keep_gathered=not cfg.parallel.reshard_after_forward)
            if fused:
                with phase("forward"):
                    summed = model(b["input_ids"], b.get("position_ids"), labels=b["labels"])
            else:
                with phase("forward"):
                    lp = model(b["input_ids"], b.get("position_ids"), labels=b["labels"], per_token=True)
                per_token, user = -lp, {}
                if loss_fn is not None:
                    per_token, user = _loss_output(loss_fn(lp, w, b), lp.shape)
                summed = torch.where(w != 0, per_token * w, 0.0).sum()
                for k, v in user.items():  # per-token values: weighted sums (divided by the weight below)
                    v = torch.as_tensor(v, device=dist.device).detach().float()
                    s = (v * w).sum() if v.shape == w.shape else v * w.sum()
                    user_sums[k] = user_sums.get(k, torch.zeros((), device=dist.device)) + s
                logprobs.append(lp.detach())
            loss = summed * dist.dp_size / denom  # FSDP averages gradients over dp ranks
            if cfg.train.aux_loss_coef > 0:
                aux = torch.stack([m.last_aux_loss for m in moe_layers]).mean() / len(batches)
                loss = loss + cfg.train.aux_loss_coef * aux
                aux_total += aux.detach()
            with phase("backward"):
                if i == 0:
                    self.guard.start_copy()  # the rollback copy's transfer runs under the backward
                loss.backward()
            loss_sum += summed.detach()
            self.meter.add()
        with phase("grad_norm"):
            sync_replicated_grads(self.params, dist)
            grad_norm = clip_grad_norm(self.params, cfg.train.max_grad_norm)
            loss_val = (dist.all_reduce_sum(loss_sum) / denom).item()
        good, applied, reason = math.isfinite(loss_val) and math.isfinite(grad_norm), False, ""
        if good:
            with phase("guard_snapshot"):
                self.guard.before_update(step)
            with phase("optimizer"):
                self.optimizer.step()
            applied = True
            with phase("guard_check"):
                good = self.guard.weights_finite()
            reason = "" if good else "the update made a trainable weight non-finite"
        else:
            reason = f"non-finite loss {loss_val} / grad norm {grad_norm}"
        self.optimizer.zero_grad(set_to_none=not cfg.train.cuda_graphs)
        with phase("guard_record"):
            self.guard.record(step, good, applied, reason)
        aux = dist.all_reduce_sum(aux_total).item() / dist.world_size if cfg.train.aux_loss_coef > 0 else None
        user = {k: (dist.all_reduce_sum(v) / denom).item() for k, v in sorted(user_sums.items())}
        return loss_val, grad_norm, aux, user, logprobs, good


def check_recorded_steps(cfg: Config, resumed_step: int) -> None:
    """A step chosen for a profile or memory snapshot is one this run will take: past train.steps is an error
    (before the model is built), one a resumed run has already taken a warning."""
    for key in ("profile_step", "memory_snapshot_step"):
        at = getattr(cfg.logging, key)
        if at > cfg.train.steps:
            raise ConfigError(f"logging.{key}: step {at} is past the run's last step (train.steps {cfg.train.steps}); "
                              f"nothing would be recorded")
        if 0 < at <= resumed_step:
            log.warning("logging.%s: step %d was taken before this run resumed at step %d; nothing is recorded",
                        key, at, resumed_step)


def clip_grad_norm(params, max_norm: float) -> float:
    """Global gradient norm (DTensor-aware, expert parallelism included), clipped when max_norm > 0."""
    return clip_global_grad_norm(params, max_norm)


def _loss_output(out, shape) -> tuple[torch.Tensor, dict]:
    per_token, user = out if isinstance(out, tuple) else (out, {})
    if not torch.is_tensor(per_token) or tuple(per_token.shape) != tuple(shape):
        got = list(per_token.shape) if torch.is_tensor(per_token) else type(per_token).__name__
        raise DataError(f"loss_fn returned {got}: it must return the per-token loss, shaped like the logprobs "
                        f"{list(shape)} (the trainer takes the weighted mean over the step's tokens)")
    if not isinstance(user, dict):
        raise DataError(f"loss_fn's second return value is a {type(user).__name__}: a dict {{name: value}} to log")
    return per_token, user


def check_batches(batch, vocab_size: int) -> list[dict]:
    """The batch as a list of micro-batches, each checked: what would otherwise fail deep in the model (a shape
    mismatch, a token outside the vocabulary) is named here."""
    batches = [batch] if isinstance(batch, dict) else list(batch)
    if not batches or not all(isinstance(b, dict) for b in batches):
        raise DataError("a batch is a dict of tensors (input_ids, labels, ...) or a non-empty list of them")
    for i, b in enumerate(batches):
        where = f"batch[{i}]" if len(batches) > 1 else "batch"
        for key in ("input_ids", "labels"):
            if key not in b:
                raise DataError(f"{where} has no {key!r} (it has {sorted(b)})")
        ids = b["input_ids"]
        if not torch.is_tensor(ids) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise DataError(f"{where}['input_ids'] must be an integer tensor [batch, tokens]; it is "
                            f"{_describe(ids)}")
        for key, v in b.items():
            if key == "input_ids" or not torch.is_tensor(v):
                continue
            want = tuple(ids.shape) if key in _BATCH_KEYS else tuple(ids.shape[:1])
            if tuple(v.shape[: len(want)]) != want or (key in _BATCH_KEYS and v.dim() != 2):
                raise DataError(f"{where}[{key!r}] has shape {list(v.shape)} but input_ids has {list(ids.shape)}: "
                                + ("it must be the same" if key in _BATCH_KEYS else "it must start with the batch size"))
        for key, t in (("input_ids", ids), ("labels", torch.where(b["labels"] == IGNORE_INDEX, 0, b["labels"]))):
            bad = t[(t < 0) | (t >= vocab_size)]
            if bad.numel():
                raise DataError(f"{where}[{key!r}] holds token id {int(bad[0])}, outside the model's vocabulary "
                                f"(0..{vocab_size - 1}; -100 marks a label that is not a target)")
        if "weights" in b and not torch.isfinite(b["weights"]).all():
            raise DataError(f"{where}['weights'] holds a non-finite value")
    return batches


def _describe(v) -> str:
    return f"{v.dtype} of shape {list(v.shape)}" if torch.is_tensor(v) else type(v).__name__


@contextmanager
def lora_disabled(model):
    """The base model: every LoRA branch scaled by 0 (exactly its base output; no weight is copied or freed)."""
    mods = [m for m in model.modules() if isinstance(m, (LoRALinear, ExpertLoRA))]
    saved = [m.scaling for m in mods]
    for m in mods:
        m.scaling = 0.0
    try:
        yield
    finally:
        for m, s in zip(mods, saved):
            m.scaling = s


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


# ---------------------------------------------------------------------------------------------- helpers
def to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


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
