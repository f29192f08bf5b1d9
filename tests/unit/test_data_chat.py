"""Training masks from chat templates: only what the assistant produces (and how it stops) is trained."""

import pytest

from helpers import trained_text
from moetune.data import load_tokenizer, tokenize_record


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def chat(*turns):
    return {"messages": [{"role": role, "content": content} for role, content in turns]}


def test_text_record_is_fully_trained_and_ends_with_eos(tokenizer):
    ids, mask = tokenize_record({"text": "abc"}, tokenizer)
    assert tokenizer.decode(ids) == "abc<|endoftext|>"
    assert mask == [True] * 4


def test_only_assistant_content_and_turn_end_are_trained(tokenizer):
    record = chat(("system", "be brief"), ("user", "upper: ab"), ("assistant", "AB"), ("user", "upper: c"),
                  ("assistant", "C"))
    ids, mask = tokenize_record(record, tokenizer)
    assert tokenizer.decode(ids) == (
        "[gMASK]<sop><|system|>\nbe brief<|user|>\nupper: ab<|assistant|>\nAB<|user|>\nupper: c<|assistant|>\nC"
        "<|endoftext|>"
    )
    # The role header is given at inference, so it is not trained; the token that ends the turn is: the next role
    # token in the middle of a conversation, eos at its end.
    assert trained_text(tokenizer, ids, mask) == ["AB<|user|>", "C<|endoftext|>"]


def test_a_turn_marked_train_false_is_not_trained(tokenizer):
    record = chat(("user", "q1"), ("assistant", "A1"), ("user", "q2"), ("assistant", "A2"))
    record["messages"][1]["train"] = False
    ids, mask = tokenize_record(record, tokenizer)
    assert trained_text(tokenizer, ids, mask) == ["A2<|endoftext|>"]


def test_train_on_all_trains_every_token(tokenizer):
    record = chat(("user", "q1"), ("assistant", "A1"))
    ids, mask = tokenize_record(record, tokenizer, train_on="all")
    assert all(mask) and len(ids) == len(mask)
    assert tokenizer.decode(ids).endswith("A1<|endoftext|>")


def test_train_on_all_still_respects_train_false(tokenizer):
    record = chat(("user", "q1"), ("assistant", "A1"))
    record["messages"][0]["train"] = False
    ids, mask = tokenize_record(record, tokenizer, train_on="all")
    untrained = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert untrained == "<|user|>\nq1"


def test_conversation_without_assistant_has_no_targets(tokenizer):
    ids, mask = tokenize_record(chat(("user", "hello")), tokenizer)
    assert ids and not any(mask)


def test_unknown_train_on_is_rejected(tokenizer):
    with pytest.raises(ValueError, match="train_on"):
        tokenize_record(chat(("user", "x")), tokenizer, train_on="prompt")


# A template that closes its turns itself (ChatML style): the closing marker is trained, the next header is not,
# and no eos is appended.
CHATML = (
    "{%- for m in messages -%}{{- '<|system|>' + m.role + '\\n' + m.content + '<|observation|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|system|>assistant\\n' -}}{%- endif -%}"
)

# GLM-4.5's own behaviour, reduced: "\n<think></think>\n" opens every reply, and the reasoning of assistant turns
# before the last user message is dropped from the rendering (so a turn renders differently once a user follows).
GLM45_LIKE = (
    "[gMASK]<sop>"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<|user|>{{ '\\n' + m.content }}"
    "{%- elif m.role == 'tool' -%}<|observation|>{{ '\\n' + m.content }}"
    "{%- elif m.role == 'assistant' -%}<|assistant|>"
    "{%- set content = m.content -%}{%- set reasoning = '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip() -%}"
    "{%- set content = content.split('</think>')[-1] -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_user and reasoning -%}{{ '\\n<think>' + reasoning + '</think>' }}"
    "{%- else -%}{{ '\\n<think></think>' }}{%- endif -%}"
    "{{ '\\n' + content.strip() }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def with_template(template):
    tok = load_tokenizer(None)
    tok.chat_template = template
    return tok


def test_a_template_that_closes_its_turns_trains_its_closing_marker():
    tok = with_template(CHATML)
    ids, mask = tokenize_record(chat(("user", "q"), ("assistant", "A"), ("user", "r"), ("assistant", "B")), tok)
    assert ids[-1] != tok.eos_token_id
    assert trained_text(tok, ids, mask) == ["A<|observation|>\n", "B<|observation|>\n"]


def test_glm45_style_template_with_reasoning_in_history():
    tok = with_template(GLM45_LIKE)
    record = chat(("user", "q1"), ("assistant", "<think>r1</think>A1"), ("user", "q2"), ("tool", "t"),
                  ("assistant", "<think>r2</think>A2"))
    ids, mask = tokenize_record(record, tok)
    # The first reply's reasoning is dropped by the template; its answer and its end are still trained.
    assert trained_text(tok, ids, mask) == [
        "\n<think></think>\nA1<|user|>",
        "\n<think>r2</think>\nA2<|endoftext|>",
    ]
