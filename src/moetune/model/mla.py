"""Multi-head latent attention (MLA, DeepSeek-V2's), the attention of GLM-4.7-Flash and GLM-5.

Parameter names are transformers' (`Glm4MoeLite*`, `GlmMoeDsa*`), so a state dict converts by renaming nothing:

    q:   q_proj [nH·(nope+rope), H]   or   q_a_proj [q_lora, H] → q_a_layernorm → q_b_proj [nH·(nope+rope), q_lora]
    kv:  kv_a_proj_with_mqa [kv_lora + rope, H] → latent [kv_lora] + one RoPE key [rope] shared by all heads;
         latent → kv_a_layernorm → kv_b_proj [nH·(nope+v), kv_lora] → per head k_nope, v
    q = [q_nope, RoPE(q_rope)], k = [k_nope, RoPE(k_rope)]; softmax(q·kᵀ/√(nope+rope))·v → o_proj [H, nH·v]

RoPE rotates the rope slices, interleaved pairs (x0, x1), (x2, x3)... as transformers' GLM-4.7-Flash and GLM-5
(NeoX halves when glm4_moe_lite's rope_interleave is false). The decoder layer, MoE block and RMSNorm are
GLM-4.5's (glm4_moe.py). Attention sees expanded K/V, through the same kernels as GLM-4.5 (attention.py); a
decoding cache keeps the normalised latent and the rotated RoPE key (kv_lora + rope numbers a position, not
nH·(nope+rope+v)) and expands every cached position through kv_b_proj at each step.
"""

from __future__ import annotations

import torch
from torch import nn

from moetune.model.attention import AttnMeta, KVCache, attend
from moetune.model.config import GLM_MOE_DSA, ModelConfig
from moetune.model.glm4_moe import RMSNorm, apply_rope, linears_of_one_input

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

    def forward(self, x, cos, sin, attn: AttnMeta, topk=None, cache: KVCache | None = None):
        """x [B, S, H] -> (out [B, S, H], top-k key indices for the next layer or None); as glm4_moe.Attention."""
        B, S, _ = x.shape
        q_in, kv_a = linears_of_one_input(x, self.q_proj if self.q_proj is not None else self.q_a_proj,
                                        self.kv_a_proj_with_mqa)
        if self.q_proj is not None:
            q_latent, q = None, q_in
        else:
            q_latent = self.q_a_layernorm(q_in)
            q = self.q_b_proj(q_latent)
        q_nope, q_rope = q.view(B, S, self.n_heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        kv_latent, k_rope = kv_a.split([self.kv_lora, self.rope], dim=-1)
        kv_latent = self.kv_a_layernorm(kv_latent)
        rotate = apply_rope_interleaved if self.interleave else apply_rope
        q_rope, k_rope = rotate(q_rope, cos, sin), rotate(k_rope.view(B, S, 1, self.rope), cos, sin)
        if cache is not None:
            kv_latent, k_rope = cache.extend(self, kv_latent, k_rope)
        T = kv_latent.shape[1]  # keys: S, or every cached position
        kv = self.kv_b_proj(kv_latent).view(B, T, self.n_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(B, T, self.n_heads, self.rope)), dim=-1)
        attn, topk = self.select_keys(x, q_latent, cos, sin, attn, topk, cache)
        o = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, self.n_heads * self.v_dim)), topk

    def select_keys(self, x, q_latent, cos, sin, attn: AttnMeta, topk, cache: KVCache | None):
        """Sparse attention's hook (glm_moe_dsa): MLA attends to every key the mask allows."""
        return attn, topk
