"""Text generation with a KV cache, on the model `moetune.load_model` returns (base, or base + LoRA adapter).

A separate code path from the training forward (glm4_moe.py is untouched and keeps its speed): it calls the
layers' own pieces — norms, q/k/v/o projections (LoRA included), RoPE, the MoE block — and keeps each layer's
keys and values (after RoPE) in preallocated buffers, so each new token costs one position, not the whole prefix.

    ids = generate(model, input_ids, max_new_tokens=32)                      # greedy
    ids = generate(model, input_ids, max_new_tokens=32, temperature=0.7, top_p=0.9, seed=0)

Rows of `input_ids` must have the same length (no padding); a row stops at a stop token (it is kept) and is
then padded with it while the others go on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moetune.model.glm4_moe import apply_rope, rope_cos_sin


@dataclass
class KVCache:
    """Per layer: keys and values [B, n_kv, max_len, D] (keys after RoPE); `length` positions are filled."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0

    @classmethod
    def empty(cls, model, batch: int, max_len: int, device, dtype) -> "KVCache":
        c = model.config
        shape = (batch, c.num_key_value_heads, max_len, c.head_dim)
        n = len(model.model.layers)
        return cls([torch.empty(shape, device=device, dtype=dtype) for _ in range(n)],
                   [torch.empty(shape, device=device, dtype=dtype) for _ in range(n)])


def _attention(attn, x, cos, sin, cache: KVCache, layer: int):
    """Attention.forward with the new positions' keys/values appended to the cache; queries attend to everything
    cached (causally within the new positions)."""
    B, S, _ = x.shape
    q = attn.q_proj(x).view(B, S, attn.n_heads, attn.head_dim)
    k = attn.k_proj(x).view(B, S, attn.n_kv, attn.head_dim)
    v = attn.v_proj(x).view(B, S, attn.n_kv, attn.head_dim)
    if attn.q_norm is not None:  # after the bias, before RoPE (as the training forward)
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    start, end = cache.length, cache.length + S
    cache.keys[layer][:, :, start:end] = k.transpose(1, 2)
    cache.values[layer][:, :, start:end] = v.transpose(1, 2)
    keys, values = cache.keys[layer][:, :, :end], cache.values[layer][:, :, :end]
    q = q.transpose(1, 2)
    if S == 1:  # one new token sees every cached position: no mask
        o = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
    else:  # new position i (absolute start + i) sees positions <= start + i
        mask = torch.ones(S, end, dtype=torch.bool, device=x.device).tril(diagonal=start)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    return attn.o_proj(o.transpose(1, 2).reshape(B, S, -1))


@torch.no_grad()
def forward_cached(model, input_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits [B, V] of the last position of `input_ids` [B, S], which continue the `cache.length` cached ones."""
    B, S = input_ids.shape
    cfg = model.config
    positions = torch.arange(cache.length, cache.length + S, device=input_ids.device).expand(B, S)
    x = model.model.embed_tokens(input_ids)
    cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, x.dtype)
    for i, layer in enumerate(model.model.layers):
        x = x + _attention(layer.self_attn, layer.input_layernorm(x), cos, sin, cache, i)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    cache.length += S
    return model.lm_head(model.model.norm(x[:, -1:]))[:, 0]


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids [B] from logits [B, V]: greedy at temperature 0, else nucleus sampling."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the most likely token always stays)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int = 64, temperature: float = 0.0,
             top_p: float = 1.0, stop_token_ids=(), seed: int | None = None, on_token=None) -> torch.Tensor:
    """`input_ids` [B, S] followed by up to `max_new_tokens` generated ids, [B, S + n]. `on_token(ids [B])` is
    called after each step (streaming)."""
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if max_new_tokens < 0 or not 0 < top_p <= 1 or temperature < 0:
        raise ValueError("need max_new_tokens >= 0, 0 < top_p <= 1 and temperature >= 0")
    model.eval()
    device = model.lm_head.weight.device
    input_ids = input_ids.to(device)
    B, S = input_ids.shape
    stops = torch.tensor(sorted(set(stop_token_ids)), device=device, dtype=torch.long)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    cache = KVCache.empty(model, B, S + max_new_tokens, device, model.model.embed_tokens.weight.dtype)
    out = [input_ids]
    done = torch.zeros(B, dtype=torch.bool, device=device)
    logits = forward_cached(model, input_ids, cache) if max_new_tokens else None
    for step in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_p, generator)
        nxt = torch.where(done, out[-1][:, -1], nxt)  # a finished row repeats its stop token
        out.append(nxt[:, None])
        if on_token is not None:
            on_token(nxt)
        done |= torch.isin(nxt, stops)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        logits = forward_cached(model, nxt[:, None], cache)
    return torch.cat(out, 1)
