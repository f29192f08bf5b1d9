"""A failure on one rank ends the whole job with its traceback, at once: the failing rank must not wait in a
shutdown barrier for ranks that wait in the collective it left (on 2 x H200 that looked like a silent hang)."""

import os
import subprocess
import sys
import time

from helpers import free_port, small_run_args

FAIL_HOOK = os.path.join(os.path.dirname(__file__), "fail_hook")


def test_a_failure_on_one_rank_ends_the_job_with_its_traceback(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MOETUNE_TEST_FAIL="1:2",
               PYTHONPATH=os.pathsep.join([FAIL_HOOK, os.environ.get("PYTHONPATH", "")]))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    args = small_run_args(tmp_path, "fails", **{"parallel.ep": 2, "train.micro_batch_size": 1})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "moetune", "train"] + args
    t = time.time()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode != 0
    out = p.stdout + p.stderr
    assert "RuntimeError: injected failure on rank 1 at step 2" in out, out[-3000:]
    assert "Traceback" in out
    # the other rank waits in a collective until the launcher stops it: seconds, not gloo's 30-minute timeout
    assert time.time() - t < 180
