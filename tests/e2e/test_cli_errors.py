"""Bad input through the real command line: clear errors naming the file:line or the config key, exit != 0,
and nothing written to the run directory before the input is known to be good."""

import os
import subprocess
import sys

from helpers import small_run_args, write_chat_jsonl


def _moetune(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "moetune", *args], capture_output=True, text=True, env=env, timeout=120)


def test_malformed_jsonl_names_file_and_line(tmp_path):
    data = tmp_path / "bad.jsonl"
    write_chat_jsonl(data, n=5)
    with open(data, "a") as f:
        f.write('{"messages": [{"role": "user", "content": "hi"}\n')  # line 6: truncated JSON
    args = small_run_args(tmp_path, "bad", **{"data.train": str(data)})
    p = _moetune("train", *args)
    assert p.returncode != 0
    assert f"{data}:6:" in p.stderr
    assert not (tmp_path / "runs" / "bad" / "metrics.jsonl").exists()


def test_skip_malformed_trains_and_counts(tmp_path):
    data = tmp_path / "bad.jsonl"
    write_chat_jsonl(data, n=20)
    with open(data, "a") as f:
        f.write("not json\n")
    args = small_run_args(tmp_path, "skip", **{"data.train": str(data), "data.skip_malformed": "true",
                                               "train.steps": 1})
    p = _moetune("train", *args)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "'skipped_malformed': 1" in p.stderr


def test_misspelt_config_key_is_named_with_suggestion(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("optim:\n  lr: 1.0e-4\ntrain:\n  stpes: 3\n")
    p = _moetune("train", str(cfg))
    assert p.returncode == 2
    assert "train.stpes" in p.stderr and "train.steps" in p.stderr and "cfg.yaml" in p.stderr
    p = _moetune("train", "--optim.lrr", "1e-4")
    assert p.returncode == 2 and "optim.lrr" in p.stderr and "optim.lr" in p.stderr


def test_empty_dataset_is_a_clear_error(tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("\n")
    p = _moetune("train", *small_run_args(tmp_path, "empty", **{"data.train": str(data)}))
    assert p.returncode != 0
    assert "empty" in p.stderr.lower() and str(data) in p.stderr


def test_every_sample_too_long_is_a_clear_error(tmp_path):
    data = tmp_path / "long.jsonl"
    write_chat_jsonl(data, n=4, min_len=40, max_len=50)
    p = _moetune("train", *small_run_args(tmp_path, "long", **{"data.train": str(data), "data.seq_len": 16}))
    assert p.returncode != 0
    assert "seq_len" in p.stderr and str(data) in p.stderr


def test_lora_target_matching_nothing_is_an_error(tmp_path):
    # every layer MoE (first_k_dense_replace 0) and LoRA asked on the dense MLP
    p = _moetune("train", *small_run_args(tmp_path, "nodense", **{
        "model.config": "{first_k_dense_replace: 0, vocab_size: 160, hidden_size: 64, intermediate_size: 96, "
                        "moe_intermediate_size: 32, num_hidden_layers: 2, num_attention_heads: 4, "
                        "num_key_value_heads: 2, head_dim: 16, n_routed_experts: 4, num_experts_per_tok: 2}",
        "lora.targets": "[q_proj,dense_mlp]"}))
    assert p.returncode != 0
    assert "dense_mlp" in p.stderr and "match no module" in p.stderr


def test_sigterm_after_the_last_step_completes_the_run(tmp_path):
    """Issue 13.9: a signal while the final checkpoint and adapter are written changes nothing: exit 0, adapter
    written (the handlers used to be given back first, and the process died of the signal, 143)."""
    script = tmp_path / "late_signal.py"
    script.write_text(
        "import os, signal, sys\n"
        "import safetensors.torch as st\n"  # the adapter is the last thing written (checkpoints are DCP)
        "real = st.save_file\n"
        "def late(*a, **k):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return real(*a, **k)\n"
        "st.save_file = late\n"
        "from moetune.cli import main\n"
        "if __name__ == '__main__':\n"
        "    sys.exit(main(sys.argv[1:]))\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(script), "train", *small_run_args(tmp_path, "late", **{"train.steps": 2})],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "SIGTERM" in p.stderr and (tmp_path / "runs" / "late" / "adapter" / "adapter_model.safetensors").is_file()


def test_batch_jobs_get_plain_progress_lines(tmp_path):
    """Issue 12.6: stdout not a terminal: a plain line every logging.every steps, and no tqdm carriage returns."""
    p = _moetune("train", *small_run_args(tmp_path, "lines", **{"train.steps": 4, "logging.every": 2,
                                                                "logging.progress_bar": "true"}))
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if "| loss " in ln]
    assert [ln.split("step ")[1].split(" ")[0] for ln in lines] == ["2/4", "4/4"], lines
    for field in ("tok/s", "mem ", "ETA ", "lr "):
        assert field in lines[0]
    assert "\r" not in p.stderr + p.stdout


def test_user_errors_are_one_line_and_bugs_keep_their_traceback(tmp_path):
    p = _moetune("train", "--run.name", "../escape", "--run.output_dir", str(tmp_path))
    assert p.returncode == 2 and "Traceback" not in p.stderr and "run.name" in p.stderr
    assert not (tmp_path.parent / "escape").exists()
    p = _moetune("export", "adapter", "--checkpoint", str(tmp_path / "nothing"), "--out", str(tmp_path / "o"))
    assert p.returncode == 1 and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    # a bug (here: a ValueError from inside the loop) is not a user error: it keeps its traceback
    script = tmp_path / "bug.py"
    script.write_text("import sys\nfrom moetune.train import loop\n"
                      "def broken(*a, **k):\n    raise ValueError('a bug')\n"
                      "loop.setup_model = broken\nfrom moetune.cli import main\n"
                      "if __name__ == '__main__':\n    sys.exit(main(sys.argv[1:]))\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(script), "train", *small_run_args(tmp_path, "bug")], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 1 and "Traceback" in p.stderr and "ValueError: a bug" in p.stderr
