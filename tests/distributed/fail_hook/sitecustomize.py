"""Test-only: Python runs this at start-up when its folder is first on PYTHONPATH. If MOETUNE_TEST_FAIL is "1:2",
rank 1 raises before the optimizer update of step 2 while the other ranks go on into their next collective: a
failure on one rank only (an out-of-memory error, say). Production code has no hook."""

import os

_SPEC = os.environ.get("MOETUNE_TEST_FAIL")
if _SPEC:
    from moetune.train import bad_steps

    _rank, _, _step = _SPEC.partition(":")
    _real = bad_steps.StepGuard.before_update

    def _failing(self, step):
        if os.environ.get("RANK") == _rank and step == int(_step):
            raise RuntimeError(f"injected failure on rank {_rank} at step {step}")
        _real(self, step)

    bad_steps.StepGuard.before_update = _failing
