"""The model class of each model_type, and building one: imported by hf_io (loading) and adapter_io (checking an
adapter's shapes against its base), which must not import each other's module at the top and the bottom."""

from __future__ import annotations

import torch

from moetune.model.config import GLM4_MOE, GLM4_MOE_LITE, GLM_MOE_DSA, ModelConfig
from moetune.model.glm4_moe import Glm4MoeForCausalLM
from moetune.model.glm4_moe_lite import Glm4MoeLiteForCausalLM
from moetune.model.glm_moe_dsa import GlmMoeDsaForCausalLM

MODEL_CLASSES = {GLM4_MOE: Glm4MoeForCausalLM, GLM4_MOE_LITE: Glm4MoeLiteForCausalLM, GLM_MOE_DSA: GlmMoeDsaForCausalLM}


def build_model(cfg: ModelConfig, device="meta") -> Glm4MoeForCausalLM:
    """The model class of cfg.model_type (all share one interface: forward, moe_layers, model.layers)."""
    with torch.device(device):
        return MODEL_CLASSES[cfg.model_type](cfg)
