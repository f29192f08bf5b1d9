"""`moetune train`: supervised fine-tuning as one user of the step API (trainer.py). The Trainer takes the run
directory, checks what files can tell (resume), builds data and model and loads the checkpoint; each step then
trains, logs, evaluates and checkpoints; closing it writes the adapter."""

from __future__ import annotations

from moetune.config import Config
from moetune.train.trainer import Trainer, TrainState


def train(cfg: Config) -> TrainState:
    with Trainer(cfg) as trainer:
        while trainer.state.step < cfg.train.steps and not trainer.stopped:
            trainer.step(trainer.next_batches())
    return trainer.state
