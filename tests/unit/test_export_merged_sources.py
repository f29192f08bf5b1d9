"""`moetune export merged` of a full fine-tuning run: streamed from its DCP checkpoint, loadable by transformers."""

import json

import pytest
import torch

import moetune
from moetune.cli import main as cli_main
from moetune.config import load_config
from moetune.export import ExportError, export_merged_from_checkpoint
from moetune.model.hf_io import build_model, cast_model
from moetune.run_dir import latest_checkpoint, load_model_state
from moetune.model.config import model_config_for
from helpers import run_inprocess, small_run_args


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    return run_inprocess(small_run_args(tmp, "full", **{"finetune.mode": "full", "train.steps": 3,
                                                       "checkpoint.every": 3}))


def trained_model(ckpt):
    """moetune's model holding the checkpoint's weights (the reference)."""
    cfg = load_config(str(ckpt / "config.yaml"))
    model = build_model(model_config_for(cfg), "meta")
    model.to_empty(device="cpu")
    cast_model(model, torch.float32)
    model.load_state_dict(load_model_state(ckpt), strict=True)
    return model.eval()


def test_full_run_exports_through_the_cli_and_loads_in_transformers(tmp_path, full_run):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    assert cli_main(["export", "merged", "--checkpoint", str(full_run), "--out", str(out), "--dtype", "float32"]) == 0
    ckpt = latest_checkpoint(full_run / "checkpoints")
    ours = trained_model(ckpt)
    vocab = ours.config.vocab_size
    ids = torch.randint(0, vocab, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(ids)
        hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        assert rel_err(hf(input_ids=ids).logits, want) < 1e-4
        assert rel_err(moetune.load_model(str(out))(ids), want) < 1e-5
    # config.json is the run's model config (2 layers, a proxy of the builtin), dtype as exported
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg.get("torch_dtype", cfg.get("dtype")) == "float32"


def test_sharded_bf16_export_keeps_router_bias_fp32(tmp_path, full_run):
    from safetensors import safe_open

    ckpt = latest_checkpoint(full_run / "checkpoints")
    r = export_merged_from_checkpoint(str(ckpt), tmp_path / "m", dtype="bf16", max_shard_bytes=100_000)
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert r["shards"] == len(set(index["weight_map"].values())) > 2 and not r["notes"]
    names = list(index["weight_map"])
    assert not any("gate_up_proj" in n for n in names) and "model.layers.1.mlp.experts.7.down_proj.weight" in names
    state = load_model_state(ckpt)
    for name, fname in index["weight_map"].items():
        with safe_open(str(tmp_path / "m" / fname), "pt") as f:
            t = f.get_tensor(name)
        if name.endswith("e_score_correction_bias"):
            assert t.dtype == torch.float32 and torch.equal(t, state[name])
        else:
            assert t.dtype == torch.bfloat16
    I = state["model.layers.1.mlp.experts.gate_up_proj"].shape[1] // 2
    with safe_open(str(tmp_path / "m" / index["weight_map"]["model.layers.1.mlp.experts.3.up_proj.weight"]), "pt") as f:
        got = f.get_tensor("model.layers.1.mlp.experts.3.up_proj.weight")
    assert torch.equal(got, state["model.layers.1.mlp.experts.gate_up_proj"][3, I:].to(torch.bfloat16))


def test_lora_checkpoint_is_not_taken_for_full(tmp_path):
    run = run_inprocess(small_run_args(tmp_path, "lora", **{"train.steps": 1}))
    with pytest.raises(ExportError, match="not a full fine-tuning"):
        export_merged_from_checkpoint(str(run), tmp_path / "m")
