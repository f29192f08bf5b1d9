"""`moetune train` with no arguments: the embedded demo trains on the CPU and its eval loss clearly falls."""

import os
import subprocess
import sys

from helpers import eval_losses, step_losses


def test_demo_trains_and_eval_loss_halves(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="2")
    p = subprocess.run([sys.executable, "-m", "moetune", "train"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    run = tmp_path / "runs" / "demo"
    ev = eval_losses(run)
    assert len(ev) == 4  # every 50 of 200 steps
    assert ev[-1] < 0.5 * ev[0], ev
    assert len(step_losses(run)) == 200
    for name in ("config.yaml", "metrics.jsonl", "adapter/adapter_model.safetensors", "adapter/adapter_config.json"):
        assert (run / name).exists(), name
    assert "run dir:" in p.stdout and "adapter:" in p.stdout
