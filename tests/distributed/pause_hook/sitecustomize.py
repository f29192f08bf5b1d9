"""Test-only: Python runs this at start-up when its folder is first on PYTHONPATH. If MOETUNE_TEST_PAUSE is
"step_000004:30", the process sleeps 30 s after that checkpoint's files are written and before it is renamed to
its final name, so that a test can kill or signal a run at a known point of a save. Production code has no hook."""

import os

_SPEC = os.environ.get("MOETUNE_TEST_PAUSE")
if _SPEC:
    import time

    from moetune.train import checkpoint_files

    _name, _, _seconds = _SPEC.partition(":")
    _real_publish = checkpoint_files.publish

    def _paused_publish(tmp, final):
        if final.name == _name:
            time.sleep(float(_seconds or 60))
        _real_publish(tmp, final)

    checkpoint_files.publish = _paused_publish  # before moetune.train.checkpoint imports the name
