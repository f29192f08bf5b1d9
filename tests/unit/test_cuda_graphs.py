"""train.cuda_graphs: when the compiled layers replay as CUDA graphs (parallel/apply.py use_cuda_graphs), and that the
choice reaches torch.compile. The graphs themselves run only on a GPU (benchmarks/speed_session.sh compares a
`moetune train` run with and without them, loss for loss); here: the decision, its error, and the wiring."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from moetune.errors import ConfigError
from moetune.model.config import ModelConfig, BUILTIN
from moetune.model.hf_io import build_model
from moetune.parallel.apply import parallelize, use_cuda_graphs
from moetune.parallel.layout import make_layout

ONE = make_layout(1, n_layers=3)
FSDP = make_layout(2, n_layers=3)
EP = make_layout(2, ep=2, dp_shard=1, n_layers=3, n_experts=8)


@pytest.mark.parametrize("setting", [None, True])
def test_on_for_one_gpu_compiled(setting):
    assert use_cuda_graphs(setting, ONE, compile=True, device="cuda:0")


@pytest.mark.parametrize("layout,compile,device", [(FSDP, True, "cuda"), (EP, True, "cuda"), (ONE, False, "cuda"),
                                                   (ONE, True, "cpu")])
def test_auto_is_off_where_graphs_cannot_run(layout, compile, device):
    assert not use_cuda_graphs(None, layout, compile=compile, device=device)
    assert not use_cuda_graphs(False, layout, compile=compile, device=device)


@pytest.mark.parametrize("layout,compile,device,reason", [
    (FSDP, True, "cuda", "FSDP or expert parallelism"), (EP, True, "cuda", "FSDP or expert parallelism"),
    (ONE, False, "cuda", "train.compile is false"), (ONE, True, "cpu", "not a GPU")])
def test_asked_where_they_cannot_run_is_a_config_error(layout, compile, device, reason):
    with pytest.raises(ConfigError, match=reason):
        use_cuda_graphs(True, layout, compile=compile, device=device)


def test_false_when_possible_stays_off():
    assert not use_cuda_graphs(False, ONE, compile=True, device="cuda")


@pytest.mark.parametrize("graphs,expected", [(True, {"mode": "reduce-overhead"}), (False, {})])
def test_parallelize_compiles_each_layer_in_the_chosen_mode(monkeypatch, graphs, expected):
    model = build_model(ModelConfig.from_hf_dict(BUILTIN["tiny"]), "meta")
    calls = []
    for layer in model.model.layers:
        monkeypatch.setattr(layer, "compile", lambda **kw: calls.append(kw))
    parallelize(model, make_layout(1, n_layers=len(model.model.layers)), None, compile=True,
                param_dtype=torch.bfloat16, cuda_graphs=graphs)
    assert calls == [{"dynamic": False, "backend": "inductor", **expected}] * len(model.model.layers)


def test_cli_names_the_key_in_one_line(tmp_path):
    """Asked for on this CPU machine: one line naming the key, no traceback."""
    p = subprocess.run([sys.executable, "-m", "moetune", "train", "--train.cuda_graphs", "true", "--train.compile",
                        "true", "--train.steps", "1", "--run.output_dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert "train.cuda_graphs" in p.stderr and "not a GPU" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
