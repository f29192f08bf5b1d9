"""Which parameters a run trains: LoRA on the configured targets (the base frozen), or full fine-tuning (everything
but what never takes a gradient, and the router unless `finetune.train_router`). One function, used by the model a run
builds (train/setup.py) and by the meta model its memory is estimated on (parallel/estimate.py), so the two cannot
disagree."""

from __future__ import annotations

from moetune.errors import ConfigError
from moetune.names import NO_GRADIENT_RE, ROUTER_WEIGHT_SUFFIX


def prepare_trainable(model, cfg) -> None:
    """Mark `model`'s trainable parameters as `cfg` (Config) says; LoRA modules are injected in LoRA mode. A LoRA
    target this model does not have (q_proj on MLA, dense_mlp on an all-MoE model) is a ConfigError."""
    from moetune.model.lora import apply_lora

    if cfg.finetune.mode == "full":
        for name, p in model.named_parameters():
            p.requires_grad_((cfg.finetune.train_router or not name.endswith(ROUTER_WEIGHT_SUFFIX))
                             and not NO_GRADIENT_RE.search(name))
        return
    try:
        apply_lora(model, cfg.lora.targets, cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.rslora)
    except ValueError as e:
        raise ConfigError(str(e)) from None  # the message names lora.targets
