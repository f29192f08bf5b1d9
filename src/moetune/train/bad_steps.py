"""The bad-step policy: a step whose loss, gradient norm or updated weights are not finite changes nothing, and
the last update before it is undone as well; too many of them stop the run with the last good weights.

Why the previous update too: a learning rate that is far too high makes an update whose weights are finite but
huge (|w| ~ 1e30); the fault shows only in the next forward pass (a non-finite loss). So a weight counts as good
once a forward pass on it was finite, and a bad step rolls the trainable state (weights and optimizer moments) back
to before the last applied update. Only a copy of the trainable state before each update makes that possible
(the simplest correct option: AdamW cannot be reversed once a weight overflowed). With LoRA that copy (weights and
both AdamW moments, 12 bytes per LoRA parameter) is kept in host memory, double-buffered and filled under the next
step's compute (see StepGuard). Full fine-tuning keeps no copy (it would double the optimizer memory): a bad step
there is skipped without rollback, and the run stops at once, saving nothing, when an update made a weight
non-finite; the newest checkpoint is then the last good state.

The streak: a bad step adds one; it restarts at 0 only after two good steps in a row (a rolled-back update
followed by the same blow-up would otherwise alternate forever). `checkpoint.max_bad_steps` of them stop the run.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext

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
        # The copy lives in host memory, twice: `_snapshot` holds the state before the last applied update (what a
        # bad step restores) while `_next` receives the state after it, copied on a side stream while the next
        # step's backward runs (`start_copy`); the next update swaps them. It costs no GPU memory (for expert LoRA
        # of full-size Air on 2 GPUs, 6.9 GiB per rank). Where it runs matters once it is large (expert LoRA of
        # full-size Air on one GPU: 13.7 GB in 3,300 tensors, ~0.27 s over PCIe): launched by the training thread
        # after the update, it kept the GPU waiting for the next forward (0.92 s a step); launched from a worker
        # thread under the next forward, which is bound by the host's launches, 0.88 s; under the backward, which
        # is bound by the GPU and longer than the transfer, 0.85 s (BENCHMARKS.md, seventh session).
        self._snapshot: tuple[list, dict] | None = None
        self._next: tuple[list, dict] | None = None
        self._next_step: int | None = None  # the update whose result `_next` holds (None: nothing usable)
        self._copied = None  # CUDA event: the copy into `_next` has finished
        self._pending: Future | None = None  # the worker's launch of that copy
        self._due: int | None = None  # the good update whose result is still to be copied (by start_copy)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moetune-rollback-copy")
        cuda = any(local_tensor(p).is_cuda for p in params)
        self._stream = torch.cuda.Stream() if cuda else None
        self._previous_good = True

    # ---- around the optimizer step
    def before_update(self, step: int) -> None:
        """Make the snapshot the trainable state before the update of `step` (1-based): its weights are those of
        step-1."""
        if not self.rollback:
            return
        self.start_copy()  # where no backward came since the last update (a caller's own step), now
        self._settle()
        if self._next_step == step - 1:  # copied after the previous update, while this step ran
            self._snapshot, self._next = self._next, self._snapshot
        else:  # the first update, or after a bad step: copy now
            self._snapshot = self._copy_state(self._snapshot, asynchronous=False)
        self._next_step = None
        self.good_step = step - 1

    def start_copy(self) -> None:
        """Start copying the state the last good update produced into `_next` (the next update's snapshot), if not
        yet begun: called before a step's backward, so that on the GPU the transfer runs under it, after the
        forward queued so far. Nothing changes that state until the next update, which waits for the copy."""
        if self._due is None:
            return
        self._settle()
        if self._stream is not None:  # the side stream's copies follow what this thread has queued so far
            self._stream.wait_stream(torch.cuda.current_stream())
        self._pending = self._worker.submit(self._copy_on_worker, self._next)
        self._next_step, self._due = self._due, None

    def _copy_on_worker(self, into: tuple[list, dict] | None) -> tuple[list, dict]:
        if self._stream is None:
            return self._copy_state(into, asynchronous=False)
        with torch.cuda.device(self._stream.device):  # a new thread's current device is 0, not this rank's
            return self._copy_state(into, asynchronous=True)

    def _settle(self) -> None:
        """Wait for the copy into `_next`: its launch on the worker thread, then (GPU) the copies themselves."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._next = pending.result()
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def weights_finite(self) -> bool:
        """Every trainable weight finite on every rank: one fused check and one all-reduce of one number."""
        bad = (~all_finite(self.params)).float().reshape(1).to(self.dist.device)
        return self.dist.all_reduce_sum(bad).item() == 0

    # ---- after it
    def record(self, step: int, good: bool, update_applied: bool, reason: str = "") -> None:
        if good:
            if update_applied and self.rollback:
                self._due = step
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
        self._settle()
        self._due = None
        self._next_step = None  # the copy just made holds weights that are being undone
        with torch.no_grad():
            for p, saved in zip(self.params, params):
                local_tensor(p).copy_(saved)
            self._restore_optimizer_state(opt_state)
        return True

    def _copy_state(self, into: tuple[list, dict] | None, asynchronous: bool) -> tuple[list, dict]:
        """The trainable weights and the optimizer state, copied into host tensors (`into`'s where it has them:
        no new memory per step). Asynchronous: queued on the side stream (which the caller made wait for the
        update), finished when `_copied` is. One `_foreach_copy_` for all of them: its per-tensor launches run
        without the GIL, which the training thread needs meanwhile."""
        live = [local_tensor(p).detach() for p in self.params]
        params = into[0] if into is not None else [self._host_like(t) for t in live]
        dsts, srcs = list(params), list(live)
        opt = self._optimizer_state_buffers(into[1] if into is not None else {}, dsts, srcs)
        with torch.no_grad(), (torch.cuda.stream(self._stream) if asynchronous else nullcontext()):
            if dsts:
                torch._foreach_copy_(dsts, srcs, non_blocking=asynchronous)
            if asynchronous:
                self._copied = torch.cuda.Event()
                self._copied.record(self._stream)
        return params, opt

    def _host_like(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self._stream is not None)

    def _optimizer_state_buffers(self, into: dict, dsts: list, srcs: list) -> dict:
        """The host copy of the optimizer state: `into`'s buffers where their shapes hold, the values not tensors
        as they are; each (buffer, tensor) pair to copy is appended to `dsts`, `srcs`."""
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
                    continue
                v = local_tensor(v).detach()
                buf = old.get(k)
                if not (torch.is_tensor(buf) and buf.shape == v.shape and buf.dtype == v.dtype):
                    buf = self._host_like(v)
                out[p][k] = buf
                dsts.append(buf)
                srcs.append(v)
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
                    st[k] = v.to(local_tensor(p).device) if torch.is_tensor(v) else v
