"""Shared helpers for tests: tiny random GLM-4.5 configs and checkpoints written by transformers itself."""

import torch

TINY_HF = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
    norm_topk_prob=True, use_qk_norm=False, attention_bias=True, partial_rotary_factor=0.5,
    rms_norm_eps=1e-5, max_position_embeddings=512, tie_word_embeddings=False,
)


def hf_model(seed=0, **overrides):
    """A transformers Glm4MoeForCausalLM with random weights (router bias random too, so it matters)."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    kw = dict(TINY_HF, **overrides)
    prf = kw.pop("partial_rotary_factor")
    cfg = Glm4MoeConfig(**kw, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": prf})
    torch.manual_seed(seed)
    m = Glm4MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
        for layer in m.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(cfg.n_routed_experts))
    return m


def save_hf(model, path, max_shard_size=None):
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kw)
    return str(path)
