"""Exports of GLM-4.7-Flash (glm4_moe_lite) and GLM-5 (glm_moe_dsa) adapters: PEFT adapters that PEFT applies on
transformers' Glm4MoeLiteForCausalLM / GlmMoeDsaForCausalLM with moetune's logits, and merged checkpoints that
transformers loads with moetune's base+adapter logits, the source's MTP layer carried through. (The vLLM layout of
these models is tests/unit/test_family_export_vllm.py.)"""

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import moetune
from family_models import hf_dsa, hf_lite
from helpers import random_adapter, save_hf
from moetune.export import export_adapter, export_merged
from moetune.export.merged_sources import export_merged_from_model
from moetune.names import LORA_ALIASES

peft = pytest.importorskip("peft")

MLA = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
MLP = ["dense_mlp", "shared_experts", "experts"]
MODELS = {  # name: (builder, overrides, LoRA targets)
    "lite": (hf_lite, {}, MLA + MLP),
    "lite_no_q_lora": (hf_lite, dict(q_lora_rank=None), ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                                                         "experts"]),
    "lite_alias": (hf_lite, {}, list(LORA_ALIASES["mla_all"])),  # names q_proj too, which this model lacks
    "dsa": (hf_dsa, {}, MLA + MLP),
}
SEQ = 20  # > TINY_DSA's index_topk (8): the indexer selects keys


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def _ids(vocab=96, seed=1):
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def _hf_logits(path, ids, adapter=None):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        if adapter is not None:
            m = peft.PeftModel.from_pretrained(m, str(adapter))
    with torch.no_grad():
        return m.eval()(input_ids=ids).logits


@pytest.mark.parametrize("case", list(MODELS))
def test_peft_export_applies_in_peft_with_our_logits(tmp_path, case):
    make, over, targets = MODELS[case]
    base = save_hf(make(seed=4, **over), tmp_path / "base")
    ours = random_adapter(base, tmp_path / "run" / "adapter", targets, rank=4, alpha=6.0, rslora=case == "dsa")
    report = export_adapter(tmp_path / "run", tmp_path / "peft", format="peft", verify=True)
    assert report["verify"]["peft_vs_moetune"] < 1e-4 and report["verify"]["base_vs_moetune_info"] > 1e-2
    ids = _ids()
    with torch.no_grad():
        want = ours(ids)
    assert rel_err(_hf_logits(base, ids, tmp_path / "peft"), want) < 1e-4
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    attention = [t for t in targets if t not in MLP]
    query = {"q_a_proj", "q_b_proj"} if over.get("q_lora_rank", 1) is not None else {"q_proj"}
    want_modules = {t for t in attention if t not in {"q_proj", "q_a_proj", "q_b_proj"} or t in query}
    assert set(cfg["target_modules"]) == want_modules  # only the query form the model has
    keys = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert any(".self_attn.kv_a_proj_with_mqa.lora_A.weight" in k for k in keys)
    assert report["tensors"] == len(keys)


def test_peft_export_of_a_trained_run(tmp_path):
    """LoRA B trained by a few optimizer steps (not set at random) on GLM-5's model, exported and verified."""
    base = save_hf(hf_dsa(seed=5), tmp_path / "base")
    model = moetune.load_model(base, dtype="float32")
    from moetune.model.adapter_io import save_adapter
    from moetune.model.lora import apply_lora, lora_state_dict

    targets = MLA + ["shared_experts", "experts"]
    apply_lora(model, targets, 4, 8.0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = _ids(seed=3)
    labels = torch.roll(ids, -1, 1)
    for _ in range(3):
        model(ids, labels=labels).backward()
        opt.step()
        opt.zero_grad()
    assert all(p.abs().sum() > 0 for n, p in model.named_parameters() if n.endswith(("lora_B", "_B")))
    save_adapter(lora_state_dict(model), str(tmp_path / "adapter"),
                 dict(rank=4, alpha=8.0, dropout=0.0, rslora=False, targets=targets), base_model=base)
    report = export_adapter(tmp_path / "adapter", tmp_path / "peft", format="peft", verify=True)
    assert report["verify"]["peft_vs_moetune"] < 1e-4


def _with_mtp_layer(path, n):
    """Add an MTP layer (`model.layers.{n}`: a copy of MoE layer 1 plus eh_proj) to the checkpoint at path, as the
    hub checkpoints of GLM-4.7-Flash and GLM-5 carry one."""
    f = f"{path}/model.safetensors"
    sd = load_file(f)
    mtp = {k.replace("model.layers.1.", f"model.layers.{n}."): v.clone() for k, v in sd.items()
           if k.startswith("model.layers.1.")}
    mtp[f"model.layers.{n}.eh_proj.weight"] = torch.randn(64, 128)
    save_file(sd | mtp, f)
    return mtp


@pytest.mark.parametrize("make", [hf_lite, hf_dsa], ids=["lite", "dsa"])
def test_merged_export_loads_in_transformers_and_carries_the_mtp_layer(tmp_path, make):
    ref = make(seed=6)
    base = save_hf(ref, tmp_path / "base")
    mtp = _with_mtp_layer(base, ref.config.num_hidden_layers)
    ours = random_adapter(base, tmp_path / "adapter", MLA + MLP, rank=4, alpha=8.0)
    report = export_merged(base, tmp_path / "adapter", tmp_path / "merged", dtype="float32", verify=True)
    assert report["verify"]["transformers_vs_moetune"] < 1e-4 and report["verify"]["merged_vs_reference"] < 1e-4
    ids = _ids(seed=2)
    with torch.no_grad():
        want = ours(ids)
    assert rel_err(_hf_logits(tmp_path / "merged", ids), want) < 1e-4
    out = load_file(tmp_path / "merged" / "model.safetensors")
    assert set(mtp) <= set(out)
    for k, v in mtp.items():  # the MTP layer as the source holds it: no LoRA lands there
        assert torch.equal(out[k], v), k
    a = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    assert not torch.equal(out[a], load_file(f"{base}/model.safetensors")[a])  # LoRA merged into MLA
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["model_type"] == ref.config.model_type
    assert config["first_k_dense_replace"] == 1  # what vLLM reads...
    if make is hf_lite:  # ...and transformers 5 leaves out of a glm4_moe_lite config (it writes mlp_layer_types)
        assert "first_k_dense_replace" not in json.loads((tmp_path / "base" / "config.json").read_text())


@pytest.mark.parametrize("make", [hf_lite, hf_dsa], ids=["lite", "dsa"])
def test_merged_export_from_a_model_in_memory(tmp_path, make):
    base = save_hf(make(seed=8), tmp_path / "base")
    ours = random_adapter(base, tmp_path / "adapter", MLA + ["experts"], rank=4)
    export_merged_from_model(ours, tmp_path / "merged", dtype="float32", base_path=base)
    ids = _ids(seed=5)
    with torch.no_grad():
        want = ours(ids)
    assert rel_err(_hf_logits(tmp_path / "merged", ids), want) < 1e-4


def test_cli_export_adapter_verify_passes_for_glm5(tmp_path, capsys):
    from moetune.cli import main

    base = save_hf(hf_dsa(seed=9), tmp_path / "base")
    random_adapter(base, tmp_path / "adapter", MLA + ["experts"])
    assert main(["export", "adapter", "--checkpoint", str(tmp_path / "adapter"), "--out", str(tmp_path / "peft"),
                 "--verify"]) == 0
    assert "verify: PASS" in capsys.readouterr().out
