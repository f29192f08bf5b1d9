"""The HF reference: transformers' Glm4MoeForCausalLM + PEFT LoRA, set up as ../shared/reference describes
(bf16 N(0, 0.02) weights, gradient checkpointing non-reentrant with enable_input_require_grads — or none, the
`_nogc` variants: transformers' faster setting where it fits —, LoRA r16 α32, AdamW lr 1e-4 on the LoRA parameters).
Imported by train_throughput.py's worker; one variant per process."""

from __future__ import annotations

import torch


def build_hf(model_cfg: dict, lora_targets: list[str], rank: int = 16, alpha: int = 32, device="cuda",
             gradient_checkpointing: bool = True, experts_implementation: str | None = None):
    from peft import LoraConfig, get_peft_model
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    if model_cfg.get("model_type", "glm4_moe") != "glm4_moe":  # GLM-4.7-Flash / GLM-5: the config.json we write
        from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

        from moetune.model.config import ModelConfig

        config_cls, model_cls = {"glm4_moe_lite": (Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM),
                                 "glm_moe_dsa": (GlmMoeDsaConfig, GlmMoeDsaForCausalLM)}[model_cfg["model_type"]]
        hf_cfg = config_cls.from_dict(ModelConfig.from_hf_dict(model_cfg).to_hf_dict())
    else:
        cfg = dict(model_cfg)
        rope = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta"),
                "partial_rotary_factor": cfg.pop("partial_rotary_factor")}
        cfg.pop("num_nextn_predict_layers", None)
        hf_cfg, model_cls = Glm4MoeConfig(**cfg, rope_parameters=rope), Glm4MoeForCausalLM
    if experts_implementation:
        hf_cfg._experts_implementation = experts_implementation
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls._from_config(hf_cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    modules = [t for t in lora_targets if t != "experts"]
    kw = {}
    if "experts" in lora_targets:
        kw["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    lcfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=modules, **kw)
    model = get_peft_model(model, lcfg)
    model.train()
    return model


def hf_step_fn(model, lr: float = 1e-4):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)

    def step(ids, labels, position_ids=None):
        out = model(input_ids=ids, labels=labels, position_ids=position_ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss

    return step
