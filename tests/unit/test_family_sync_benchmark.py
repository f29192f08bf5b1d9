"""benchmarks/weight_sync.py's GLM-5 rehearsal on the CPU (2 gloo processes, widths / 8): it runs, and what it
reports for the integrator's GPU run holds — the sender's transient under the plan's bound, fp8 halving the experts'
wire bytes, a MoE layer the largest group (as at full width)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import free_port

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "weight_sync.py"


def test_glm5_rehearsal_on_cpu(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(BENCH), "--device", "cpu", "--shape", "glm5", "--scale-down", "8", "--layers", "2", "--iters", "1",
           "--out", str(tmp_path)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    out = json.loads((tmp_path / "weight_sync.json").read_text())
    assert out["shapes"] == "glm5 / 8" and out["layers"] == 2
    rows = out["rows"]
    bf16, fp8 = rows["sync bf16"], rows["sync fp8"]
    for r in (bf16, fp8):
        assert 0 < r["tracked_peak"] <= r["bound"]
    # one MoE layer of GLM-5 / 8: its 32 experts × 3 × 256 × 768 in bf16, then in fp8 (+ block scales), plus the
    # MLA, indexer and shared expert (bf16 in both, a larger share at this width than at full width)
    experts = 32 * 3 * 256 * 768
    assert 2 * experts <= bf16["largest_layer"] < 2.5 * experts
    assert experts <= fp8["largest_layer"] < 1.5 * experts
    assert bf16["largest_layer"] - fp8["largest_layer"] >= 0.95 * experts
    assert fp8["bytes"] < bf16["bytes"] and not rows["gather-everything bf16"]["failed"]
    assert "transient per sync" in p.stdout
