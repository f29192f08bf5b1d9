"""A run on a random-init base (the demo) closes the loop with no extra flags: the adapter records what rebuilds
its base bit for bit; export adapter (PEFT, vLLM) and merged find it, --verify says PASS or FAIL, a failed export
leaves nothing behind, and `generate` runs on the run directory."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from moetune.cli import main
from moetune.config import load_config
from moetune.parallel.layout import resolve_layout
from moetune.model.random_base import base_recipe, build_base
from moetune.parallel.mesh import Dist
from moetune.train.setup import setup_model
from helpers import run_inprocess, small_run_args


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rebuilt_base_equals_the_trained_base_bit_for_bit(dtype):
    cfg = load_config(None, ["--model.dtype", dtype, "--run.seed", "3", "--model.init_std", "0.05",
                             "--lora.targets", "all"])
    trained = setup_model(cfg, Dist(), resolve_layout(cfg, 1))
    rebuilt = build_base(base_recipe(cfg, "cpu"))
    ours = dict(rebuilt.named_parameters()) | dict(rebuilt.named_buffers())
    base = {k: v for k, v in list(trained.named_parameters()) + list(trained.named_buffers()) if ".lora" not in k}
    assert set(ours) == set(base)
    for k, v in base.items():
        assert ours[k].dtype == v.dtype and torch.equal(ours[k], v), k
    assert base_recipe(load_config(None, ["--model.path", "/some/ckpt"]), "cpu") is None


def test_gpu_drawn_base_is_not_silently_rebuilt_on_the_cpu(monkeypatch):
    from moetune.errors import CheckpointError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(CheckpointError, match="--base"):
        build_base(base_recipe(load_config(None, []), "cuda"))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rb")
    # a random base (no model.path), LoRA on attention, shared and routed experts; 3 steps move B off zero
    return run_inprocess(small_run_args(tmp, "r", **{"train.steps": 3}))


def test_adapter_records_its_base_and_exports_with_no_flags(run, tmp_path, capsys):
    meta = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert meta["base_model"] is None and meta["base_init"]["device"] == "cpu"
    for fmt in ("peft", "vllm"):
        out = tmp_path / fmt
        assert main(["export", "adapter", "--checkpoint", str(run), "--out", str(out), "--format", fmt, "--verify"]) == 0
        text = capsys.readouterr().out
        assert "verify: PASS (tolerance 0.0001" in text, text
        for f in out.iterdir():
            assert f.stat().st_mode & 0o777 == 0o644, f
    peft_cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert peft_cfg["base_model_name_or_path"] == str(run / "base")
    assert (run / "base" / "config.json").is_file() and (run / "base" / "tokenizer.json").is_file()


def test_merged_defaults_to_the_run_dtype_and_verifies(run, tmp_path, capsys):
    out = tmp_path / "merged"
    assert main(["export", "merged", "--checkpoint", str(run), "--out", str(out), "--verify"]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "float32" in text and "verify: PASS" in text
    # long silent work says where it is (issue 12, item 6)
    assert "export: model.safetensors written (1/1)" in captured.err and "verify: loading the merged" in captured.err
    assert json.loads((out / "config.json").read_text()).get("torch_dtype", "float32") == "float32"
    assert all(t.dtype == torch.float32 for k, t in load_file(out / "model.safetensors").items())


def test_verify_fail_is_reported_and_leaves_nothing(run, tmp_path, capsys, monkeypatch):
    import moetune.export.verify as verify

    # logits that came out NaN (what a broken export gives): the verdict is FAIL, exit 1, no output kept
    monkeypatch.setattr(verify, "_rel", lambda a, b: float("nan"))
    out = tmp_path / "out"
    for args in (["adapter", "--format", "peft"], ["merged"]):
        rc = main(["export", *args, "--checkpoint", str(run), "--out", str(out), "--verify"])
        err = capsys.readouterr().err
        assert rc == 1 and "verify: FAIL (tolerance 0.0001" in err and "nan" in err, err
        assert not out.exists()
    out.mkdir()  # an --out that existed before: the adapter export leaves it as it was
    assert main(["export", "adapter", "--checkpoint", str(run), "--out", str(out), "--verify"]) == 1
    assert list(out.iterdir()) == []
    assert main(["export", "merged", "--checkpoint", str(run), "--out", str(out), "--verify"]) == 1
    assert list(out.iterdir()) == []  # merged too: verified before it is put in place, so nothing is written


def test_wrong_base_error_names_the_flag(tmp_path, capsys):
    from moetune.model.adapter_io import save_adapter

    save_adapter({}, str(tmp_path / "ad"), dict(rank=2, alpha=4, dropout=0.0, rslora=False, targets=["q_proj"]))
    assert main(["export", "merged", "--checkpoint", str(tmp_path / "ad"), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "--base" in err and "base_model_path" not in err
    assert not (tmp_path / "o").exists()


def test_generate_and_chat_on_the_run_dir(run, capsys, monkeypatch):
    import io

    from moetune.cli.generate import chat as chat_main

    assert main(["generate", str(run), "--prompt", "reverse: abc", "--max-new-tokens", "5"]) == 0
    reply = capsys.readouterr().out
    assert reply.endswith("\n")
    assert chat_main([str(run), "--max-new-tokens", "5"], stdin=io.StringIO("reverse: abc\n/reset\nreverse: abc\n")) == 0
    replies = capsys.readouterr().out.splitlines()
    assert len(replies) == 2 and replies[0] == replies[1] == reply.rstrip("\n")  # greedy, same history after /reset


def _adapter_with_recipe(tmp_path, recipe):
    from moetune.model.adapter_io import save_adapter

    out = tmp_path / "hostile" / "adapter"
    save_adapter({}, str(out), dict(rank=2, alpha=4, dropout=0.0, rslora=False, targets=["q_proj"], base_init=recipe))
    return out


def _edit(recipe, path, value):
    import copy

    recipe = copy.deepcopy(recipe)
    *head, last = path
    d = recipe
    for k in head:
        d = d[k]
    d[last] = value
    return recipe


@pytest.mark.parametrize("path, value, message", [
    (("config", "vocab_size"), -5, r"base_init.config.vocab_size: Input should be greater than or equal to 1, got -5"),
    (("config", "num_hidden_layers"), 100_000, r"base_init.config.num_hidden_layers: Input should be less than or "
                                               r"equal to 512, got 100000"),
    (("config", "hidden_size"), "64", r"base_init.config.hidden_size: Input should be a valid integer, got '64'"),
    (("dtype",), "float8", r"base_init.dtype: Input should be 'float32', 'bfloat16' or 'float16', got 'float8'"),
    (("init_std",), float("nan"), r"base_init.init_std: Input should be a finite number"),
    (("seed",), None, r"base_init.seed: Input should be a valid integer"),
    (("config", "model_type"), "llama", r"base_init.config: model_type 'llama' is not supported"),
    (("config", "num_key_value_heads"), 3, r"base_init.config: invalid glm4_moe model config: num_attention_heads "
                                           r"must be a multiple of num_key_value_heads"),
])
def test_a_hostile_base_init_is_refused_naming_the_file_and_key(tmp_path, capsys, path, value, message):
    from moetune.errors import CheckpointError
    from moetune.export.run_base import resolve_base
    from moetune.model.adapter_io import read_adapter_config

    recipe = _edit(base_recipe(load_config(None, []), "cpu"), path, value)
    adapter = _adapter_with_recipe(tmp_path, recipe)
    where = f"{adapter}/adapter_config.json: "
    with pytest.raises(CheckpointError, match="^" + re.escape(where) + message):
        resolve_base(str(adapter), read_adapter_config(str(adapter)))
    with pytest.raises(CheckpointError, match=message):
        build_base(recipe)
    rc = main(["export", "adapter", "--checkpoint", str(adapter), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err and where in err, err
    assert not (tmp_path / "hostile" / "base").exists() and not (tmp_path / "out").exists()


def test_a_base_init_that_is_not_a_mapping_is_refused(tmp_path):
    from moetune.errors import CheckpointError
    from moetune.export.run_base import resolve_base

    with pytest.raises(CheckpointError, match=r"adapter_config.json: base_init must be a mapping, got list"):
        resolve_base(str(tmp_path), {"base_init": [1, 2]}, base="/given/base")
