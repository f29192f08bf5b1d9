"""Tiny random GLM-4.7-Flash (glm4_moe_lite) and GLM-5 (glm_moe_dsa) models built by transformers itself (weights
randomised as helpers.hf_model's GLM-4.5)."""

from helpers import randomize_weights

TINY_MLA = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    n_group=1, topk_group=1, routed_scaling_factor=1.8, norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=24,
    qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, rms_norm_eps=1e-5, max_position_embeddings=512,
    tie_word_embeddings=False,
)
# GLM-5: index_topk below the test sequences' length so that the indexer selects; layers 0 and 2 compute their
# own top-k, layers 1 and 3 reuse the one before them.
TINY_DSA = dict(TINY_MLA, num_hidden_layers=4, first_k_dense_replace=1, index_topk=8, index_head_dim=16,
                index_n_heads=8, indexer_types=["full", "shared", "full", "shared"])


def hf_lite(seed=0, **overrides):
    """transformers' Glm4MoeLiteForCausalLM (GLM-4.7-Flash) with random weights."""
    from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM

    cfg = Glm4MoeLiteConfig(**dict(TINY_MLA, **overrides), rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return randomize_weights(Glm4MoeLiteForCausalLM(cfg), seed).float().eval()


def hf_dsa(seed=0, **overrides):
    """transformers' GlmMoeDsaForCausalLM (GLM-5) with random weights."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    cfg = GlmMoeDsaConfig(**dict(TINY_DSA, **overrides), rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return randomize_weights(GlmMoeDsaForCausalLM(cfg), seed).float().eval()
