"""ModelConfig: the numbers of a GLM MoE architecture, read from an HF `config.json`.

Three model types (`model_type`): `glm4_moe` (GLM-4.5 / 4.5-Air / 4.6 / 4.7: GQA attention),
`glm4_moe_lite` (GLM-4.7-Flash: multi-head latent attention, MLA) and `glm_moe_dsa` (GLM-5.x: MLA plus the
DeepSeek sparse-attention indexer). Fields of the other types keep their defaults and are not written back.

Hub configs carry `rope_theta` / `partial_rotary_factor` at the top level; transformers v5 moves them into
`rope_parameters` (which wins when both exist, as in transformers). We accept both eras.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields

from moetune.errors import ConfigError

GLM4_MOE, GLM4_MOE_LITE, GLM_MOE_DSA = "glm4_moe", "glm4_moe_lite", "glm_moe_dsa"
ARCHITECTURES = {GLM4_MOE: "Glm4MoeForCausalLM", GLM4_MOE_LITE: "Glm4MoeLiteForCausalLM",
                 GLM_MOE_DSA: "GlmMoeDsaForCausalLM"}
_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mlp_layer_types")
_TYPE_FIELDS = {
    GLM4_MOE: ("use_qk_norm",),
    GLM4_MOE_LITE: _MLA_FIELDS + ("rope_interleave",),
    GLM_MOE_DSA: _MLA_FIELDS + ("index_topk", "index_head_dim", "index_n_heads", "indexer_types"),
}


# transformers 5.17's config defaults (Glm4MoeLiteConfig, GlmMoeDsaConfig): GLM-4.7-Flash's and GLM-5's shapes.
_HF_DEFAULTS = {
    GLM4_MOE_LITE: dict(
        vocab_size=154880, hidden_size=2048, intermediate_size=10240, moe_intermediate_size=1536,
        num_hidden_layers=47, num_attention_heads=20, num_key_value_heads=20, n_shared_experts=1,
        n_routed_experts=64, routed_scaling_factor=1.8, kv_lora_rank=512, q_lora_rank=768, qk_rope_head_dim=64,
        v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1, num_experts_per_tok=4, norm_topk_prob=True,
        max_position_embeddings=202752, rms_norm_eps=1e-5, rope_theta=10000.0, rope_interleave=True,
        attention_bias=False,
    ),
    GLM_MOE_DSA: dict(
        vocab_size=154880, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
        num_hidden_layers=78, num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1,
        n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=2048, qk_rope_head_dim=64,
        v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1, num_experts_per_tok=8, norm_topk_prob=True,
        max_position_embeddings=202752, rms_norm_eps=1e-5, rope_theta=10000.0, attention_bias=False,
        index_topk=2048, index_head_dim=128, index_n_heads=32, first_k_dense_replace=3,
    ),
}

_DSA = _HF_DEFAULTS[GLM_MOE_DSA]  # the MLA fields' defaults below (unused by glm4_moe)


def read_json_object(path) -> dict:
    """A model's config.json as a dict; a file that is not a JSON object is a ValueError naming the file and line
    (OSError as open raises it)."""
    with open(path) as f:
        try:
            obj = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object (a model config), got {type(obj).__name__}")
    return obj


@dataclass
class ModelConfig:
    """Defaults: GLM-4.5-Air (glm4_moe), the one table of its numbers (the builtin `glm45-air` is these)."""

    model_type: str = GLM4_MOE
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
    # MLA (glm4_moe_lite, glm_moe_dsa); head_dim is then qk_rope_head_dim, as transformers maps it
    q_lora_rank: int | None = None  # None: one q_proj instead of q_a_proj → q_a_layernorm → q_b_proj
    kv_lora_rank: int = _DSA["kv_lora_rank"]
    qk_nope_head_dim: int = _DSA["qk_nope_head_dim"]
    qk_rope_head_dim: int = _DSA["qk_rope_head_dim"]
    v_head_dim: int = _DSA["v_head_dim"]
    rope_interleave: bool = True  # glm4_moe_lite only; glm_moe_dsa always interleaves
    mlp_layer_types: list[str] | None = None  # "dense" / "sparse" per layer (MLA types)
    # DSA indexer (glm_moe_dsa)
    index_topk: int = _DSA["index_topk"]
    index_head_dim: int = _DSA["index_head_dim"]
    index_n_heads: int = _DSA["index_n_heads"]
    indexer_types: list[str] | None = None  # "full" (own top-k) / "shared" (the previous layer's) per layer
    # keys of the source config.json we do not model; kept so that export writes them back unchanged
    extra: dict = field(default_factory=dict, repr=False)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_mla(self) -> bool:
        return self.model_type != GLM4_MOE

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types[layer_idx] == "sparse"
        return layer_idx >= self.first_k_dense_replace

    def indexer_type(self, layer_idx: int) -> str:
        return self.indexer_types[layer_idx] if self.indexer_types is not None else "full"

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
        if self.is_mla:
            problems += self._mla_problems()
        if problems:
            raise ConfigError(f"invalid {self.model_type} model config: " + "; ".join(problems))
        return self

    def _mla_problems(self) -> list[str]:
        problems = []
        if self.rotary_dim != self.qk_rope_head_dim:
            problems.append(f"RoPE must rotate all qk_rope_head_dim={self.qk_rope_head_dim} dims "
                            f"(partial_rotary_factor {self.partial_rotary_factor})")
        if self.qk_rope_head_dim % 2:
            problems.append("qk_rope_head_dim must be even")
        for key, allowed in (("mlp_layer_types", ("dense", "sparse")), ("indexer_types", ("full", "shared"))):
            types = getattr(self, key)
            if types is None:
                continue
            if len(types) < self.num_hidden_layers:
                problems.append(f"{key} has {len(types)} entries for {self.num_hidden_layers} layers")
            bad = sorted(set(types) - set(allowed))
            if bad:
                problems.append(f"{key} holds {bad}; allowed: {list(allowed)}")
        if self.model_type == GLM_MOE_DSA:
            if self.q_lora_rank is None:
                problems.append("glm_moe_dsa needs q_lora_rank (its indexer reads the compressed query)")
            if self.indexer_types and self.indexer_types[0] != "full":
                problems.append("indexer_types[0] must be 'full': a 'shared' layer reuses an earlier layer's top-k")
            if not self.qk_rope_head_dim <= self.index_head_dim:
                problems.append("index_head_dim must be at least qk_rope_head_dim")
        return problems

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        model_type = d.setdefault("model_type", GLM4_MOE)
        if model_type not in ARCHITECTURES:
            raise ConfigError(f"model_type {model_type!r} is not supported; moetune reads {', '.join(ARCHITECTURES)} "
                              "(GLM-4.5/4.5-Air/4.6/4.7, GLM-4.7-Flash, GLM-5.x)")
        if model_type != GLM4_MOE:
            # transformers' defaults for keys a config.json leaves out (they differ from GLM-4.5's)
            d = {**_HF_DEFAULTS[model_type], **d}
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        # transformers v5 reads rope_parameters first (its top-level partial_rotary_factor is a stale default)
        for key in ("rope_theta", "partial_rotary_factor"):
            if key in rope:
                d[key] = rope[key]
        if rope.get("rope_type", "default") not in ("default", None):
            raise ConfigError(f"rope_type {rope.get('rope_type')!r} is not supported (only the default RoPE)")
        if "num_local_experts" in d and "n_routed_experts" not in d:
            d["n_routed_experts"] = d["num_local_experts"]
        if model_type != GLM4_MOE:
            _mla_from_hf(d)
        if d.get("head_dim") is None:
            d["head_dim"] = d.get("hidden_size", cls.hidden_size) // d.get("num_attention_heads", cls.num_attention_heads)
        other_types = {k for fs in _TYPE_FIELDS.values() for k in fs} - set(_TYPE_FIELDS[model_type])
        names = {f.name for f in fields(cls)} - {"extra"} - other_types
        known = {k: v for k, v in d.items() if k in names}
        cfg = cls(**known)
        cfg.extra = {k: v for k, v in d.items() if k not in names}
        return cfg.validate()

    @classmethod
    def from_json(cls, path: str) -> "ModelConfig":
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            d = read_json_object(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"no config.json at {path}") from None
        return cls.from_hf_dict(d)

    def to_hf_dict(self) -> dict:
        """The config.json transformers' config class of this model_type reads."""
        d = asdict(self)
        extra = d.pop("extra")
        for t, names in _TYPE_FIELDS.items():
            if t != self.model_type:
                for k in set(names) - set(_TYPE_FIELDS[self.model_type]):
                    d.pop(k, None)
        for key in ("mlp_layer_types", "indexer_types"):  # a proxy's truncation
            if d.get(key) is not None:
                d[key] = d[key][: self.num_hidden_layers]
        if self.model_type == GLM4_MOE_LITE:
            d.pop("head_dim")  # transformers maps it onto qk_rope_head_dim
        out = {**extra, **d}
        out.pop("rope_parameters", None)
        out.setdefault("architectures", [ARCHITECTURES[self.model_type]])
        out["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.partial_rotary_factor,
        }
        return out


