"""Text generation on the model `moetune.load_model` returns (base, or base + LoRA adapter): the decoding loop.

The model's own forward decodes: given an attention.KVCache, each attention (GQA, MLA, the DSA indexer) keeps what
it needs of the positions already seen, so each new token costs one position, not the whole prefix; this file only
chooses the next token and stops.

    ids = generate(model, input_ids, max_new_tokens=32)                      # greedy
    ids = generate(model, input_ids, max_new_tokens=32, temperature=0.7, top_p=0.9, seed=0)

Rows of `input_ids` must have the same length (no padding); a row stops at a stop token (it is kept) and is
then padded with it while the others go on.
"""

from __future__ import annotations

import torch

from moetune.model.attention import KVCache


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
    cache = KVCache(S + max_new_tokens)
    out = [input_ids]
    done = torch.zeros(B, dtype=torch.bool, device=device)
    logits = model(input_ids, cache=cache)[:, -1] if max_new_tokens else None
    for step in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_p, generator)
        nxt = torch.where(done, out[-1][:, -1], nxt)  # a finished row repeats its stop token
        out.append(nxt[:, None])
        if on_token is not None:
            on_token(nxt)
        done |= torch.isin(nxt, stops)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        logits = model(nxt[:, None], cache=cache)[:, -1]
    return torch.cat(out, 1)
