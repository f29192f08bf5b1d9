"""A random-init base (the demo, proxies) as a recipe that rebuilds it bit for bit.

Such a base is never read from disk: `hf_io.init_weights` draws every tensor from a generator seeded by
(run.seed, tensor name) on the training device, whatever the sharding. The recipe is what that needs: the model
config, init std, dtype, seed and device type (CPU and CUDA generators draw different numbers). The trainer stores
it in the adapter (`base_init`), so the adapter alone finds its base again (export/run_base.py writes it out).
"""

from __future__ import annotations

import torch

from moetune.errors import CheckpointError
from moetune.model.config import ModelConfig, resolve_model_config
from moetune.model.hf_io import as_dtype, build_model, cast_model, init_weights


def base_recipe(cfg, device_type: str) -> dict | None:
    """What rebuilds the base of the run `cfg`, or None when the run reads its base from model.path."""
    if cfg.model.path:
        return None
    mcfg = resolve_model_config(None, cfg.model.effective_config, cfg.model.num_hidden_layers)
    # LoRA runs store the frozen base in the compute dtype: init draws fp32 and rounds into it
    return {"config": mcfg.to_hf_dict(), "init_std": cfg.model.init_std, "seed": cfg.run.seed,
            "dtype": cfg.model.dtype, "device": device_type, "tokenizer": cfg.data.tokenizer}


@torch.no_grad()
def build_base(recipe: dict, device: str | None = None) -> torch.nn.Module:
    """The base model (no LoRA) of the recipe, on `device` (default: the device type it was drawn on; drawing
    on another type would give other numbers, so that is refused)."""
    drawn_on = recipe.get("device", "cpu")
    if drawn_on == "cuda" and not torch.cuda.is_available():
        raise CheckpointError("this run's random base was drawn on a GPU (CUDA generators): rebuilding it exactly "
                              "needs a GPU; run this on a GPU machine, or pass --base")
    model = build_model(ModelConfig.from_hf_dict(recipe["config"]), "meta")
    cast_model(model, as_dtype(recipe["dtype"]))
    model.to_empty(device=drawn_on)
    init_weights(model, recipe["init_std"], seed=recipe["seed"])
    return model.to(device or drawn_on).eval()
