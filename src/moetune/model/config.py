"""ModelConfig: the GLM-4.5 MoE architecture's numbers, read from an HF `config.json`.

Hub configs carry `rope_theta` / `partial_rotary_factor` at the top level; transformers v5 moves them into
`rope_parameters` (which wins when both exist, as in transformers). We accept both eras.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields


@dataclass
class ModelConfig:
    vocab_size: int = 151552
    hidden_size: int = 4096
    intermediate_size: int = 10944
    moe_intermediate_size: int = 1408
    num_hidden_layers: int = 46
    num_attention_heads: int = 96
    num_key_value_heads: int = 8
    head_dim: int = 128
    n_routed_experts: int = 128
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 1
    partial_rotary_factor: float = 0.5
    rope_theta: float = 1_000_000.0
    use_qk_norm: bool = False
    attention_bias: bool = True
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    initializer_range: float = 0.02
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    num_nextn_predict_layers: int = 0
    # keys of the source config.json we do not model; kept so that export writes them back unchanged
    extra: dict = field(default_factory=dict, repr=False)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace

    def validate(self) -> "ModelConfig":
        problems = []
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if self.n_routed_experts % self.n_group:
            problems.append("n_routed_experts must be a multiple of n_group")
        if not 1 <= self.topk_group <= self.n_group:
            problems.append("topk_group must be in [1, n_group]")
        if self.num_experts_per_tok > self.n_routed_experts:
            problems.append("num_experts_per_tok exceeds n_routed_experts")
        if self.rotary_dim % 2:
            problems.append("head_dim * partial_rotary_factor must be even")
        if self.hidden_act != "silu":
            problems.append(f"hidden_act {self.hidden_act!r} is not supported (GLM-4.5 uses silu)")
        if problems:
            raise ValueError("invalid GLM-4.5 model config: " + "; ".join(problems))
        return self

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        if d.get("model_type", "glm4_moe") != "glm4_moe":
            raise ValueError(f"model_type {d.get('model_type')!r} is not glm4_moe (GLM-4.5 / 4.5-Air / 4.6 / 4.7)")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        # transformers v5 reads rope_parameters first (its top-level partial_rotary_factor is a stale default)
        for key in ("rope_theta", "partial_rotary_factor"):
            if key in rope:
                d[key] = rope[key]
        if rope.get("rope_type", "default") not in ("default", None):
            raise ValueError(f"rope_type {rope.get('rope_type')!r} is not supported (only the default RoPE)")
        if "num_local_experts" in d and "n_routed_experts" not in d:
            d["n_routed_experts"] = d["num_local_experts"]
        if d.get("head_dim") is None:
            d["head_dim"] = d.get("hidden_size", cls.hidden_size) // d.get("num_attention_heads", cls.num_attention_heads)
        names = {f.name for f in fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        cfg = cls(**known)
        cfg.extra = {k: v for k, v in d.items() if k not in names}
        return cfg.validate()

    @classmethod
    def from_json(cls, path: str) -> "ModelConfig":
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path) as f:
                d = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
        return cls.from_hf_dict(d)

    def to_hf_dict(self) -> dict:
        """The config.json transformers' Glm4MoeConfig reads (top-level rope keys, as the hub writes them)."""
        d = asdict(self)
        extra = d.pop("extra")
        out = {**extra, **d}
        out.pop("rope_parameters", None)
        out["model_type"] = "glm4_moe"
        out.setdefault("architectures", ["Glm4MoeForCausalLM"])
        out["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.partial_rotary_factor,
        }
        return out


# Builtin shapes (DESIGN.md §4). Weights for these are never downloaded: they serve proxies and `inspect`.
GLM45_AIR = dict(
    vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
    num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
    n_routed_experts=128, num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1,
    routed_scaling_factor=1.0, norm_topk_prob=True, first_k_dense_replace=1, partial_rotary_factor=0.5,
    rope_theta=1e6, use_qk_norm=False, attention_bias=True, rms_norm_eps=1e-5, num_nextn_predict_layers=1,
)
GLM45 = dict(
    GLM45_AIR, hidden_size=5120, num_hidden_layers=92, n_routed_experts=160, moe_intermediate_size=1536,
    intermediate_size=12288, first_k_dense_replace=3, routed_scaling_factor=2.5, use_qk_norm=True,
)
# The embedded demo: GLM-4.5's architecture at a size that trains in a minute or two on 2 CPU cores.
TINY = dict(
    vocab_size=160, hidden_size=128, intermediate_size=384, moe_intermediate_size=96,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
    routed_scaling_factor=1.0, norm_topk_prob=True, first_k_dense_replace=1, partial_rotary_factor=0.5,
    rope_theta=10000.0, use_qk_norm=False, attention_bias=True, rms_norm_eps=1e-5,
    max_position_embeddings=4096, pad_token_id=0, eos_token_id=0,
)
BUILTIN = {
    "tiny": TINY,
    "glm45-air": GLM45_AIR,
    "glm45-air-8layers": dict(GLM45_AIR, num_hidden_layers=8),
    "glm45": GLM45,
}


def resolve_model_config(path: str | None, config: str | dict | None, num_hidden_layers: int | None = None) -> ModelConfig:
    """ModelConfig from a checkpoint dir, a config.json path, an inline dict or a builtin name."""
    if config is None and path is not None:
        cfg = ModelConfig.from_json(path)
    elif config is None or (isinstance(config, str) and config in BUILTIN):
        cfg = ModelConfig.from_hf_dict(BUILTIN[config or "tiny"])
    elif isinstance(config, dict):
        cfg = ModelConfig.from_hf_dict(config)
    else:
        cfg = ModelConfig.from_json(config)
    if num_hidden_layers is not None:
        cfg.num_hidden_layers = num_hidden_layers
    return cfg


def model_config_for(cfg) -> ModelConfig:
    """The architecture a run's config (moetune.config.Config) describes."""
    return resolve_model_config(cfg.model.path, cfg.model.effective_config, cfg.model.num_hidden_layers)
