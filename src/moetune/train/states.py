"""The parts of a training checkpoint, each a Stateful (state_dict / load_state_dict) that DCP saves and loads
in place, as torchtitan's `states`: the checkpointer knows none of their fields.

    model      the trainable parameters (LoRA only when the base is frozen; everything in full fine-tuning)
    optim      AdamW moments and step counts, keyed by parameter name
    scheduler  the schedule's position;  loader  the data position (epoch, packs served)
    rng        each rank's RNG states (torch CPU/CUDA, python, numpy), under rng.rank{R}

Our small entries are JSON text, never pickles of ours. DCP itself pickles its `.metadata` index and stores
non-tensor entries with torch.save; moetune/checkpoint_reading.py decides what of those may be unpickled.
"""

from __future__ import annotations

import json
import random
import sys

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from moetune.errors import CheckpointError


class ModelState:
    def __init__(self, model, full: bool):
        self.model, self.full = model, full

    def _options(self, loading: bool) -> StateDictOptions:
        # LoRA: the frozen base is not part of the checkpoint, so loading must not expect it (strict=False); DCP
        # itself still fails on any requested tensor the checkpoint lacks.
        return StateDictOptions(ignore_frozen_params=not self.full, strict=self.full or not loading)

    def state_dict(self) -> dict:
        sd = get_model_state_dict(self.model, options=self._options(loading=False))
        if not self.full:  # the frozen base (and its buffers) is reloaded from the HF checkpoint, not saved
            trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
            sd = {k: v for k, v in sd.items() if k in trainable}
        return sd

    def load_state_dict(self, sd: dict) -> None:
        set_model_state_dict(self.model, sd, options=self._options(loading=True))


class OptimizerState:
    """The optimizer's state from the checkpoint; its hyperparameters (betas, eps, weight decay, the schedule's
    peak lr) from the current config, so a changed value is applied on resume."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, sd: dict) -> None:
        hyper = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in self.optimizer.param_groups]
        set_optimizer_state_dict(self.model, self.optimizer, sd)
        for group, h in zip(self.optimizer.param_groups, hyper):
            group.update(h)


class SchedulerState:
    """The schedule's position; the lr is recomputed from the current peak lr (initial_lr). DCP loads entries in
    sorted key order, so "optim" (which restores initial_lr from the config) is loaded before "scheduler"."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def state_dict(self) -> dict:
        return {"json": json.dumps(self.scheduler.state_dict())}  # lr_lambdas: [None] for plain functions

    def load_state_dict(self, sd: dict) -> None:
        sched = self.scheduler
        sched.load_state_dict(_json_entry(sd, "scheduler"))
        sched.last_epoch -= 1
        sched.base_lrs = [g["initial_lr"] for g in sched.optimizer.param_groups]
        sched.step()  # recomputes every group's lr (and get_last_lr) at the saved position, as the run would have


class JsonState:
    """An object with a small JSON-able state_dict (the data loader)."""

    def __init__(self, obj, what: str):
        self.obj, self.what = obj, what

    def state_dict(self) -> dict:
        return {"json": json.dumps(self.obj.state_dict())}

    def load_state_dict(self, sd: dict) -> None:
        self.obj.load_state_dict(_json_entry(sd, self.what))


class RngState:
    """This rank's RNG states under rank{R}; a rank the checkpoint's run did not have is left out of the load (the
    caller drops the entry) and keeps its seeded state."""

    def __init__(self, rank: int, device: torch.device):
        self.key, self.device = f"rank{rank}", device

    def state_dict(self) -> dict:
        state = {"torch": torch.get_rng_state().tolist(), "python": _py_state(random.getstate())}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device).tolist()
        if "numpy" in sys.modules:  # only if something imported it: never import numpy for this
            kind, keys, pos, has_gauss, gauss = sys.modules["numpy"].random.get_state()
            state["numpy"] = [kind, keys.tolist(), pos, has_gauss, gauss]
        return {self.key: json.dumps(state)}

    def load_state_dict(self, sd: dict) -> None:
        state = _json_entry({"json": sd[self.key]}, f"rng.{self.key}")
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        if self.device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8), self.device)
        if "numpy" in state:
            import numpy

            kind, keys, pos, has_gauss, gauss = state["numpy"]
            numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, gauss))


def _py_state(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _json_entry(sd: dict, what: str) -> dict:
    raw = sd.get("json") if isinstance(sd, dict) else None
    if not isinstance(raw, str):
        raise CheckpointError(f"checkpoint entry {what!r} is not JSON text (a checkpoint of an older moetune?)")
    return json.loads(raw)
