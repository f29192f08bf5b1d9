"""`export_adapter`: PEFT adapters that PEFT applies with moetune's logits, vLLM's per-expert layout."""

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file

import moetune
from moetune.export import ExportError, export_adapter
from helpers import TINY_HF, hf_model, random_adapter, save_hf, vllm_adapter_table

peft = pytest.importorskip("peft")

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTN + ["dense_mlp", "shared_experts", "experts"]


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture
def base(tmp_path):
    return save_hf(hf_model(seed=11), tmp_path / "base")


def peft_logits(base_path, adapter, ids):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
        pm = peft.PeftModel.from_pretrained(hf, str(adapter)).eval()
    with torch.no_grad():
        return pm(input_ids=ids).logits


@pytest.mark.parametrize("targets,rslora", [
    (ATTN + ["shared_experts", "experts"], False),
    (ALL, True),
    (["experts"], False),
    (["dense_mlp", "shared_experts"], False),
])
def test_peft_round_trip_logits(tmp_path, base, targets, rslora):
    ours = random_adapter(base, tmp_path / "run" / "adapter", targets, rank=4, alpha=6.0, rslora=rslora)
    report = export_adapter(tmp_path / "run", tmp_path / "peft", format="peft")
    ids = torch.randint(0, TINY_HF["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ours(ids)
    got = peft_logits(base, tmp_path / "peft", ids)
    assert rel_err(got, want) < 1e-4
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 6.0 and cfg["use_rslora"] is rslora
    assert cfg["base_model_name_or_path"] == base
    # the MLPs never go through target_modules: PEFT would rewrite them into the routed experts
    assert set(cfg["target_modules"] or []) == set(ATTN) & set(targets)
    assert not {"gate_proj", "up_proj", "down_proj"} & set(cfg["target_modules"] or [])
    assert report["tensors"] == len(load_file(tmp_path / "peft" / "adapter_model.safetensors"))
    keys = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert all(k.startswith("base_model.model.model.layers.") and k.endswith((".lora_A.weight", ".lora_B.weight"))
               for k in keys)


def test_peft_export_verify_reports_errors(tmp_path, base):
    random_adapter(base, tmp_path / "adapter", ALL)
    report = export_adapter(tmp_path / "adapter", tmp_path / "peft", format="peft", verify=True)
    assert report["verify"]["peft_vs_moetune"] < 1e-4
    assert report["verify"]["base_vs_moetune_info"] > 1e-2  # the adapter really was applied


def vllm_table(cfg, r, targets):
    """Every key and shape vLLM expects for GLM-4.5 (see moetune/export/vllm_layout.py for the source)."""
    H = cfg["hidden_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    attn = {"q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H)}
    return vllm_adapter_table(cfg, r, targets, attn, cfg["first_k_dense_replace"])


@pytest.mark.parametrize("targets", [ALL, ATTN + ["experts"]])
def test_vllm_layout_names_and_shapes(tmp_path, base, targets):
    ours = random_adapter(base, tmp_path / "adapter", targets, rank=4)
    export_adapter(tmp_path / "adapter", tmp_path / "vllm", format="vllm")
    got = load_file(tmp_path / "vllm" / "adapter_model.safetensors")
    want = vllm_table(TINY_HF, 4, targets)
    assert {k: tuple(v.shape) for k, v in got.items()} == want
    # contents: gate and up share expert e's A; their B are the halves of the fused B; down as is
    lora = ours.model.layers[2].mlp.experts.lora
    p, I = "base_model.model.model.layers.2.mlp.experts.5", TINY_HF["moe_intermediate_size"]
    assert torch.equal(got[f"{p}.gate_proj.lora_A.weight"], lora.gate_up_A[5])
    assert torch.equal(got[f"{p}.up_proj.lora_A.weight"], lora.gate_up_A[5])
    assert torch.equal(got[f"{p}.gate_proj.lora_B.weight"], lora.gate_up_B[5, :I])
    assert torch.equal(got[f"{p}.up_proj.lora_B.weight"], lora.gate_up_B[5, I:])
    assert torch.equal(got[f"{p}.down_proj.lora_A.weight"], lora.down_A[5])
    assert torch.equal(got[f"{p}.down_proj.lora_B.weight"], lora.down_B[5])
    cfg = json.loads((tmp_path / "vllm" / "adapter_config.json").read_text())
    leaves = {"dense_mlp", "shared_experts", "experts"} & set(targets)
    assert set(cfg["target_modules"]) == (set(ATTN) & set(targets)) | ({"gate_proj", "up_proj", "down_proj"} if leaves else set())
    assert cfg["r"] == 4 and cfg["peft_type"] == "LORA"


def test_vllm_layout_numerically_via_peft_v4_moe_reader(tmp_path, base):
    """The per-expert names are also transformers-v4's MoE adapter layout, which PEFT converts for v5 models:
    an independent numeric check of the split gate/up (attention + experts; no rsLoRA, see verify.py)."""
    ours = random_adapter(base, tmp_path / "adapter", ATTN + ["experts"], rank=4, alpha=12.0)
    report = export_adapter(tmp_path / "adapter", tmp_path / "vllm", format="vllm", verify=True)
    assert report["verify"]["tensors_round_trip"] and report["verify"]["peft_vs_moetune"] < 1e-4
    ids = torch.randint(0, TINY_HF["vocab_size"], (2, 16))
    with torch.no_grad():
        assert rel_err(peft_logits(base, tmp_path / "vllm", ids), ours(ids)) < 1e-4


def test_vllm_verify_structural_for_mlp_targets(tmp_path, base):
    random_adapter(base, tmp_path / "adapter", ALL, rslora=True)
    report = export_adapter(tmp_path / "adapter", tmp_path / "vllm", format="vllm", verify=True)
    assert report["verify"] == {"tensors_round_trip": True}


def test_native_adapter_round_trips_through_moetune_load(tmp_path, base):
    ours = random_adapter(base, tmp_path / "adapter", ALL)
    again = moetune.load_model(base, dtype="float32", adapter=str(tmp_path / "adapter"))
    ids = torch.randint(0, TINY_HF["vocab_size"], (1, 12))
    with torch.no_grad():
        assert torch.equal(ours(ids), again(ids))


def test_input_errors(tmp_path, base):
    random_adapter(base, tmp_path / "run" / "adapter", ATTN)
    with pytest.raises(ExportError, match="unknown adapter format"):
        export_adapter(tmp_path / "run", tmp_path / "x", format="gguf")
    with pytest.raises(ExportError, match="no moetune adapter"):
        export_adapter(tmp_path / "nothing", tmp_path / "x")
    export_adapter(tmp_path / "run", tmp_path / "peft")
    with pytest.raises(ExportError, match="already exported"):
        export_adapter(tmp_path / "peft", tmp_path / "x")
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"")
    with pytest.raises(ExportError, match="not a complete moetune checkpoint"):
        export_adapter(tmp_path / "dcp", tmp_path / "x")
