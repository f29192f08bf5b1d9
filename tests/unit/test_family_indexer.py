"""GLM-5's DSA indexer scores a chunk of queries at a time (names.INDEXER_CHUNK_SCORES): the same top-k and the
same logits as transformers, and never all index heads' [S, T] fp32 scores at once."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moetune
import moetune.model.glm_moe_dsa as dsa
from family_models import hf_dsa
from helpers import save_hf
from moetune.model.attention import dense_document_mask
from moetune.model.config import ModelConfig
from moetune.model.glm4_moe import rope_cos_sin

S = 24


def _ids(n=2, seq=S, seed=0):
    return torch.randint(0, 96, (n, seq), generator=torch.Generator().manual_seed(seed))


def test_chunked_indexer_gives_transformers_logits_and_the_unchunked_top_k(tmp_path, monkeypatch):
    ref = hf_dsa(seed=2)
    ours = moetune.load_model(save_hf(ref, tmp_path / "ckpt"), dtype="float32")
    ids = _ids(seed=5)
    chosen = []
    orig = dsa.Indexer.forward

    def record(self, *args):
        chosen.append(orig(self, *args))
        return chosen[-1]

    monkeypatch.setattr(dsa.Indexer, "forward", record)
    with torch.no_grad():
        whole = ours(ids)
        heads = ref.config.index_n_heads
        monkeypatch.setattr(dsa, "INDEXER_CHUNK_SCORES", 2 * heads * S * 5)  # 5 queries a chunk, and a rest of 4
        chunked = ours(ids)
        want = ref(input_ids=ids).logits
    n = len(chosen) // 2
    assert n == 2  # layers 0 and 2 ran their indexers (each run)
    for a, b in zip(chosen[:n], chosen[n:]):
        assert torch.equal(a.sort(-1).values, b.sort(-1).values)
    assert torch.equal(chunked, whole)
    assert ((chunked - want).norm() / want.norm()).item() < 1e-4


class _LargestFloat(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("budget", [2**19, 2**21])  # above q (2**18 elements), below the 2**23 scores
def test_indexer_never_holds_every_heads_scores(monkeypatch, budget):
    """32 index heads at 512 tokens: 8.4M fp32 scores unchunked; within the budget chunked, same top-k."""
    m = ModelConfig.from_hf_dict(dict(model_type="glm_moe_dsa", vocab_size=96, hidden_size=64, q_lora_rank=24,
                                      kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=20,
                                      num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1,
                                      index_topk=64, index_head_dim=16, index_n_heads=32))
    torch.manual_seed(0)
    indexer = dsa.Indexer(m)
    T = 512
    x, q_latent = torch.randn(1, T, 64), torch.randn(1, T, 24)
    cos, sin = rope_cos_sin(torch.arange(T)[None], 8, 10000.0, torch.float32)
    allowed = dense_document_mask(torch.arange(T)[None])[:, 0]
    monkeypatch.setattr(dsa, "INDEXER_CHUNK_SCORES", 32 * T * T)
    with _LargestFloat() as whole_mode:
        whole = indexer(x, q_latent, cos, sin, allowed)
    assert whole_mode.largest == 32 * T * T  # the premise: unchunked, every head's scores at once
    monkeypatch.setattr(dsa, "INDEXER_CHUNK_SCORES", budget)
    with _LargestFloat() as mode:
        chunked = indexer(x, q_latent, cos, sin, allowed)
    assert mode.largest <= budget
    assert torch.equal(chunked.sort(-1).values, whole.sort(-1).values)


def test_default_chunk_bounds_glm5_at_seq_4096():
    """GLM-5's 32 index heads at seq 4096: 2 GiB of fp32 scores unchunked; the default chunk holds 128 MiB."""
    assert dsa.INDEXER_CHUNK_SCORES * 4 <= 2**27 < 32 * 4096 * 4096 * 4
    assert dsa.INDEXER_CHUNK_SCORES // (32 * 4096) >= 64  # queries per chunk: few kernel launches per layer
