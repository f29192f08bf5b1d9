"""A random-init base (the demo, proxies) as a recipe that rebuilds it bit for bit.

Such a base is never read from disk: `hf_io.init_weights` draws every tensor from a generator seeded by
(run.seed, tensor name) on the training device, whatever the sharding. The recipe is what that needs: the model
config, init std, dtype, seed and device type (CPU and CUDA generators draw different numbers). The trainer stores
it in the adapter (`base_init`), so the adapter alone finds its base again (export/run_base.py writes it out).
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moetune.errors import CheckpointError, ConfigError
from moetune.model.config import ModelConfig, resolve_model_config
from moetune.model.hf_io import as_dtype, build_model, cast_model, init_weights

# Bounds of a base that is rebuilt on every export and generate: far above any GLM release (92 layers, 160 routed
# experts, a 155k vocabulary), far below what would build for minutes before failing.
MAX_LAYERS = 512
_Count = Optional[int]


def _count(lo: int, hi: int):
    return Field(None, ge=lo, le=hi)


class _RecipeModel(BaseModel):
    """The numbers of the recipe's model config that size the build (the rest is ModelConfig's to check)."""

    model_config = ConfigDict(extra="allow", strict=True)
    vocab_size: _Count = _count(1, 1 << 21)
    hidden_size: _Count = _count(1, 1 << 16)
    intermediate_size: _Count = _count(1, 1 << 18)
    moe_intermediate_size: _Count = _count(1, 1 << 16)
    num_hidden_layers: _Count = _count(1, MAX_LAYERS)
    num_attention_heads: _Count = _count(1, 1024)
    num_key_value_heads: _Count = _count(1, 1024)
    head_dim: _Count = _count(1, 1024)
    n_routed_experts: _Count = _count(1, 4096)
    num_experts_per_tok: _Count = _count(1, 4096)
    n_shared_experts: _Count = _count(0, 64)
    first_k_dense_replace: _Count = _count(0, MAX_LAYERS)
    q_lora_rank: _Count = _count(1, 1 << 16)
    kv_lora_rank: _Count = _count(1, 1 << 16)
    qk_nope_head_dim: _Count = _count(1, 1024)
    qk_rope_head_dim: _Count = _count(1, 1024)
    v_head_dim: _Count = _count(1, 1024)
    index_n_heads: _Count = _count(1, 1024)
    index_head_dim: _Count = _count(1, 1024)


class _Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    config: _RecipeModel
    init_std: float = Field(gt=0, le=10, allow_inf_nan=False)
    seed: int = Field(ge=0, lt=1 << 63)
    dtype: Literal["float32", "bfloat16", "float16"]
    device: Literal["cpu", "cuda"] = "cpu"
    tokenizer: Optional[str] = None


def check_recipe(recipe, where: str = "base_init") -> dict:
    """``recipe`` (an adapter's ``base_init``), validated like a config: types, sane bounds, a model config moetune
    builds. Anything else is a CheckpointError naming ``where`` (the file holding it) and the key."""
    if not isinstance(recipe, dict):
        raise CheckpointError(f"{where}: base_init must be a mapping, got {type(recipe).__name__}")
    try:
        _Recipe.model_validate(recipe)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(x) for x in ("base_init", *err["loc"]))
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        got = "" if err["type"] == "missing" else f", got {err['input']!r}"
        raise CheckpointError(f"{where}: {key}: {err['msg']}{got}{more}") from None
    try:
        ModelConfig.from_hf_dict(recipe["config"])
    except (ConfigError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: base_init.config: {e}") from None
    return recipe


def base_recipe(cfg, device_type: str) -> dict | None:
    """What rebuilds the base of the run `cfg`, or None when the run reads its base from model.path."""
    if cfg.model.path:
        return None
    mcfg = resolve_model_config(None, cfg.model.effective_config, cfg.model.num_hidden_layers)
    # LoRA runs store the frozen base in the compute dtype: init draws fp32 and rounds into it
    return {"config": mcfg.to_hf_dict(), "init_std": cfg.model.init_std, "seed": cfg.run.seed,
            "dtype": cfg.model.dtype, "device": device_type, "tokenizer": cfg.data.tokenizer}


@torch.no_grad()
def build_base(recipe: dict, device: str | None = None, where: str = "base_init") -> torch.nn.Module:
    """The base model (no LoRA) of the recipe, on `device` (default: the device type it was drawn on; drawing
    on another type would give other numbers, so that is refused). ``where``: the file the recipe came from."""
    check_recipe(recipe, where)
    drawn_on = recipe.get("device", "cpu")
    if drawn_on == "cuda" and not torch.cuda.is_available():
        raise CheckpointError("this run's random base was drawn on a GPU (CUDA generators): rebuilding it exactly "
                              "needs a GPU; run this on a GPU machine, or pass --base")
    model = build_model(ModelConfig.from_hf_dict(recipe["config"]), "meta")
    cast_model(model, as_dtype(recipe["dtype"]))
    model.to_empty(device=drawn_on)
    init_weights(model, recipe["init_std"], seed=recipe["seed"])
    return model.to(device or drawn_on).eval()
