"""SIGTERM / SIGUSR1: stop at the end of the current step with a checkpoint; the same signal again exits at once.

What a scheduler sees:
- `moetune train` (one process, or each torchrun worker) signalled during training saves a checkpoint at the end of
  the step, prints how to resume, and exits 0; `resume: auto` continues exactly. A signal after the last step (while
  the final checkpoint or the adapter is written) changes nothing: the run completes and exits 0.
- Under torchrun, signalling one worker stops every worker at the same step (the loop all-reduces the flag each
  step). Signalling the torchrun agent itself: the agent forwards the signal to the workers, which save and exit 0,
  but the agent then exits 1 (torch.distributed.elastic reports it as a failure, SignalException). The
  checkpoint is complete nonetheless: a requeued job resumes from it with `resume: auto`.
- The second signal restores the default handler and re-raises: the process dies of the signal (exit 128+N).
- A signal during work that can be abandoned (see moetune/interruptible.py: preparing the data, before any step) stops
  at once with one line and exit 128+N: there is nothing to checkpoint yet, and that work may outlast the grace period.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from moetune import interruptible
from moetune.errors import MoetuneError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StoppedBySignal(MoetuneError):
    """A stop signal ended work that can be abandoned (nothing of it is kept)."""

    def __init__(self, signum: int, what: str):
        super().__init__(f"{signal.Signals(signum).name} during {what}: stopped at once (no training step had run, "
                         "so there was nothing to checkpoint)")
        self.exit_code = 128 + signum


class StopSignals:
    """Installed for the whole run (until close()), including the final checkpoint and adapter writes."""

    def __init__(self):
        self.received: int | None = None
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._old[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.received is not None:  # the second signal: exit at once, as if we had no handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = signum
        what = interruptible.current()
        if what is not None:
            raise StoppedBySignal(signum, what)
        print(f"moetune: {signal.Signals(signum).name}: saving a checkpoint at the end of this step, then exiting "
              "(send it again to exit at once)", file=sys.stderr, flush=True)

    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else "another rank's signal"

    def close(self) -> None:
        """Give the handlers back (matters when train() runs inside a longer-lived process)."""
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
