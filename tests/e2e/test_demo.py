"""The README's quickstart as a newcomer runs it: `moetune train` with no arguments (the embedded demo trains on
the CPU and its eval loss clearly falls), then, from runs/demo with no extra flags, the exports (PEFT, vLLM,
merged) with --verify, and `moetune generate` on the run directory."""

import json
import os
import subprocess
import sys

import moetune
from helpers import eval_losses, step_losses


def cli(*args, cwd, timeout=900):
    env = dict(os.environ, OMP_NUM_THREADS="2")
    return subprocess.run([sys.executable, "-m", "moetune", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_demo_trains_then_exports_and_generates_with_no_extra_flags(tmp_path):
    p = cli("train", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    run = tmp_path / "runs" / "demo"
    ev = eval_losses(run)
    assert len(ev) == 4  # every 50 of 200 steps
    assert ev[-1] < 0.5 * ev[0], ev
    assert len(step_losses(run)) == 200
    for name in ("config.yaml", "metrics.jsonl", "adapter/adapter_model.safetensors", "adapter/adapter_config.json"):
        assert (run / name).exists(), name
    assert "run dir:" in p.stdout and "adapter:" in p.stdout

    for fmt in ("peft", "vllm"):
        p = cli("export", "adapter", "--checkpoint", "runs/demo", "--out", f"out/{fmt}", "--format", fmt,
                    "--verify", cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-3000:]
        assert "verify: PASS" in p.stdout, p.stdout
        assert (tmp_path / "out" / fmt / "adapter_model.safetensors").is_file()
    p = cli("export", "merged", "--checkpoint", "runs/demo", "--out", "out/merged", "--verify", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "verify: PASS" in p.stdout and "float32" in p.stdout, p.stdout
    assert json.loads((tmp_path / "out" / "merged" / "config.json").read_text())["architectures"] == ["Glm4MoeForCausalLM"]
    assert (tmp_path / "out" / "merged" / "tokenizer.json").is_file()

    p = cli("generate", "runs/demo", "--prompt", "upper: abcdef", "--max-new-tokens", "10", cwd=tmp_path)
    assert p.returncode == 0 and p.stdout.strip().isupper(), (p.stdout, p.stderr[-3000:])
    # the same from Python. The demo task is upper-casing; after its 200 steps the model gets most letters right
    # (an untrained one: about none), so that is what a newcomer sees
    model, tokenizer = moetune.load_for_generation(str(run))
    words = ["abcdef", "jihg", "cafe", "bead", "hija", "ggaaj", "dcba", "fedcb", "hecjab", "aij"]
    replies = [moetune.generate(model, f"upper: {w}", tokenizer, max_new_tokens=10) for w in words]
    letters = sum(a == b for w, r in zip(words, replies) for a, b in zip(w.upper(), r)) / sum(map(len, words))
    assert letters > 0.6 and sum(r == w.upper() for w, r in zip(words, replies)) >= 3, replies
