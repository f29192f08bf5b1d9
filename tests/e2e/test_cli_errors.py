"""Bad input through the real command line: clear errors naming the file:line or the config key, exit != 0,
and nothing written to the run directory before the input is known to be good."""

import errno
import os
import shutil
import subprocess
import sys

import pytest

from helpers import run_inprocess, small_run_args, write_chat_jsonl
from moetune.cli import main


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
    script.write_text("import sys\nfrom moetune.train import trainer\n"
                      "def broken(*a, **k):\n    raise ValueError('a bug')\n"
                      "trainer.setup_model = broken\nfrom moetune.cli import main\n"
                      "if __name__ == '__main__':\n    sys.exit(main(sys.argv[1:]))\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(script), "train", *small_run_args(tmp_path, "bug")], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 1 and "Traceback" in p.stderr and "ValueError: a bug" in p.stderr


# --- a newcomer's mistakes after training: export, generate, resume ----------------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished tiny run on a random base, with a checkpoint at each of its 2 steps; its base rebuilt (RUN/base)."""
    tmp = tmp_path_factory.mktemp("trained")
    args = small_run_args(tmp, "t", **{"train.steps": 2, "checkpoint.every": 1})
    run = run_inprocess(args)
    assert main(["export", "adapter", "--checkpoint", str(run), "--out", str(tmp / "first")]) == 0
    assert (run / "base" / "config.json").is_file()
    return run, args


def _copy(run, tmp_path):
    dest = tmp_path / "run"
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns("base", ".lock"))
    return dest


def _user_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("export: ", "loading weights"))]


