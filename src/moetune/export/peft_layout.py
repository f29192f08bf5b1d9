"""moetune LoRA names/layouts <-> PEFT's, as PEFT 0.21 on transformers 5.17 lays them out (verified by
tests/unit/test_lora_peft_parity.py against PEFT itself; every fact below is checked there).

Linear targets (GQA q/k/v/o_proj; MLA q_proj or q_a_proj + q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj;
dense-layer and shared-expert gate/up/down_proj; the same for glm4_moe, glm4_moe_lite and glm_moe_dsa, whose
module names are transformers'):
    ours  model.layers.N.self_attn.q_proj.lora_A            [r, in]
    PEFT  base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight   (same tensor; lora_B likewise)

Routed experts (PEFT `target_parameters`, one ParamWrapper per stacked parameter; gate_up_proj is wrapped
first, so it is the inner wrapper and its LoRA lives under `.base_layer`):
    ours gate_up_A [E, r, H]  ->  ...mlp.experts.base_layer.lora_A.weight  [E·r, H]   row  e·r + j  (expert-major)
    ours gate_up_B [E, 2I, r] ->  ...mlp.experts.base_layer.lora_B.weight  [2I, r·E]  col  j·E + e  (rank-major)
    ours down_A    [E, r, I]  ->  ...mlp.experts.lora_A.weight             [E·r, I]   row  e·r + j
    ours down_B    [E, H, r]  ->  ...mlp.experts.lora_B.weight             [H, r·E]   col  j·E + e
PEFT reads A as A.reshape(E, r, in) and B as B.reshape(out, r, E): the two factors order experts differently.
(vLLM's reader of this layout, lora/model_manager.py `_stack_moe_lora_weights`, reshapes the same way.)

Why dense/shared MLPs go through `target_parameters` (their 2-D `.weight`) and never `target_modules`: for
glm4_moe PEFT rewrites `target_modules` entries named gate_proj/up_proj/down_proj (bare or dotted) into the
*routed experts'* fused parameters (with gate_up rank and alpha doubled) and removes them from target_modules,
so the dense layers and shared experts silently get no LoRA. A 2-D target parameter gets a ParamWrapper whose
LoRA keys are exactly those of a LoRA Linear, and PEFT does not rewrite target_parameters. ParamWrapper refuses
lora_dropout != 0, so exported configs carry dropout 0 (dropout is a training-time device anyway).
"""

from __future__ import annotations

import re

import torch

from moetune.names import ATTENTION_TARGETS, MLA_ATTENTION_TARGETS

# attention projections PEFT adapts as LoRA Linear (target_modules), GQA's then MLA's
ATTENTION = ATTENTION_TARGETS + MLA_ATTENTION_TARGETS
QUERY_FORMS = ("q_proj", "q_a_proj", "q_b_proj")  # an MLA model has q_proj or q_a_proj + q_b_proj

PREFIX = "base_model.model."
MLP_PROJ = ("gate_proj", "up_proj", "down_proj")
# target kind -> the PEFT target_parameters that express it
TARGET_PARAMETERS = {
    "dense_mlp": [f"mlp.{p}.weight" for p in MLP_PROJ],
    "shared_experts": [f"mlp.shared_experts.{p}.weight" for p in MLP_PROJ],
    "experts": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
}
_EXPERT_OURS = {  # our suffix -> (PEFT suffix, factor)
    "lora.gate_up_A": ("base_layer.lora_A.weight", "A"),
    "lora.gate_up_B": ("base_layer.lora_B.weight", "B"),
    "lora.down_A": ("lora_A.weight", "A"),
    "lora.down_B": ("lora_B.weight", "B"),
}
_EXPERT_PEFT = {v[0]: (k, v[1]) for k, v in _EXPERT_OURS.items()}
_OURS_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(lora\.(?:gate_up|down)_[AB])$")
_PEFT_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.((?:base_layer\.)?lora_[AB]\.weight)$")
_LINEAR_RE = re.compile(r"^(model\.layers\.\d+\.(?:self_attn\.(?:" + "|".join(ATTENTION) + r")"
                        r"|mlp\.(?:shared_experts\.)?(?:gate|up|down)_proj))\.(lora_[AB])$")


# ------------------------------------------------------------------------------------------ tensor layouts
def expert_A_to_peft(A: torch.Tensor) -> torch.Tensor:
    """[E, r, in] -> [E·r, in], row e·r + j."""
    E, r, n = A.shape
    return A.reshape(E * r, n)


def expert_B_to_peft(B: torch.Tensor) -> torch.Tensor:
    """[E, out, r] -> [out, r·E], column j·E + e."""
    E, out, r = B.shape
    return B.permute(1, 2, 0).reshape(out, r * E)


