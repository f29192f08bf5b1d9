"""Generation with a KV cache (model/generation.py, moetune.generate) for every architecture we train (GLM-4.5's GQA,
GLM-4.7-Flash's MLA, GLM-5's MLA + DSA indexer): greedy output equals transformers' `generate` on the same weights;
the cached logits equal the training forward's; sampling is seeded."""

import warnings

import pytest
import torch

import moetune
import moetune.inference  # noqa: F401 - once imported, moetune.generate must still be the function
from moetune.model.attention import KVCache
from moetune.model.generation import generate, sample_next
from family_models import TINY_DSA, hf_dsa, hf_lite
from helpers import hf_model, random_adapter, save_hf

# The family's tiny models (as tests/unit/test_model_parity_family.py); DSA prompts both shorter and longer than
# index_topk (8), so the indexer's cache is filled before it selects and then selects at every step.
FAMILY = {
    "lite": (hf_lite, {}, 8),
    "lite_no_q_lora": (hf_lite, dict(q_lora_rank=None), 8),
    "lite_neox_rope_bias": (hf_lite, dict(rope_interleave=False, attention_bias=True), 8),
    "dsa": (hf_dsa, {}, 5),  # own top-k in layers 0, 2; reused in 1, 3
    "dsa_long_prompt": (hf_dsa, {}, 13),
    "dsa_all_full": (hf_dsa, dict(indexer_types=None, first_k_dense_replace=2, index_topk=5), 8),
}


def _hf_greedy(hf, prompt, n):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False,
                           eos_token_id=None, pad_token_id=0)


def _cached_steps(model, ids, prefill):
    """Logits of positions prefill-1..S-1 of ids: a prefill, then one token at a time through the cache."""
    cache = KVCache(ids.shape[1])
    with torch.no_grad():
        steps = [model(ids[:, :prefill], cache=cache)[:, -1]]
        for t in range(prefill, ids.shape[1]):
            steps.append(model(ids[:, t:t + 1], cache=cache)[:, -1])
    return torch.stack(steps, 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen") / "tiny"
    hf = hf_model(seed=3, use_qk_norm=True)  # qk-norm on: the cached path must apply it as the forward does
    return save_hf(hf, path), hf


def test_greedy_equals_transformers_generate(tiny):
    path, hf = tiny
    ours = moetune.load_model(path, dtype="float32")
    prompt = torch.tensor([[5, 17, 3, 42, 8, 9, 60, 1], [7, 7, 2, 90, 31, 4, 11, 56]])
    want = _hf_greedy(hf, prompt, 24)
    got = moetune.generate(ours, prompt, max_new_tokens=24, stop_ids=[])
    assert got.shape == want.shape == (2, 32)
    assert torch.equal(got, want), (got, want)


def test_cached_logits_equal_the_training_forward_with_lora(tiny, tmp_path):
    path, _ = tiny
    model = random_adapter(path, tmp_path / "ad", ["q_proj", "v_proj", "shared_experts", "experts"], scale=0.2)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)  # [2, 12, V]
    torch.testing.assert_close(_cached_steps(model, ids, 5), full[:, 4:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", list(FAMILY))
def test_family_greedy_equals_transformers_generate(tmp_path, variant):
    make, over, prompt_len = FAMILY[variant]
    hf = make(seed=11, **over)
    ours = moetune.load_model(save_hf(hf, tmp_path / "ckpt"), dtype="float32")
    prompt = torch.randint(0, 96, (2, prompt_len), generator=torch.Generator().manual_seed(1))
    want = _hf_greedy(hf, prompt, 20)
    got = moetune.generate(ours, prompt, max_new_tokens=20, stop_ids=[])
    assert got.shape == want.shape == (2, prompt_len + 20)
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("make", [hf_lite, hf_dsa], ids=["lite", "dsa"])
def test_family_cached_logits_equal_the_training_forward_with_lora(tmp_path, make):
    """Through MLA's latent cache (kv_b_proj adapted: it expands cached latents) and, for GLM-5, the indexer's
    key cache: prefill shorter than index_topk, then steps past it, where the selection drops keys."""
    path = save_hf(make(seed=12), tmp_path / "ckpt")
    model = random_adapter(path, tmp_path / "ad", ["q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "shared_experts", "experts"], scale=0.2)
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids)
    prefill = 6
    assert prefill < TINY_DSA["index_topk"] < ids.shape[1]
    torch.testing.assert_close(_cached_steps(model, ids, prefill), full[:, prefill - 1:], rtol=1e-5, atol=1e-5)


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


@pytest.mark.parametrize("make", [hf_lite, hf_dsa], ids=["glm47_flash_like", "glm5_like"])
def test_generate_and_chat_run_end_to_end_on_the_family(tmp_path, make):
    """What `moetune generate` / `chat` do (load_for_generation, then generate on a text and on a conversation):
    the reply is transformers' greedy continuation of the same chat-templated prompt."""
    from moetune.data import load_tokenizer
    from moetune.inference import encode_prompt

    tokenizer = load_tokenizer(None)  # the demo tokenizer (107 ids) beside the checkpoint, as a hub model's
    hf = make(seed=13, vocab_size=len(tokenizer))
    path = save_hf(hf, tmp_path / "ckpt")
    tokenizer.save_pretrained(path)
    model, tok = moetune.load_for_generation(path, device="cpu")
    conversation = [{"role": "user", "content": "upper: abc"}, {"role": "assistant", "content": "ABC"},
                    {"role": "user", "content": "upper: hij"}]
    for prompt in ("upper: abcdef", conversation):  # generate's text; chat's history
        ids = encode_prompt(tok, prompt)
        assert ids.shape[1] > TINY_DSA["index_topk"]  # GLM-5's indexer selects from the prefill on
        want = _hf_greedy(hf, ids, 12)[0, ids.shape[1]:]
        reply = moetune.generate(model, prompt, tok, max_new_tokens=12, stop_ids=[])
        assert isinstance(reply, str) and reply and reply == tok.decode(want, skip_special_tokens=True)
