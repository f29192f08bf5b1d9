"""The bad-step policy: a step whose loss, gradient norm or updated weights are not finite changes nothing, and
the last update before it is undone as well; too many of them stop the run with the last good weights.

Why the previous update too: a learning rate that is far too high makes an update whose weights are finite but
huge (|w| ~ 1e30); the fault shows only in the next forward pass (a non-finite loss). So a weight counts as good
once a forward pass on it was finite, and a bad step rolls the trainable state (weights and optimizer moments) back
to before the last applied update. Only a copy of the trainable state before each update makes that possible
(the simplest correct option: AdamW cannot be reversed once a weight overflowed). With LoRA that copy is kept on
the device, 12 bytes per LoRA parameter (weights and both moments in fp32, counted by the memory estimate), and
refreshed in place. Full fine-tuning keeps no copy (it would double the optimizer
memory): a bad step there is skipped without rollback, and the run stops at once, saving nothing, when an
update made a weight non-finite; the newest checkpoint is then the last good state.

The streak: a bad step adds one; it restarts at 0 only after two good steps in a row (a rolled-back update
followed by the same blow-up would otherwise alternate forever). `checkpoint.max_bad_steps` of them stop the run.
"""

from __future__ import annotations

import logging

import torch

from moetune.errors import NumericalFault
from moetune.tensors import all_finite, local_tensor

log = logging.getLogger("moetune")


class StepGuard:
    def __init__(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer, dist, rollback: bool):
        self.params, self.optimizer, self.dist, self.rollback = params, optimizer, dist, rollback
        self.streak = 0
        self.skipped = 0  # bad steps, for the summary
        self.good_step: int | None = None  # the step whose weights the snapshot (or, full: the model) holds
        self._snapshot: tuple[list, dict] | None = None
        self._previous_good = True

    # ---- around the optimizer step
    def before_update(self, step: int) -> None:
        """Remember the trainable state before the update of `step` (1-based); its weights are those of step-1."""
        if not self.rollback:
            return
        with torch.no_grad():
            if self._snapshot is None:
                params = [local_tensor(p).detach().clone() for p in self.params]
            else:
                params = self._snapshot[0]
                torch._foreach_copy_(params, [local_tensor(p).detach() for p in self.params])
            self._snapshot = (params, self._copy_optimizer_state(self._snapshot[1] if self._snapshot else {}))
        self.good_step = step - 1

    def weights_finite(self) -> bool:
        """Every trainable weight finite on every rank: one fused check and one all-reduce of one number."""
        bad = (~all_finite(self.params)).float().reshape(1).to(self.dist.device)
        return self.dist.all_reduce_sum(bad).item() == 0

    # ---- after it
    def record(self, step: int, good: bool, update_applied: bool, reason: str = "") -> None:
        if good:
            if self._previous_good:
                self.streak = 0
            self._previous_good = True
            return
        self._previous_good = False
        self.streak += 1
        self.skipped += 1
        undone = self._undo(update_applied)
        log.warning("step %d: %s: update skipped%s", step, reason or "non-finite values",
                    f"; the trainable state is back to that of step {self.good_step}" if undone else "")

    def should_stop(self, max_bad: int) -> bool:
        return self.streak >= max_bad

    def _undo(self, update_applied: bool) -> bool:
        if self._snapshot is None:
            if update_applied:  # full fine-tuning: a non-finite weight cannot be taken back
                raise NumericalFault("an optimizer update made a trainable weight non-finite (full fine-tuning keeps "
                                     "no copy to roll back to); nothing was saved. Resume from the newest "
                                     "checkpoint (resume: auto) with a lower optim.lr or train.max_grad_norm")
            return False
        params, opt_state = self._snapshot
        with torch.no_grad():
            torch._foreach_copy_([local_tensor(p) for p in self.params], params)
            self._restore_optimizer_state(opt_state)
        return True

    def _copy_optimizer_state(self, into: dict) -> dict:
        """The optimizer state, copied into the previous snapshot's tensors where it has them: a new copy every
        step would hold two at once (for expert LoRA of full-size Air on 2 GPUs, 4.8 GB more at each update)."""
        out = {}
        for p in self.params:
            st = self.optimizer.state.get(p)
            if not st:
                continue
            old = into.get(p, {})
            out[p] = {}
            for k, v in st.items():
                if not torch.is_tensor(v):
                    out[p][k] = v
                elif torch.is_tensor(old.get(k)) and old[k].shape == local_tensor(v).shape:
                    out[p][k] = old[k].copy_(local_tensor(v).detach())
                else:
                    out[p][k] = local_tensor(v).detach().clone()
        return out

    def _restore_optimizer_state(self, saved: dict) -> None:
        for p in self.params:
            if p not in saved:
                self.optimizer.state.pop(p, None)  # before the first update AdamW had no state for it
                continue
            st = self.optimizer.state[p]
            for k, v in saved[p].items():
                if torch.is_tensor(v) and torch.is_tensor(st.get(k)):
                    local_tensor(st[k]).copy_(v)
                else:
                    st[k] = v
