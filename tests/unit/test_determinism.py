"""train.deterministic (train/determinism.py): the settings a repeatable run needs (all of them with true, Inductor's
alone with "compile") are on while its trainer lives — including while torch.compile compiles, which is where Inductor
would otherwise choose kernels by timing them — and the process's own settings are back after it, also when building
the trainer fails. Whether a compiled GPU run then repeats bit for bit is measured on a GPU
(benchmarks/fp8_determinism.py), the CPU having no timing-based choices."""

from __future__ import annotations

import os

import pytest
import torch
import torch._inductor.config as inductor_config

from helpers import small_run_args
from moetune.config import ConfigError, load_config
from moetune.train.trainer import Trainer


def _settings():
    return (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, inductor_config.deterministic,
            os.environ.get("CUBLAS_WORKSPACE_CONFIG"))


@pytest.fixture
def process_defaults(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = _settings()
    assert before[:5] == (False, False, False, False, False), "another test left deterministic settings on"
    yield before
    assert _settings()[:5] == before[:5]


def test_on_for_the_trainers_life_then_restored(tmp_path, process_defaults):
    """On while the trainer builds and steps (a step's ops see them), the process's former settings back after."""
    seen = []
    cfg = load_config(None, small_run_args(tmp_path, "det", **{"train.deterministic": True, "train.steps": 2,
                                                                  "parallel.layout": "manual"}))
    with Trainer(cfg) as trainer:
        seen.append(_settings())
        trainer.step(trainer.next_batches())
        seen.append(_settings())
    assert seen == [(True, True, True, False, True, ":4096:8")] * 2
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_compile_holds_only_inductor(tmp_path, process_defaults):
    """"compile": Inductor's deterministic mode alone (the level that made evaluations repeat at ~1% cost); torch's
    algorithms, cuDNN and cuBLAS stay as the process had them."""
    cfg = load_config(None, small_run_args(tmp_path, "comp", **{"train.deterministic": "compile", "train.steps": 1,
                                                                   "parallel.layout": "manual"}))
    with Trainer(cfg) as trainer:
        trainer.step(trainer.next_batches())
        assert _settings() == (False, False, False, False, True, None)
    assert _settings() == process_defaults


def test_an_unknown_level_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="train.deterministic"):
        load_config(None, small_run_args(tmp_path, "bad", **{"train.deterministic": "fast"}))


def test_off_changes_nothing(tmp_path, process_defaults):
    cfg = load_config(None, small_run_args(tmp_path, "plain", **{"train.steps": 1, "parallel.layout": "manual"}))
    with Trainer(cfg) as trainer:
        assert _settings() == process_defaults
        trainer.step(trainer.next_batches())


def test_a_failed_build_restores_them(tmp_path, process_defaults, monkeypatch):
    import moetune.train.trainer as trainer_mod

    def fail(*a, **k):
        assert _settings()[0], "the settings must be on while the model is built (and compiled)"
        raise RuntimeError("model build failed")

    monkeypatch.setattr(trainer_mod, "setup_model", fail)
    cfg = load_config(None, small_run_args(tmp_path, "fails", **{"train.deterministic": True,
                                                                    "parallel.layout": "manual"}))
    with pytest.raises(RuntimeError, match="model build failed"):
        Trainer(cfg)


def test_a_users_cublas_setting_is_kept(tmp_path, process_defaults, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    cfg = load_config(None, small_run_args(tmp_path, "cublas", **{"train.deterministic": True, "train.steps": 1,
                                                                     "parallel.layout": "manual"}))
    with Trainer(cfg):
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
