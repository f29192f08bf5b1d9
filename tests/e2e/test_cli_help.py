"""Every command has a real help (what it does, its flags), `--version`, `train --print-config`, and a config that
names a wrong path fails in one line with exit 2 before any model building."""

import subprocess
import sys
import time

import pytest
import yaml

from moetune.cli import main


def run(*args, cwd=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "moetune", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd)


def test_top_level_help_and_version(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for cmd in ("train", "export adapter", "export merged", "generate", "chat", "inspect", "plot", "--print-config"):
        assert cmd in out, cmd
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"moetune {__import__('moetune').__version__}"
    assert main(["tarin"]) == 2
    assert "unknown command 'tarin'" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_train_help(capsys, flag):
    assert main(["train", flag]) == 0
    out = capsys.readouterr().out
    assert "usage: moetune train" in out and "--print-config" in out and "Configuration reference" in out


def test_print_config_default_and_resolved(capsys, tmp_path):
    assert main(["train", "--print-config"]) == 0
    default = yaml.safe_load(capsys.readouterr().out)
    assert default["optim"]["lr"] == 3e-3 and default["model"]["path"] is None
    cfg = tmp_path / "c.yaml"
    cfg.write_text("optim:\n  lr: 2.0e-4\n")
    assert main(["train", str(cfg), "--train.steps", "7", "--print-config"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["optim"]["lr"] == 2e-4 and resolved["train"]["steps"] == 7
    assert not (tmp_path / "runs").exists()


def test_export_subcommands_have_their_own_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["export", "adapter", "--help"])
    assert e.value.code == 0
    adapter = capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["export", "merged", "--help"])
    merged = capsys.readouterr().out
    assert "--format" in adapter and "--format" not in merged
    assert "--dtype" in merged and "--dtype" not in adapter
    for out in (adapter, merged):
        assert "--checkpoint" in out and "--base" in out and "PASS or FAIL" in out
    assert main(["export", "merged", "--checkpoint", "x", "--out", "y", "--format", "vllm"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "moetune: error: export: unrecognized arguments: --format vllm (`moetune export --help` lists the flags)"]


@pytest.mark.parametrize("cmd", [["generate"], ["chat"], ["inspect"], ["plot"]])
def test_other_commands_have_help(capsys, cmd):
    with pytest.raises(SystemExit) as e:
        main(cmd + ["--help"])
    assert e.value.code == 0
    assert f"usage: moetune {cmd[0]}" in capsys.readouterr().out


@pytest.mark.parametrize("override,key", [
    (["--model.path", "/data/GLM-4.5-Air"], "model.path"),
    (["--data.train", "data/missing.jsonl"], "data.train"),
    (["--data.eval", "./nope.parquet"], "data.eval"),
    (["--data.tokenizer", "/no/such/tokenizer"], "data.tokenizer"),
    (["--model.config", "/no/such/config.json"], "model.config"),
    (["--resume", "/no/such/checkpoint"], "resume"),
])
def test_a_wrong_path_is_one_line_and_exit_2(tmp_path, override, key):
    t = time.time()
    p = run("train", *override, cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"moetune: error: {key}:") and override[1] in lines[0], p.stderr
    assert "not found" in lines[0]
    assert not (tmp_path / "runs").exists()  # nothing built, nothing written
    assert time.time() - t < 60


def test_the_shipped_air_config_unedited_names_its_placeholder(tmp_path):
    import pathlib

    cfg = pathlib.Path(__file__).resolve().parents[2] / "configs" / "glm45-air-lora.yaml"
    p = run("train", str(cfg), cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.startswith("moetune: error: model.path:") and "not found" in p.stderr


@pytest.mark.parametrize("argv", [
    ["train", "--optim.lrr", "1"],
    ["inspect", "--optim.lrr", "1"],  # was `moetune inspect: ...`
    ["inspect", "--world-size", "0"],
    ["plot", "{tmp}"],  # was `moetune plot: ...`
    ["generate", "{tmp}/nothing", "--prompt", "hi"],
    ["chat", "{tmp}/nothing"],
    ["generate", "{tmp}"],  # argparse's own `moetune generate: error:` and its usage lines
    ["export", "adapter", "--checkpoint", "{tmp}/nothing", "--out", "{tmp}/o"],
    ["export", "merged", "--checkpoint", "x", "--out", "y", "--format", "vllm"],
])
def test_every_command_reports_a_user_error_in_one_line_with_one_prefix(argv, tmp_path, capsys):
    assert main([a.format(tmp=tmp_path) for a in argv]) in (1, 2)
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("moetune: error: "), captured.err