def test_an_export_never_writes_into_a_folder_of_the_users(trained, tmp_path, capsys):
    """`export merged` wrote its shards among the files of an existing --out (and exited 0); a missing --base or
    --checkpoint was a traceback. --out and --base are checked before any work (a random base is rebuilt first)."""
    run = _copy(trained[0], tmp_path)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "precious.txt").write_text("keep")
    for what in ("merged", "adapter"):
        assert main(["export", what, "--checkpoint", str(run), "--out", str(out)]) == 1
        err = capsys.readouterr().err
        assert _user_lines(err) == [f"moetune: error: --out {out}: exists and holds other files (precious.txt); "
                                    "choose an empty or new directory"], err
        assert sorted(os.listdir(out)) == ["precious.txt"] and (out / "precious.txt").read_text() == "keep"
        assert not (run / "base").exists()  # refused before the base was rebuilt
    assert main(["export", "merged", "--checkpoint", str(run), "--out", str(tmp_path / "o"), "--base",
                 str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert _user_lines(err) == [f"moetune: error: --base {tmp_path / 'nope'}: no such directory (the base HF "
                                "checkpoint the adapter was trained on)"], err
    assert main(["export", "adapter", "--checkpoint", str(tmp_path / "typo"), "--out", str(tmp_path / "o")]) == 1
    assert "typo: no such directory (no moetune adapter, run or checkpoint there)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_merged_export_refuses_a_damaged_or_foreign_base(trained, tmp_path, capsys):
    """A base whose weights were cut short merged into zeros and exited 0; a base of another model_type was merged
    and written with that config.json; a config.json that is not JSON was a traceback."""
    import json

    def base_with(name, change):
        base = tmp_path / name
        shutil.copytree(trained[0] / "base", base)
        change(base)
        return base

    def cut(base):
        f = base / "model.safetensors"
        os.truncate(f, f.stat().st_size // 2)

    def llama(base):
        cfg = json.loads((base / "config.json").read_text())
        (base / "config.json").write_text(json.dumps(dict(cfg, model_type="llama")))

    def not_json(base):
        (base / "config.json").write_text('{"model_type": "glm4_moe",\n  oops}\n')

    for base, said in ((base_with("cut", cut), "model.safetensors: truncated ("),
                       (base_with("llama", llama), "config.json is of model_type 'llama'; moetune merges into"),
                       (base_with("notjson", not_json), "config.json:2: invalid JSON")):
        out = tmp_path / f"out-{base.name}"
        assert main(["export", "merged", "--checkpoint", str(trained[0]), "--out", str(out), "--base", str(base)]) == 1
        lines = _user_lines(capsys.readouterr().err)
        assert len(lines) == 1 and said in lines[0], lines
        assert not out.exists()


@pytest.mark.parametrize("fault", ["ctrl-c", "disk full"])
def test_a_merged_export_that_stops_halfway_leaves_nothing(trained, tmp_path, capsys, monkeypatch, fault):
    """Ctrl-C was a KeyboardInterrupt traceback and left half-written files in an --out that existed (empty);
    a full disk was an OSError traceback."""
    from moetune.export.safetensors_io import ShardedWriter

    real = ShardedWriter.write

    def stop_after_some(self, name, t):
        if self._pos == 5:
            if fault == "ctrl-c":
                raise KeyboardInterrupt
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, name, t)

    monkeypatch.setattr(ShardedWriter, "write", stop_after_some)
    for out in (tmp_path / "new", tmp_path / "empty"):
        existed = out.name == "empty"
        if existed:
            out.mkdir()
        rc = main(["export", "merged", "--checkpoint", str(trained[0]), "--out", str(out)])
        err = capsys.readouterr().err
        if fault == "ctrl-c":
            assert rc == 130 and _user_lines(err) == ["moetune: interrupted"], err
        else:
            assert rc == 1 and _user_lines(err) == [f"moetune: error: {out}: cannot write the export (No space left "
                                                    "on device)"], err
        assert (out.is_dir() and os.listdir(out) == []) if existed else not out.exists()


def test_ctrl_c_during_training_is_one_line_that_says_what_is_kept(tmp_path, capsys, monkeypatch):
    from moetune.train import loop

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "train", interrupted)
    assert main(["train", *small_run_args(tmp_path, "c")]) == 130
    lines = _user_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("moetune: interrupted") and "resume: auto" in lines[0], lines


def test_a_misspelt_command_is_one_line_with_a_suggestion(capsys):
    assert main(["trian", "cfg.yaml"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "moetune: unknown command 'trian': did you mean 'train'? (`moetune --help` describes them)"]


def test_generate_on_a_gpu_that_is_not_here_is_one_line(trained):
    p = _moetune("generate", str(trained[0]), "--prompt", "hi", "--device", "cuda:99")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1].startswith("moetune: error: --device cuda:99: this machine has ")


def test_a_damaged_checkpoint_names_the_one_to_resume_from(trained, tmp_path):
    """resume: auto on a truncated newest checkpoint is refused by name (nothing written) and says which complete
    checkpoint comes before it."""
    run, args = trained
    copy = tmp_path / "runs" / "t"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("base", ".lock"))
    shard = next((copy / "checkpoints" / "step_000002").glob("*.distcp"))
    os.truncate(shard, 100)
    before = {p: p.stat().st_mtime_ns for p in copy.rglob("*")}
    args = args + ["--run.output_dir", str(tmp_path / "runs"), "--resume", "auto", "--train.steps", "3"]
    p = _moetune("train", *args)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert f"{shard.name} is truncated" in last and f"resume: {copy / 'checkpoints' / 'step_000001'}" in last, last
    assert {p: p.stat().st_mtime_ns for p in copy.rglob("*") if p.name != ".lock"} == {
        p: m for p, m in before.items()}
    shutil.copy2(run / "checkpoints" / "step_000002" / shard.name, shard)
    (copy / "checkpoints" / "step_000002" / "trainer_state.json").write_text("garbage")  # its state, not a shard
    p = _moetune("train", *args)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and "trainer_state.json: cannot read" in last, p.stderr[-2000:]
    assert f"resume: {copy / 'checkpoints' / 'step_000001'}" in last, last


def test_an_export_given_back_to_moetune_says_what_to_pass(trained, tmp_path, capsys):
    out = tmp_path / "peft"
    assert main(["export", "adapter", "--checkpoint", str(trained[0]), "--out", str(out)]) == 0
    capsys.readouterr()
    for cmd in (["generate", str(out), "--prompt", "hi"], ["export", "merged", "--checkpoint", str(out), "--out",
                                                          str(tmp_path / "m")]):
        assert main(cmd) == 1
        assert _user_lines(capsys.readouterr().err) == [
            f"moetune: error: {out / 'adapter_config.json'}: not a moetune adapter (a PEFT or vLLM adapter, "
            "already exported); pass the run directory (runs/NAME) or its adapter/"]