def _mla_from_hf(d: dict) -> None:
    """What transformers derives for the MLA types, in place: head_dim, the dense/MoE and indexer patterns."""
    n = d.get("num_hidden_layers", ModelConfig.num_hidden_layers)
    d["head_dim"] = d["qk_rope_head_dim"]  # the RoPE slice: transformers points head_dim at it
    if d["model_type"] == GLM_MOE_DSA:
        d["partial_rotary_factor"] = 1.0  # its RoPE ignores the factor
    else:
        d.setdefault("partial_rotary_factor", 1.0)
    if d.get("mlp_layer_types") is None:
        if d["model_type"] == GLM4_MOE_LITE:
            # transformers builds layer 0 dense and the rest MoE whatever first_k_dense_replace says
            if d.get("first_k_dense_replace", 1) != 1:
                raise ConfigError(f"glm4_moe_lite config: first_k_dense_replace {d['first_k_dense_replace']} without "
                                  "mlp_layer_types (transformers makes only layer 0 dense); give mlp_layer_types")
            dense = 1
        else:
            dense = min(d.get("first_k_dense_replace", 3), n)
        d["mlp_layer_types"] = ["dense"] * dense + ["sparse"] * (n - dense)
    types = d["mlp_layer_types"]
    d["first_k_dense_replace"] = next((i for i, t in enumerate(types) if t != "dense"), len(types))
    if d["model_type"] == GLM_MOE_DSA and d.get("indexer_types") is None:
        # as GlmMoeDsaConfig: a pattern ("FSSF...") or the freq/offset schedule
        pattern = d.get("index_topk_pattern")
        if pattern is not None:
            d["indexer_types"] = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        else:
            freq, offset = max(d.get("index_topk_freq", 1), 1), d.get("index_skip_topk_offset", 2)
            d["indexer_types"] = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]


