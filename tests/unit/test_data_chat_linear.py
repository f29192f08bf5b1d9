"""Turn boundaries are found with work linear in a conversation's length (a 1 MB line of many turns took 12+
minutes when every prefix was rendered and tokenised), and they are the same boundaries as the exact way finds."""

import random

import pytest

from moetune.data import chat as chat_module
from moetune.data import load_tokenizer, tokenize_record
from unit.test_chat_reasoning import GLM45_REASONING
from unit.test_data_chat import CHATML, GLM45_LIKE

TEMPLATES = {"demo": None, "chatml": CHATML, "glm45_like": GLM45_LIKE, "glm45_reasoning": GLM45_REASONING}


def tokenizer_with(name):
    tok = load_tokenizer(None)
    if TEMPLATES[name] is not None:
        tok.chat_template = TEMPLATES[name]
    return tok


def conversation(rng: random.Random, n_turns: int) -> dict:
    words = ["alpha", "beta", " gamma", "delta\n", "<think>r</think>ok", "  spaced  ", "x", "\n\nlines\n"]
    messages = [{"role": "system", "content": "be brief"}] if rng.random() < 0.5 else []
    for i in range(n_turns):
        role = "user" if i % 2 == 0 else rng.choice(["assistant", "assistant", "tool"])
        if role == "tool":
            messages += [{"role": "tool", "content": rng.choice(words)}, {"role": "assistant", "content": "t"}]
            continue
        m = {"role": role, "content": "".join(rng.choice(words) for _ in range(rng.randint(1, 4)))}
        if role == "assistant" and rng.random() < 0.3:
            m["reasoning_content"] = rng.choice(["think hard", " padded ", ""])
        if rng.random() < 0.2:
            m["train"] = rng.random() < 0.5
        messages.append(m)
    return {"messages": messages}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_labels_equal_the_exact_way_of_rendering_every_prefix(name, train_on, monkeypatch):
    tok = tokenizer_with(name)
    rng = random.Random(0)
    records = [conversation(rng, rng.randint(1, 9)) for _ in range(40)]
    options = [dict(train_reasoning=r, train_empty_think=e) for r in (True, False) for e in (False, True)]
    found, fast_prefix_end = [0, 0], chat_module._Rendering._fast_prefix_end

    def counted(self, k, gen):
        at = fast_prefix_end(self, k, gen)
        found[at is None] += 1
        return at

    monkeypatch.setattr(chat_module._Rendering, "_fast_prefix_end", counted)
    fast = [[tokenize_record(rec, tok, train_on=train_on, **o) for o in options] for rec in records]
    # the premise: boundaries were found the linear way (all of them where the template writes contents verbatim;
    # GLM-4.5's drop of earlier reasoning and its parsing of <think> in contents leave some to the exact way)
    assert found[0] > 0 and (found[1] == 0 or name.startswith("glm")), found
    monkeypatch.setattr(chat_module._Rendering, "_fast_prefix_end", lambda self, k, gen: None)
    exact = [[tokenize_record(rec, tok, train_on=train_on, **o) for o in options] for rec in records]
    assert fast == exact


class Work:
    """Counts what the chat template is given (messages) and what the tokenizer is given (characters)."""

    def __init__(self, tok, monkeypatch):
        self.messages = self.chars = 0
        cls = type(tok)
        render, encode = cls.apply_chat_template, cls.__call__

        def counting_render(this, conversation, *a, **k):
            self.messages += len(conversation)
            return render(this, conversation, *a, **k)

        def counting_encode(this, text, *a, **k):
            self.chars += len(text)
            return encode(this, text, *a, **k)

        monkeypatch.setattr(cls, "apply_chat_template", counting_render)
        monkeypatch.setattr(cls, "__call__", counting_encode)


def work_for(tok, n_turns, work) -> tuple[int, int]:
    messages = []
    for i in range(n_turns):
        messages += [{"role": "user", "content": f"question {i} " * 5}, {"role": "assistant", "content": f"answer {i}"}]
    chat_module._open_template_cache.clear()
    work.messages = work.chars = 0
    tokenize_record({"messages": messages}, tok)
    return work.messages, work.chars


@pytest.mark.parametrize("name", ["demo", "chatml", "glm45_reasoning"])
def test_template_and_tokenizer_work_grows_linearly_with_the_turns(name, monkeypatch):
    tok = tokenizer_with(name)
    work = Work(tok, monkeypatch)
    few, many = work_for(tok, 10, work), work_for(tok, 100, work)
    # ten times the turns: ten times the work (and a constant), not a hundred times as when every prefix was rendered
    assert many[0] <= 12 * few[0] and many[1] <= 12 * few[1], (few, many)
