"""Checkpoints in one process: what they hold, what a resume refuses, failed writes, numerical faults,
signals. (Exact resume on 2 processes, resharding and kills: tests/distributed/test_resume*.py.)"""

import json
import os
import resource
import signal

import pytest
import torch
from safetensors.torch import load_file

from helpers import read_metrics, run_inprocess, small_run_args, step_losses
from moetune.config import load_config
from moetune.model.hf_io import CheckpointError
from moetune.errors import CheckpointWriteError, NumericalFault
from moetune.run_dir import complete_checkpoints, load_model_state
from moetune.train import loop, trainer
from moetune.train import signals as signals_mod
from moetune.train.checkpoint_files import resolve_resume

CONSTANT = {"optim.scheduler": "constant"}  # the lr does not depend on train.steps: runs of different length agree


def _ckpt(run, step):
    return run / "checkpoints" / f"step_{step:06d}"


def test_lora_checkpoint_holds_the_trainable_state_and_no_base_weights(tmp_path):
    attn = {"lora.targets": "[q_proj,k_proj,v_proj,o_proj]", "train.steps": 2}
    run = run_inprocess(small_run_args(tmp_path, "lora", **attn))
    cfg = load_config(None, small_run_args(tmp_path, "lora", **attn))
    from moetune.parallel.layout import resolve_layout
    from moetune.parallel.mesh import Dist
    from moetune.train.setup import setup_model

    model = setup_model(cfg, Dist(), resolve_layout(cfg, 1))
    lora_bytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    saved = [r for r in read_metrics(run) if "checkpoint_bytes" in r]
    assert [r["step"] for r in saved] == [2] and saved[0]["checkpoint_s"] > 0  # the last step is always saved
    # fp32 LoRA weights + 2 AdamW moments, plus indexes and small state; half the base would not fit
    assert saved[0]["checkpoint_bytes"] < 3 * lora_bytes + 256 * 1024 < base_bytes / 2
    weights = load_model_state(_ckpt(run, 2))
    assert set(weights) == {n for n, p in model.named_parameters() if p.requires_grad}
    adapter = load_file(run / "adapter" / "adapter_model.safetensors")  # finish() still writes the adapter
    for k, v in adapter.items():
        assert torch.equal(weights[k], v), k
    state = json.loads((_ckpt(run, 2) / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["tokens"] > 0 and state["data_position"]["offset"] > 0
    assert state["config_hash"] and state["moetune_version"] and (_ckpt(run, 2) / "config.yaml").is_file()


def test_resume_refuses_a_changed_lora_rank_and_applies_a_changed_lr(tmp_path, capsys):
    kw = {"train.steps": 2, **CONSTANT}
    run_inprocess(small_run_args(tmp_path, "r", **kw))
    with pytest.raises(CheckpointError, match=r"lora\.rank: 16 → 8"):
        run_inprocess(small_run_args(tmp_path, "r", **kw, **{"lora.rank": 8, "resume": "auto"}))
    capsys.readouterr()
    run_inprocess(small_run_args(tmp_path, "r", **{**kw, "resume": "auto"}))  # already at train.steps
    assert "the checkpoint is at step 2 and train.steps is 2: nothing to train" in capsys.readouterr().err
    run = run_inprocess(small_run_args(tmp_path, "r", **{**kw, "train.steps": 3, "optim.lr": 5e-3, "resume": "auto"}))
    assert "optim.lr: 0.01 → 0.005" in capsys.readouterr().err
    assert [r["lr"] for r in read_metrics(run) if "loss" in r] == [1e-2, 1e-2, 5e-3]


def test_damaged_checkpoint_is_refused_by_file_name(tmp_path):
    run = run_inprocess(small_run_args(tmp_path, "d", **{"train.steps": 2}))
    shard = _ckpt(run, 2) / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    args = small_run_args(tmp_path, "d", **{"train.steps": 3, "resume": "auto"})
    with pytest.raises(CheckpointError, match=r"shard file __0_0\.distcp is truncated"):
        run_inprocess(args)
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"shard file __0_0\.distcp is missing"):
        run_inprocess(args)


def test_failed_write_stops_the_run_and_the_previous_checkpoint_resumes(tmp_path):
    """Root ignores file permissions, so the write fails by a file-size limit (RLIMIT_FSIZE): the shard
    write gets EFBIG ("File too large") part-way, as it would get ENOSPC on a full disk."""
    kw = {"train.steps": 2, "checkpoint.every": 2, **CONSTANT}
    run = run_inprocess(small_run_args(tmp_path, "w", **kw))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))  # the shard is ~1.5 MB; logs stay far below
    try:
        with pytest.raises(CheckpointWriteError, match=r"step 4 .*File too large.*step_000002 is intact"):
            run_inprocess(small_run_args(tmp_path, "w", **{**kw, "train.steps": 4, "resume": "auto"}))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert [p.name for _, p in complete_checkpoints(run / "checkpoints")] == ["step_000002"]
    assert sorted(os.listdir(run / "checkpoints")) == ["step_000002"]  # the failed write left no debris
    run_inprocess(small_run_args(tmp_path, "w", **{**kw, "train.steps": 4, "resume": "auto"}))
    straight = run_inprocess(small_run_args(tmp_path, "straight", **{**kw, "train.steps": 4}))
    assert step_losses(run) == step_losses(straight)


