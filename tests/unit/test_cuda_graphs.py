"""train.cuda_graphs: where the compiled layers may replay as CUDA graphs (parallel/apply.py check_cuda_graphs), that the
choice reaches torch.compile, and what the trainer does differently under them (gradients accumulated into buffers
that exist before backward, a forward marked as one step for CUDA graph trees). The graphs themselves run only on a
GPU (benchmarks/speed_session.sh: `moetune train` with and without them, and the step API's `_cg` rows)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from helpers import run_inprocess, small_run_args, step_losses
from moetune.config import load_config
from moetune.errors import ConfigError
from moetune.model.config import BUILTIN, ModelConfig
from moetune.model.hf_io import build_model
from moetune.parallel.apply import check_cuda_graphs, parallelize
from moetune.parallel.layout import make_layout
from moetune.train.trainer import Trainer

ONE = make_layout(1, n_layers=3)
FSDP = make_layout(2, n_layers=3)
EP = make_layout(2, ep=2, dp_shard=1, n_layers=3, n_experts=8)
EP_FSDP = make_layout(4, ep=2, dp_shard=2, n_layers=3, n_experts=8)


@pytest.mark.parametrize("layout", [ONE, EP], ids=["one_gpu", "ep_without_fsdp"])
def test_compiled_on_a_gpu_without_fsdp_allows_them(layout):
    """One GPU, or expert parallelism with the rest replicated: the compiled parts of each layer replay as graphs (under
    EP the exchange between them runs eagerly)."""
    assert not layout.fsdp
    check_cuda_graphs(layout, compile=True, device="cuda:0")


@pytest.mark.parametrize("layout,compile,device,reason", [
    (FSDP, True, "cuda", "FSDP is on"), (EP_FSDP, True, "cuda", "FSDP is on"),
    (ONE, False, "cuda", "train.compile is false"), (ONE, True, "cpu", "not a GPU")])
def test_asked_where_they_cannot_run_is_a_config_error(layout, compile, device, reason):
    with pytest.raises(ConfigError, match=reason):
        check_cuda_graphs(layout, compile=compile, device=device)


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


def test_each_forward_is_one_cuda_graph_step(monkeypatch):
    """An evaluation's forward under CUDA graph trees must not free one layer's outputs at the next layer's replay:
    the model marks the start of each forward through its layers (and nowhere else), so they live until the next."""
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    model = build_model(ModelConfig.from_hf_dict(BUILTIN["tiny"]), "cpu")
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    with torch.no_grad():
        model(ids)
        model(ids, labels=ids)
    assert len(marks) == 2


@pytest.mark.parametrize("impl", ["flex", "eager"])
def test_the_layers_per_step_inputs_keep_their_addresses_under_graphs(monkeypatch, impl):
    """CUDA graph trees replay a layer's backward with the tensors its forward saved at the addresses the recording
    saw; RoPE's cos/sin and the document mask are made anew each step, so under graphs the model copies them into
    buffers kept across steps (else the backward re-records every step). Two steps of different packed documents:
    every tensor the layers receive besides x sits where it sat, holding this step's values (the loss equals the
    unstaged model's); without graphs nothing is staged."""
    from moetune.model.hf_io import init_weights
    from moetune.model.step_inputs import StepInputs, unstaged

    model = build_model(ModelConfig.from_hf_dict(BUILTIN["tiny"]), "cpu")
    init_weights(model)
    model.attn_implementation = impl
    for layer in model.model.layers:
        monkeypatch.setattr(layer, "compile", lambda **kw: None)
    parallelize(model, make_layout(1, n_layers=len(model.model.layers)), None, compile=True,
                param_dtype=torch.float32, cuda_graphs=True)
    assert isinstance(model.step_inputs, StepInputs)
    seen = []
    real = type(model.model.layers[0]).forward
    monkeypatch.setattr(type(model.model.layers[0]), "forward",
                        lambda self, x, cos, sin, attn, *a, **k: seen.append((cos, sin, attn)) or real(
                            self, x, cos, sin, attn, *a, **k))

    def tensors(cos, sin, attn):
        mask = attn.block_mask
        parts = {"cos": cos, "sin": sin, "dense_mask": attn.dense_mask}
        if mask is not None:
            parts.update({n: getattr(mask, n) for n in ("kv_num_blocks", "kv_indices", "q_num_blocks", "q_indices")})
            parts["document_ids"] = next(c.cell_contents for c in mask.mask_mod.__closure__
                                         if isinstance(c.cell_contents, torch.Tensor))
        return {k: v for k, v in parts.items() if v is not None}

    ids = torch.randint(0, model.config.vocab_size, (1, 24))
    staged, addresses, kept = model.step_inputs, [], []
    for docs in ((8, 16), (12, 5, 7)):
        pos = torch.cat([torch.arange(n) for n in docs])[None]
        seen.clear()
        with torch.no_grad():
            model.step_inputs = staged
            loss = model(ids, position_ids=pos, labels=ids)
            assert all(s[0] is seen[0][0] and s[2] is seen[0][2] for s in seen)  # one set for every layer
            kept.append(tensors(*seen[0]))  # alive: a tensor made anew cannot take a kept one's address
            addresses.append({k: v.data_ptr() for k, v in kept[-1].items()})
            model.step_inputs = unstaged
            assert torch.equal(model(ids, position_ids=pos, labels=ids), loss)
            assert seen[-1][0].data_ptr() != addresses[-1]["cos"]  # unstaged: made anew
    assert addresses[0] == addresses[1] and len(addresses[0]) == (7 if impl == "flex" else 3)
    # a batch of another length between two steps (an evaluation's) leaves the step's buffers where they were
    model.step_inputs = staged
    with torch.no_grad():
        model(ids[:, :16], position_ids=torch.cat([torch.arange(6), torch.arange(10)])[None], labels=ids[:, :16])
        seen.clear()
        model(ids, position_ids=pos, labels=ids)
    assert {k: v.data_ptr() for k, v in tensors(*seen[0]).items()} == addresses[0]


def test_gradients_accumulate_into_buffers_that_outlive_the_step(tmp_path, monkeypatch):
    """Under CUDA graphs a replay overwrites the buffers its outputs live in, so the trainer never lets autograd take
    a layer's weight gradient over as .grad: each trainable parameter has its gradient before the first backward,
    zeroed in place after each update. Micro-batches accumulate into it and train exactly as without (the graphs
    themselves need a GPU; here the trainer runs eager with the option on)."""
    import moetune.train.setup as setup_mod

    monkeypatch.setattr(setup_mod, "check_cuda_graphs", lambda *a: None)
    over = {"train.steps": 3, "train.grad_accum": 2, "parallel.layout": "manual"}
    want = step_losses(run_inprocess(small_run_args(tmp_path, "plain", **over)))
    cfg = load_config(None, small_run_args(tmp_path, "kept", **over, **{"train.cuda_graphs": True}))
    losses = []
    with Trainer(cfg) as trainer:
        grads = {id(p): p.grad for p in trainer.params}
        assert all(g is not None and not g.any() for g in grads.values())
        for _ in range(3):
            losses.append(round(trainer.step(trainer.next_batches()).loss, 6))
            assert all(p.grad is grads[id(p)] and not p.grad.any() for p in trainer.params)
    assert losses == want
