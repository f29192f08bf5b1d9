"""Checkpoints. (Interim: the final adapter only; DCP checkpoints and resume land with the checkpoint issue.)"""

from __future__ import annotations

import logging

from moetune.model.adapter_io import gather_lora_state, save_adapter

log = logging.getLogger("moetune")


class Checkpointer:
    def __init__(self, cfg, dist, model, optimizer, scheduler, loader):
        self.cfg, self.dist, self.model = cfg, dist, model
        self.optimizer, self.scheduler, self.loader = optimizer, scheduler, loader

    def resume(self, state):
        if self.cfg.resume not in ("none", "auto"):
            raise NotImplementedError("resume from a path is not implemented yet")
        return state

    def maybe_save(self, state, last: bool = False):
        pass

    def stop_requested(self) -> bool:
        return False

    def finish(self, state):
        if self.cfg.finetune.mode == "lora":
            lora = gather_lora_state(self.model)
            if self.dist.is_main:
                c = self.cfg.lora
                save_adapter(lora, self.cfg.run_dir / "adapter",
                             dict(rank=c.rank, alpha=c.alpha, dropout=c.dropout, rslora=c.rslora, targets=list(c.targets)),
                             base_model=self.cfg.model.path)