def test_consecutive_non_finite_steps_stop_with_the_last_good_weights_saved(tmp_path, monkeypatch):
    """A bad step also undoes the update before it (whose weights gave the non-finite values): the saved weights
    are those of step 1, the last ones a finite forward pass confirmed."""
    real, calls = trainer.clip_grad_norm, []

    def nan_from_step_3(params, max_norm):
        calls.append(1)
        norm = real(params, max_norm)
        return float("nan") if len(calls) >= 3 else norm

    monkeypatch.setattr(trainer, "clip_grad_norm", nan_from_step_3)
    kw = {"train.steps": 10, "checkpoint.max_bad_steps": 3, **CONSTANT}
    fault = r"3 bad steps .*up to step 5.*those of step 1, whose forward pass was finite.*step_000005"
    with pytest.raises(NumericalFault, match=fault):
        run_inprocess(small_run_args(tmp_path, "nan", **kw))
    monkeypatch.setattr(trainer, "clip_grad_norm", real)
    good = run_inprocess(small_run_args(tmp_path, "good", **{**kw, "train.steps": 1}))
    a, b = load_model_state(_ckpt(tmp_path / "runs" / "nan", 5)), load_model_state(_ckpt(good, 1))
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_signal_stops_at_the_step_boundary_and_a_second_one_exits_at_once(tmp_path, monkeypatch):
    real, calls, killed = trainer.clip_grad_norm, [], []

    def signal_twice_in_step_2(params, max_norm):
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGUSR1)  # the first asks for a checkpoint and a stop
            signal.raise_signal(signal.SIGUSR1)  # the second would kill the process: recorded instead
        return real(params, max_norm)

    monkeypatch.setattr(trainer, "clip_grad_norm", signal_twice_in_step_2)
    monkeypatch.setattr(signals_mod.os, "kill", lambda pid, sig: killed.append(sig))
    before = signal.getsignal(signal.SIGUSR1)
    cfg = load_config(None, small_run_args(tmp_path, "s", **{"train.steps": 6}))
    state = loop.train(cfg)
    assert state.step == 2 and killed == [signal.SIGUSR1]
    assert [s for s, _ in complete_checkpoints(cfg.run_dir / "checkpoints")] == [2]
    assert signal.getsignal(signal.SIGUSR1) is before  # handlers given back


def test_resume_paths_and_debris(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    for name, files in [("step_000002", (".metadata", "trainer_state.json")),
                        ("step_000004", (".metadata", "trainer_state.json")),
                        ("step_000006.tmp", (".metadata", "trainer_state.json")),  # written, never renamed
                        ("step_000008", ("trainer_state.json",))]:  # no index: not a checkpoint
        (root / name).mkdir(parents=True)
        for f in files:
            (root / name / f).write_text("{}")
    assert resolve_resume("auto", tmp_path / "run") == root / "step_000004"
    assert resolve_resume(str(tmp_path / "run"), tmp_path / "other") == root / "step_000004"
    assert resolve_resume(str(root), tmp_path / "other") == root / "step_000004"
    assert resolve_resume(str(root / "step_000002"), tmp_path / "other") == root / "step_000002"
    assert resolve_resume("auto", tmp_path / "empty") is None
    assert resolve_resume("none", tmp_path / "run") is None
    with pytest.raises(CheckpointError, match="unfinished"):
        resolve_resume(str(root / "step_000006.tmp"), tmp_path / "run")
    with pytest.raises(CheckpointError, match="neither a checkpoint"):
        resolve_resume(str(tmp_path / "nowhere"), tmp_path / "run")


def test_starting_over_moves_the_whole_earlier_run_aside(tmp_path):
    """A run name used again without resuming: the earlier run (checkpoints, metrics, adapter, config) is moved,
    whole, to RUN.earlier-<time>/ where auto-resume will not take it; nothing of it is overwritten (issue 12.5)."""
    run = run_inprocess(small_run_args(tmp_path, "again", **{"train.steps": 3}))
    first_metrics = (run / "metrics.jsonl").read_text()
    first_adapter = (run / "adapter" / "adapter_model.safetensors").read_bytes()
    run_inprocess(small_run_args(tmp_path, "again", **{"train.steps": 2}))
    assert [s for s, _ in complete_checkpoints(run / "checkpoints")] == [2]
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2]
    (earlier,) = [p for p in run.parent.iterdir() if p.name.startswith("again.earlier-")]
    assert [s for s, _ in complete_checkpoints(earlier / "checkpoints")] == [3]
    assert (earlier / "metrics.jsonl").read_text() == first_metrics
    assert (earlier / "adapter" / "adapter_model.safetensors").read_bytes() == first_adapter
    assert (earlier / "config.yaml").is_file() and not (earlier / ".lock").exists()