# Builtin shapes (DESIGN.md §4). Weights for these are never downloaded: they serve proxies and `inspect`.
_GLM4_MOE_KEYS = {"vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "n_routed_experts", "num_experts_per_tok",
                  "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob",
                  "first_k_dense_replace", "partial_rotary_factor", "rope_theta", "use_qk_norm", "attention_bias",
                  "rms_norm_eps"}
GLM45_AIR = dict({f.name: f.default for f in fields(ModelConfig) if f.name in _GLM4_MOE_KEYS},
                 num_nextn_predict_layers=1)
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
# GLM-4.7-Flash (card: 30B-A3B) and GLM-5 (card: 744B, 40B active) shapes, with the MTP layer the hub ships.
GLM47_FLASH = dict(_HF_DEFAULTS[GLM4_MOE_LITE], model_type=GLM4_MOE_LITE, rope_theta=1e6, num_nextn_predict_layers=1)
GLM5 = dict(_HF_DEFAULTS[GLM_MOE_DSA], model_type=GLM_MOE_DSA, rope_theta=1e6, num_nextn_predict_layers=1)
BUILTIN = {
    "tiny": TINY,
    "glm47-flash": GLM47_FLASH,
    "glm5": GLM5,
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
        for key in ("mlp_layer_types", "indexer_types"):
            if getattr(cfg, key) is not None:
                setattr(cfg, key, getattr(cfg, key)[:num_hidden_layers])
        cfg.validate()
    return cfg


def model_config_for(cfg) -> ModelConfig:
    """The architecture a run's config (moetune.config.Config) describes."""
    return resolve_model_config(cfg.model.path, cfg.model.effective_config, cfg.model.num_hidden_layers)
