"""Reasoning in chat data: reasoning_content / <think> blocks trained or masked, GLM-4.5's empty <think></think> not
trained by default, on a GLM-4.5-like chat template."""

import json

import pytest

from helpers import trained_text
from moetune.data import DataError, build_packs, load_tokenizer, tokenize_record

# GLM-4.5's template, reduced: every assistant turn opens with "\n<think>…</think>" (empty when the turn has no
# reasoning), reasoning comes from `reasoning_content` or from a <think> block in the content, and the reasoning of
# assistant turns before the last user message is dropped.
GLM45_REASONING = (
    "[gMASK]<sop>"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|system|>{{ '\\n' + m.content }}"
    "{%- elif m.role == 'user' -%}<|user|>{{ '\\n' + m.content }}"
    "{%- elif m.role == 'tool' -%}<|observation|>{{ '\\n' + m.content }}"
    "{%- elif m.role == 'assistant' -%}<|assistant|>"
    "{%- set content = m.content -%}"
    "{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}"
    "{%- if not reasoning and '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}"
    "{%- endif -%}"
    "{%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1] -%}{%- endif -%}"
    "{%- if loop.index0 > ns.last_user and reasoning.strip() -%}{{ '\\n<think>' + reasoning.strip() + '</think>' }}"
    "{%- else -%}{{ '\\n<think></think>' }}{%- endif -%}"
    "{{ '\\n' + content.strip() }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


@pytest.fixture(scope="module")
def glm():
    tok = load_tokenizer(None)
    tok.chat_template = GLM45_REASONING
    return tok


@pytest.fixture(scope="module")
def demo():
    return load_tokenizer(None)


def msgs(*turns):
    out = []
    for t in turns:
        role, content, *extra = t
        out.append({"role": role, "content": content, **(extra[0] if extra else {})})
    return {"messages": out}


def test_empty_think_of_a_non_reasoning_turn_is_context_by_default(glm):
    rec = msgs(("system", "be brief"), ("user", "q1"), ("assistant", "A1"), ("user", "q2"), ("assistant", "A2"))
    ids, mask = tokenize_record(rec, glm)
    assert glm.decode(ids) == ("[gMASK]<sop><|system|>\nbe brief<|user|>\nq1<|assistant|>\n<think></think>\nA1"
                               "<|user|>\nq2<|assistant|>\n<think></think>\nA2<|endoftext|>")
    # the model is given "<|assistant|>\n<think></think>" (GLM-4.5's non-thinking prompt) and learns the answer
    assert trained_text(glm, ids, mask) == ["\nA1<|user|>", "\nA2<|endoftext|>"]


def test_empty_think_trained_on_request(glm):
    rec = msgs(("user", "q1"), ("assistant", "A1"))
    ids, mask = tokenize_record(rec, glm, train_empty_think=True)
    assert trained_text(glm, ids, mask) == ["\n<think></think>\nA1<|endoftext|>"]


@pytest.mark.parametrize("where", ["field", "content"])
def test_reasoning_is_trained_by_default_and_masked_on_request(glm, where):
    if where == "field":
        turn = ("assistant", "A", {"reasoning_content": "let me think"})
    else:
        turn = ("assistant", "<think>let me think</think>A")
    rec = msgs(("user", "q"), turn)
    ids, mask = tokenize_record(rec, glm)
    assert glm.decode(ids).endswith("<|assistant|>\n<think>let me think</think>\nA<|endoftext|>")
    assert trained_text(glm, ids, mask) == ["\n<think>let me think</think>\nA<|endoftext|>"]
    ids, mask = tokenize_record(rec, glm, train_reasoning=False)
    assert trained_text(glm, ids, mask) == ["\nA<|endoftext|>"]


def test_multi_turn_with_tools_mixes_reasoning_and_plain_turns(glm):
    rec = msgs(("system", "s"), ("user", "weather?"), ("assistant", "call", {"reasoning_content": "need tool"}),
               ("tool", "sunny"), ("assistant", "It is sunny."), ("user", "thanks"),
               ("assistant", "welcome", {"train": False}))
    ids, mask = tokenize_record(rec, glm)
    text = glm.decode(ids)
    assert "<|observation|>\nsunny" in text
    # turn 1 reasons (its block is dropped by the template once a later user turn follows: a reasoning turn all the
    # same, so its block follows train_reasoning); turn 2 has no reasoning (empty block masked); turn 3 train: false
    assert trained_text(glm, ids, mask) == ["\n<think></think>\ncall<|observation|>", "\nIt is sunny.<|user|>"]
    ids, mask = tokenize_record(rec, glm, train_reasoning=False)
    assert trained_text(glm, ids, mask) == ["\ncall<|observation|>", "\nIt is sunny.<|user|>"]


def test_template_without_reasoning_support_gets_it_folded_into_the_content(demo):
    rec = msgs(("user", "q"), ("assistant", "A", {"reasoning_content": "r"}))
    ids, mask = tokenize_record(rec, demo)
    assert demo.decode(ids).endswith("<|assistant|>\n<think>r</think>A<|endoftext|>")
    assert trained_text(demo, ids, mask) == ["<think>r</think>A<|endoftext|>"]
    ids, mask = tokenize_record(rec, demo, train_reasoning=False)
    assert trained_text(demo, ids, mask) == ["A<|endoftext|>"]


def test_train_on_all_trains_think_blocks_too(glm):
    ids, mask = tokenize_record(msgs(("user", "q"), ("assistant", "A")), glm, train_on="all", train_reasoning=False)
    assert all(mask)


@pytest.mark.parametrize("bad, msg", [
    ({"role": "user", "content": "x", "reasoning_content": "r"}, "belongs to assistant turns"),
    ({"role": "assistant", "content": "x", "reasoning_content": 3}, "must be a string"),
])
def test_bad_reasoning_content_names_the_line(tmp_path, demo, bad, msg):
    path = tmp_path / "d.jsonl"
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"messages": [{"role": "user", "content": "q"}, bad]}) + "\n")
    for cache_dir in (None, str(tmp_path / "cache")):
        with pytest.raises(DataError, match=rf"d.jsonl:2: .*{msg}"):
            build_packs(str(path), demo, 64, cache_dir=cache_dir)
    packs, stats = build_packs(str(path), demo, 64, skip_malformed=True)
    assert stats["skipped_malformed"] == 1 and stats["documents"] == 1