def expert_A_from_peft(A: torch.Tensor, rank: int) -> torch.Tensor:
    return A.reshape(A.shape[0] // rank, rank, A.shape[1])


def expert_B_from_peft(B: torch.Tensor, rank: int) -> torch.Tensor:
    out, rE = B.shape
    return B.reshape(out, rank, rE // rank).permute(2, 0, 1)


# ------------------------------------------------------------------------------------------ names
def peft_key(our_key: str) -> str:
    """Our LoRA parameter name -> PEFT's saved key (no adapter name, as in adapter_model.safetensors)."""
    m = _OURS_EXPERT_RE.match(our_key)
    if m:
        return f"{PREFIX}{m.group(1)}.{_EXPERT_OURS[m.group(2)][0]}"
    if _LINEAR_RE.match(our_key):
        return f"{PREFIX}{our_key}.weight"
    raise ValueError(f"{our_key} is not a moetune LoRA parameter name")


def strip_adapter_name(key: str) -> str:
    # in-memory PEFT keys carry the adapter name (`lora_A.default.weight`); saved ones do not
    return re.sub(r"\.(lora_[AB])\.(?!weight$)[^.]+\.weight$", r".\1.weight", key)


def our_key(peft_key_: str) -> str:
    """PEFT key (saved, or in-memory with an adapter name) -> our LoRA parameter name."""
    key = strip_adapter_name(peft_key_)
    if not key.startswith(PREFIX):
        raise ValueError(f"{peft_key_}: PEFT LoRA keys start with {PREFIX!r}")
    key = key[len(PREFIX):]
    m = _PEFT_EXPERT_RE.match(key)
    if m:
        return f"{m.group(1)}.{_EXPERT_PEFT[m.group(2)][0]}"
    if key.endswith(".weight") and _LINEAR_RE.match(key[: -len(".weight")]):
        return key[: -len(".weight")]
    raise ValueError(f"{peft_key_} is not a LoRA key moetune can map (attention projections, dense/shared MLP, experts)")


def targets_of(state: dict) -> list[str]:
    """The moetune target kinds present in a state dict of our LoRA names."""
    kinds = set()
    for k in state:
        parts = k.split(".")
        if "experts" in parts and "lora" in parts:
            kinds.add("experts")
        elif "shared_experts" in parts:
            kinds.add("shared_experts")
        elif "self_attn" in parts:
            kinds.add(parts[parts.index("self_attn") + 1])
        else:
            kinds.add("dense_mlp")
    order = list(ATTENTION) + ["dense_mlp", "shared_experts", "experts"]
    return [t for t in order if t in kinds]


# ------------------------------------------------------------------------------------------ public
def peft_config_dict(targets, rank: int, alpha: float, rslora: bool = False, base_model: str | None = None) -> dict:
    """The adapter_config.json PEFT needs to rebuild exactly our LoRA (see the module docstring for why the
    MLPs are target_parameters). Keys PEFT does not find here take its defaults."""
    unknown = set(targets) - set(ATTENTION) - set(TARGET_PARAMETERS)
    if unknown:
        raise ValueError(f"LoRA targets {sorted(unknown)} cannot be expressed for PEFT")
    modules = [t for t in ATTENTION if t in targets]
    params = [p for kind, ps in TARGET_PARAMETERS.items() if kind in targets for p in ps]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": int(rank),
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "use_rslora": bool(rslora),
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": modules or None,
        "target_parameters": params or None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": True,
        "inference_mode": True,
    }


def to_peft_state_dict(our_state: dict, cfg: dict, base_model: str | None = None) -> tuple[dict, dict]:
    """(our LoRA tensors, our adapter meta {rank, alpha, rslora, targets?}) -> (PEFT state, PEFT adapter_config).

    `cfg` is a moetune adapter_config.json (or any dict with rank/alpha/rslora); targets default to those the
    state holds.
    """
    rank = int(cfg["rank"])
    present = targets_of(our_state)
    # the mla_attention alias names both query forms; the adapter holds the one its model has
    targets = [t for t in cfg.get("targets") or present if t not in QUERY_FORMS or t in present]
    out = {}
    for k, v in our_state.items():
        m = _OURS_EXPERT_RE.match(k)
        if m:
            factor = _EXPERT_OURS[m.group(2)][1]
            if v.dim() != 3 or (v.shape[1] if factor == "A" else v.shape[2]) != rank:
                raise ValueError(f"{k}: shape {list(v.shape)} does not fit rank {rank}")
            v = expert_A_to_peft(v) if factor == "A" else expert_B_to_peft(v)
        out[peft_key(k)] = v.contiguous()
    config = peft_config_dict(targets, rank, cfg["alpha"], cfg.get("rslora", False),
                              base_model if base_model is not None else cfg.get("base_model"))
    return out, config


def from_peft_state_dict(peft_state: dict, peft_config: dict) -> tuple[dict, dict]:
    """Inverse of to_peft_state_dict: (PEFT state, PEFT adapter_config) -> (our LoRA tensors, our meta).

    Raises on PEFT configurations whose meaning differs from ours (per-module ranks or alphas, DoRA, biases).
    """
    for key in ("rank_pattern", "alpha_pattern"):
        if peft_config.get(key):
            raise ValueError(f"PEFT adapter has {key}={peft_config[key]}: moetune adapters have one rank and alpha")
    for key in ("use_dora", "lora_bias", "fan_in_fan_out"):
        if peft_config.get(key):
            raise ValueError(f"PEFT adapter uses {key}, which moetune's LoRA does not model")
    rank = int(peft_config["r"])
    out = {}
    for k, v in peft_state.items():
        name = our_key(k)
        m = _OURS_EXPERT_RE.match(name)
        if m:
            v = expert_A_from_peft(v, rank) if _EXPERT_OURS[m.group(2)][1] == "A" else expert_B_from_peft(v, rank)
        out[name] = v.contiguous()
    meta = {"rank": rank, "alpha": peft_config["lora_alpha"], "dropout": 0.0,
            "rslora": bool(peft_config.get("use_rslora", False)), "targets": targets_of(out),
            "base_model": peft_config.get("base_model_name_or_path")}
    return out, meta
