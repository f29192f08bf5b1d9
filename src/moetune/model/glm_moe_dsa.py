"""GLM-5.x (`glm_moe_dsa`, transformers' `GlmMoeDsaForCausalLM`): MLA + DeepSeek sparse attention, plain PyTorch.

    embed → N × [x + DSA(RMSNorm(x)); x + MLP-or-MoE(RMSNorm(x))] → RMSNorm → lm_head
    DSA:  MLA (mla.py; q through q_lora_rank, interleaved RoPE) where each query attends only to the
          `index_topk` keys its layer's indexer scores highest (within the causal / document mask). Layers whose
          `indexer_types` entry is "full" run their own indexer; "shared" layers reuse the top-k the layer
          before them used.
    Indexer (DeepSeek-V3.2's, interleaved RoPE): per index head h, relu(q_h·k / √d) with q_h from the
          compressed query (wq_b) and one key per token (wk → LayerNorm); summed over heads with per-token
          weights (weights_proj / √n_heads), then top-k.

Training follows transformers: the indexer runs without gradient (its weights wq_b, wk, k_norm and
weights_proj get none, and nothing flows back through it into q_a_proj), the top-k selection is a constant
mask, and the attention's gradients flow through the selected keys only. With no more keys than index_topk the
selection is every key the mask allows: the indexer is skipped and the dense causal kernel runs (same result).
Decoding: the indexer caches its one key per position beside MLA's latent, and always runs (so that its cache is
whole once the keys outnumber index_topk), as transformers'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetune.model.attention import AttnMeta, KVCache, build_attn_meta
from moetune.model.config import ModelConfig
from moetune.model.glm4_moe import Glm4MoeForCausalLM
from moetune.model.mla import MLAttention, apply_rope_interleaved
from moetune.names import INDEXER_CHUNK_SCORES


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim, self.rope = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)

    @torch.no_grad()
    def forward(self, x, q_latent, cos, sin, allowed, cache: KVCache | None = None):
        """x [B, S, H], q_latent [B, S, q_lora], allowed [B, S, T] bool -> top-k key indices [B, S, k]. With a
        `cache`, the S new positions' keys join the T - S cached ones."""
        B, S, _ = x.shape
        split = [self.rope, self.head_dim - self.rope]  # the RoPE slice comes first here (last in MLA heads)
        q_rot, q_pass = self.wq_b(q_latent).view(B, S, self.n_heads, self.head_dim).split(split, dim=-1)
        k_rot, k_pass = self.k_norm(self.wk(x)).unsqueeze(2).split(split, dim=-1)
        q = torch.cat((apply_rope_interleaved(q_rot, cos, sin), q_pass), dim=-1)  # [B, S, h, D]
        k = torch.cat((apply_rope_interleaved(k_rot, cos, sin), k_pass), dim=-1).squeeze(2)  # [B, S, D]
        if cache is not None:
            k, = cache.extend(self, k)  # [B, T, D]
        weights = F.linear(x.float(), self.weights_proj.weight.float()) * self.n_heads**-0.5  # [B, S, h]
        k_t = k.transpose(-1, -2).float().unsqueeze(1)  # [B, 1, D, T]
        T = k_t.shape[-1]
        top = min(self.topk, T)
        # A chunk of queries at a time: the per-head scores [B, c, h, T] are the indexer's largest tensor
        chunk = max(1, INDEXER_CHUNK_SCORES // (B * self.n_heads * T))
        indices = torch.empty(B, S, top, dtype=torch.long, device=x.device)
        for s0 in range(0, S, chunk):
            s1 = min(s0 + chunk, S)
            # fp32 scores and head weights, as transformers (which also keeps weights_proj itself in fp32)
            scores = torch.matmul(q[:, s0:s1].float(), k_t).mul_(self.head_dim**-0.5).relu_()  # [B, c, h, T]
            index_scores = torch.matmul(weights[:, s0:s1].unsqueeze(-2), scores).squeeze(-2)  # [B, c, T]
            index_scores.masked_fill_(~allowed[:, s0:s1], float("-inf"))
            indices[:, s0:s1] = index_scores.topk(top, dim=-1).indices
        return indices


class DSAttention(MLAttention):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.index_topk = cfg.index_topk
        self.indexer = Indexer(cfg) if cfg.indexer_type(layer_idx) == "full" else None

    def select_keys(self, x, q_latent, cos, sin, attn: AttnMeta, topk, cache: KVCache | None):
        if cache is None and x.shape[1] <= self.index_topk:
            return attn, None  # every allowed key is among the top index_topk
        # a dense mask: the model builds one for sequences longer than index_topk, the cache one at every step
        allowed = attn.dense_mask[:, 0]
        if self.indexer is not None:
            topk = self.indexer(x, q_latent, cos, sin, allowed, cache)
        elif topk is None:
            raise RuntimeError("a 'shared' DSA layer got no top-k from the layer before it")
        selected = torch.zeros_like(allowed).scatter_(-1, topk, True)
        return AttnMeta(dense_mask=(allowed & selected).unsqueeze(1)), topk


class GlmMoeDsaForCausalLM(Glm4MoeForCausalLM):
    attention_cls = DSAttention

    def attn_meta(self, position_ids) -> AttnMeta:
        # Sparse attention needs the mask as a tensor (causal and document boundaries, then ∩ top-k).
        sparse = position_ids.shape[-1] > self.config.index_topk
        return build_attn_meta(position_ids, "eager" if sparse else self.attn_implementation, self.step_inputs)