def test_ctrl_c_during_a_checkpoint_write_is_the_interrupt_not_a_storage_fault(tmp_path, capsys, monkeypatch):
    """DCP wraps a KeyboardInterrupt raised while it writes in its CheckpointException; it used to be reported as
    'could not write the checkpoint … (free space or fix permissions)'. The half-written step is removed."""
    from torch.distributed.checkpoint import CheckpointException

    from moetune.train import checkpoint

    def interrupted(*a, **kw):
        raise CheckpointException("save failed", {0: (KeyboardInterrupt(), None)})

    monkeypatch.setattr(checkpoint.dcp, "save", interrupted)
    monkeypatch.setattr(checkpoint.dcp, "async_save", interrupted)
    assert main(["train", *small_run_args(tmp_path, "c", **{"checkpoint.every": 2})]) == 130
    err = capsys.readouterr().err  # the run's own log lines come first
    assert err.strip().splitlines()[-1].startswith("moetune: interrupted"), err[-2000:]
    assert "could not write" not in err and "Traceback" not in err
    assert not list((tmp_path / "runs" / "c" / "checkpoints").glob("*.tmp"))


def test_generate_honours_adapter_over_the_runs_own(trained, tmp_path, monkeypatch):
    """`generate RUN --adapter OTHER` loaded RUN's own adapter: load_for_generation overwrote the argument."""
    from moetune.inference import load_for_generation
    from moetune.model import hf_io

    other = tmp_path / "other"
    shutil.copytree(trained[0] / "adapter", other)
    loaded = []
    monkeypatch.setattr(hf_io, "load_model", lambda base, device, dtype, adapter, **kw: loaded.append((base, adapter)))
    load_for_generation(str(trained[0]), adapter=str(other))
    load_for_generation(str(trained[0]))
    assert loaded == [(str(trained[0] / "base"), str(other)), (str(trained[0] / "base"), str(trained[0] / "adapter"))]


def test_generate_says_what_a_folder_lacks(trained, tmp_path, capsys):
    """A run with no adapter or checkpoint yet and an empty folder were 'not an HF checkpoint directory (no
    config.json)'."""
    early, earliest = tmp_path / "early", tmp_path / "earliest"
    for run in (early, earliest):
        run.mkdir()
        shutil.copy2(trained[0] / "config.yaml", run / "config.yaml")
    (early / "checkpoints").mkdir()
    (tmp_path / "empty").mkdir()
    for folder, said in ((early, "a run with no adapter and no complete checkpoint yet"),
                         (earliest, "a run with no adapter and no complete checkpoint yet"),
                         (tmp_path / "empty", "an empty directory: neither a moetune run")):
        assert main(["generate", str(folder), "--prompt", "hi"]) == 1
        assert _user_lines(capsys.readouterr().err) == [f"moetune: error: {folder}: {said}" + (
            " (config.yaml, adapter/, checkpoints/) nor an HF checkpoint (config.json)" if folder.name == "empty" else
            " (the adapter is written when training ends; checkpoint.every N writes checkpoints while it runs)")]


def test_load_model_on_a_gpu_that_is_not_here_is_a_clear_error(trained, monkeypatch):
    """moetune.load_model(..., device='cuda') without CUDA raised torch's AssertionError."""
    import torch

    import moetune
    from moetune.errors import DeviceError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(DeviceError, match=r"^device cuda: this machine has 0 usable CUDA GPUs"):
        moetune.load_model(str(trained[0] / "base"), device="cuda")


def test_text_that_is_not_utf8_is_one_line(trained):
    """Bytes that are not UTF-8 in --prompt or on chat's stdin (and lone surrogates) were a TypeError traceback from
    the tokenizer; chat refuses the line and goes on with the next."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "moetune", "generate", str(trained[0]), "--prompt", b"upper: a\xffb"],
                       capture_output=True, env=env, timeout=120)
    assert p.returncode == 1 and p.stderr.decode().splitlines() == [
        "moetune: error: --prompt: character 9 is the byte 0xff, which is not UTF-8; moetune reads UTF-8 text"]
    p = subprocess.run([sys.executable, "-m", "moetune", "chat", str(trained[0]), "--max-new-tokens", "3"],
                       input=b"upper: a\xffb\nupper: ab\n", capture_output=True, env=env, timeout=120)
    assert p.returncode == 1 and "Traceback" not in p.stderr.decode(), p.stderr.decode()[-2000:]
    assert ("moetune: error: that line: character 9 is the byte 0xff, which is not UTF-8; moetune reads UTF-8 text"
            in p.stderr.decode().splitlines())
    assert len(p.stdout.decode().splitlines()) == 1  # the second line was answered
    import moetune
    from moetune.errors import TextError

    model, tokenizer = moetune.load_for_generation(str(trained[0]))
    with pytest.raises(TextError, match=r"^the prompt: character 2 is '\\ud800', half of a UTF-16 surrogate pair"):
        moetune.generate(model, "a\ud800", tokenizer, max_new_tokens=2)
