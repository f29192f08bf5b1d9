"""Multi-head latent attention (MLA, DeepSeek-V2's) and the decoder stack GLM-4.7-Flash and GLM-5 build on it.

Parameter names are transformers' (`Glm4MoeLite*`, `GlmMoeDsa*`), so a state dict converts by renaming nothing:

    q:   q_proj [nH·(nope+rope), H]   or   q_a_proj [q_lora, H] → q_a_layernorm → q_b_proj [nH·(nope+rope), q_lora]
    kv:  kv_a_proj_with_mqa [kv_lora + rope, H] → latent [kv_lora] + one RoPE key [rope] shared by all heads;
         latent → kv_a_layernorm → kv_b_proj [nH·(nope+v), kv_lora] → per head k_nope, v
    q = [q_nope, RoPE(q_rope)], k = [k_nope, RoPE(k_rope)]; softmax(q·kᵀ/√(nope+rope))·v → o_proj [H, nH·v]

RoPE rotates the rope slices, interleaved pairs (x0, x1), (x2, x3)... as transformers' GLM-4.7-Flash and GLM-5
(NeoX halves when glm4_moe_lite's rope_interleave is false). The MoE block, router, grouped-GEMM experts,
dense MLP and RMSNorm are GLM-4.5's (glm4_moe.py). Attention sees the training forward's expanded K/V (no
latent cache: there is no decoding here), through the same kernels as GLM-4.5 (attention.py).
"""

from __future__ import annotations

import torch
from torch import nn

from moetune.model.attention import AttnMeta, attend
from moetune.model.config import GLM_MOE_DSA, ModelConfig
from moetune.model.glm4_moe import MLP, Glm4MoeForCausalLM, MoE, RMSNorm, apply_rope, mlp_with
from moetune.model.recompute import recompute, split_modes

# transformers builds q_a_layernorm / kv_a_layernorm with its RMSNorm's default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


def apply_rope_interleaved(x, cos, sin):
    """Rotate the pairs (x0, x1), (x2, x3)... of x [B, S, heads, D] (D = cos.shape[-1]), each pair by one
    frequency; the output holds the rotated even dims, then the odd ones (transformers' layout: q and k share it,
    so q·k is that of the pairwise rotation)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(2), sin[..., :half].unsqueeze(2)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        H, nH = cfg.hidden_size, cfg.num_attention_heads
        self.n_heads, self.nope, self.rope, self.v_dim = nH, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        self.interleave = cfg.rope_interleave or cfg.model_type == GLM_MOE_DSA
        qk = cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(H, nH * qk, bias=False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(H, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, nH * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, cfg.kv_lora_rank + self.rope, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, nH * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(nH * self.v_dim, H, bias=cfg.attention_bias)

    def forward(self, x, cos, sin, attn: AttnMeta, topk=None):
        """x [B, S, H] -> (out [B, S, H], top-k key indices for the next layer or None)."""
        B, S, _ = x.shape
        if self.q_proj is not None:
            q_latent, q = None, self.q_proj(x)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent)
        q_nope, q_rope = q.view(B, S, self.n_heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        kv_latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_latent)).view(B, S, self.n_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        rotate = apply_rope_interleaved if self.interleave else apply_rope
        q_rope, k_rope = rotate(q_rope, cos, sin), rotate(k_rope.view(B, S, 1, self.rope), cos, sin)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(B, S, self.n_heads, self.rope)), dim=-1)
        attn, topk = self.select_keys(x, q_latent, cos, sin, attn, topk)
        o = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, self.n_heads * self.v_dim)), topk

    def select_keys(self, x, q_latent, cos, sin, attn: AttnMeta, topk):
        """Sparse attention's hook (glm_moe_dsa): MLA attends to every key the mask allows."""
        return attn, topk


class MLADecoderLayer(nn.Module):
    """GLM-4.5's layer with MLA attention; it also passes the sparse attention's top-k on to the next layer."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, attention_cls=MLAttention):
        super().__init__()
        self.self_attn = attention_cls(cfg, layer_idx)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer_idx) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.activation_checkpointing = "none"  # one of ac_modes.AC_MODES, set by parallel.apply_ac

    def _forward(self, x, cos, sin, attn, topk):
        h, topk = self._attention(x, cos, sin, attn, topk)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), topk

    def _attention(self, x, cos, sin, attn, topk):
        return self.self_attn(self.input_layernorm(x), cos, sin, attn, topk)

    def forward(self, x, cos, sin, attn, topk=None):
        # As glm4_moe.DecoderLayer.forward (keep the two alike). The top-k travels as an input and an output, so
        # a recomputed layer uses the one its forward used.
        mode = self.activation_checkpointing if torch.is_grad_enabled() else "none"
        split = split_modes(mode, isinstance(self.mlp, MoE) and self.mlp.experts.dispatcher is not None)
        if split is None:
            return recompute(self._forward, mode, x, cos, sin, attn, topk)
        attention_mode, mlp_mode = split
        h, topk = recompute(self._attention, attention_mode, x, cos, sin, attn, topk)
        x = x + h
        return x + mlp_with(self.mlp, self.post_attention_layernorm(x), mlp_mode), topk


class MLABackbone(nn.Module):
    """`model.*` in HF naming."""

    def __init__(self, cfg: ModelConfig, attention_cls):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MLADecoderLayer(cfg, i, attention_cls) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MLAForCausalLM(Glm4MoeForCausalLM):
    """The causal LM around MLA layers: GLM-4.5's, with its own backbone and the indexer's top-k handed from layer
    to layer (a "shared" DSA layer reuses the previous one's)."""

    attention_cls = MLAttention

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, MLABackbone(cfg, self.attention_cls))

    def run_layers(self, x, cos, sin, attn):
        topk = None
        for layer in self.model.layers:
            x, topk = layer(x, cos, sin, attn, topk)
        return x
