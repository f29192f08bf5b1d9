"""Generation with a KV cache (model/generation.py, moetune.generate): greedy output equals transformers'
`generate` on the same weights; the cached logits equal the training forward's; sampling is seeded."""

import warnings

import pytest
import torch

import moetune
import moetune.inference  # noqa: F401 - once imported, moetune.generate must still be the function
from moetune.model.generation import KVCache, forward_cached, generate, sample_next
from helpers import hf_model, random_adapter, save_hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen") / "tiny"
    hf = hf_model(seed=3, use_qk_norm=True)  # qk-norm on: the cached path must apply it as the forward does
    return save_hf(hf, path), hf


def test_greedy_equals_transformers_generate(tiny):
    path, hf = tiny
    ours = moetune.load_model(path, dtype="float32")
    prompt = torch.tensor([[5, 17, 3, 42, 8, 9, 60, 1], [7, 7, 2, 90, 31, 4, 11, 56]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    got = moetune.generate(ours, prompt, max_new_tokens=24, stop_ids=[])
    assert got.shape == want.shape == (2, 32)
    assert torch.equal(got, want), (got, want)


def test_cached_logits_equal_the_training_forward_with_lora(tiny, tmp_path):
    path, _ = tiny
    model = random_adapter(path, tmp_path / "ad", ["q_proj", "v_proj", "shared_experts", "experts"], scale=0.2)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)  # [2, 12, V]
    cache = KVCache.empty(model, 2, 12, "cpu", torch.float32)
    steps = [forward_cached(model, ids[:, :5], cache)]  # prefill, then one token at a time
    for t in range(5, 12):
        steps.append(forward_cached(model, ids[:, t:t + 1], cache))
    got = torch.stack(steps, 1)
    torch.testing.assert_close(got, full[:, 4:], rtol=1e-5, atol=1e-5)


def test_stop_token_ends_a_row_and_sampling_is_seeded(tiny):
    path, _ = tiny
    model = moetune.load_model(path, dtype="float32")
    prompt = torch.tensor([[5, 17, 3, 42]])
    greedy = generate(model, prompt, max_new_tokens=10)
    stop = int(greedy[0, 6])  # the 3rd generated token
    first = greedy[0, 4:].tolist().index(stop) + 4
    stopped = generate(model, prompt, max_new_tokens=10, stop_token_ids=[stop])
    assert stopped.shape[1] == first + 1 and stopped[0, -1] == stop
    a = generate(model, prompt, max_new_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    b = generate(model, prompt, max_new_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    assert torch.equal(a, b)


def test_top_p_keeps_the_nucleus_only():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    drawn = {int(sample_next(logits, 1.0, 0.75, g)) for _ in range(300)}
    assert drawn == {0, 1}  # 0.5 + 0.3 reaches 0.75: tokens 2 and 3 never come
    assert int(sample_next(logits, 0.0)) == 0
