"""Turning one record into token ids and a per-token "trained" mask.

Conversations are rendered with the tokenizer's own chat template (the demo's, or a real GLM-4.5 one), never with a
hand-written format, so training sees exactly what inference will. Which tokens belong to which turn is found the
template-agnostic way: render the conversation's prefixes ``messages[:i]`` and compare their token ids with the full
rendering; a turn is the stretch between two such boundaries.

Where a turn ends matters: the model must learn to stop. Some templates close every turn with a marker
(ChatML's ``<|im_end|>``); it then lies inside the turn and is trained with it. GLM-4.5's template does not: an
assistant turn ends where the next role token (``<|user|>``, ``<|observation|>``) begins, and GLM stops generating on
those tokens. For such "open" templates the first token after an assistant turn is trained as its end, and a
conversation that ends with an assistant turn gets ``eos`` appended (trained), as GLM-4.5 fine-tuning recipes do.
"""

from __future__ import annotations

from .formats import DataError

TRAIN_ON = ("assistant", "all")
_PROBE_REPLY = "moetune probe reply 7"
_open_template_cache: dict[tuple, bool] = {}


def tokenize_record(record: dict, tokenizer, train_on: str = "assistant") -> tuple[list[int], list[bool]]:
    """Token ids of a record and whether each token is a training target (True = loss is computed on it)."""
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")
    if "text" in record:
        return _tokenize_text(record["text"], tokenizer)
    return _tokenize_messages(record["messages"], tokenizer, train_on)


def _tokenize_text(text: str, tokenizer) -> tuple[list[int], list[bool]]:
    ids = list(tokenizer(text)["input_ids"])
    eos = tokenizer.eos_token_id
    if eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)  # a document ends: the model learns where text stops
    return ids, [True] * len(ids)


def _tokenize_messages(messages: list[dict], tokenizer, train_on: str) -> tuple[list[int], list[bool]]:
    turns = [{"role": m["role"], "content": m["content"]} for m in messages]  # only what a template knows about
    full = _render(tokenizer, turns)
    open_turns = _leaves_turns_open(tokenizer)
    eos = tokenizer.eos_token_id
    if open_turns and turns[-1]["role"] == "assistant" and eos is not None and (not full or full[-1] != eos):
        full.append(eos)  # the end of the last assistant turn (see the module docstring)

    # Start from the mode's default and only locate the turns that differ from it: fewer renders per record.
    default = train_on == "all"
    mask = [default] * len(full)
    for i, m in enumerate(messages):
        trained = m.get("train", default or m["role"] == "assistant")
        if trained != default:
            start, end = _turn_span(tokenizer, turns, i, full, open_turns)
            mask[start:end] = [trained] * (end - start)
    return full, mask


def _turn_span(tokenizer, turns: list[dict], i: int, full: list[int], open_turns: bool) -> tuple[int, int]:
    """[start, end) of turn i in ``full``. An assistant turn starts after the header the template opens a reply with
    (the generation prompt), since the model is given that header at inference and never produces it."""
    is_assistant = turns[i]["role"] == "assistant"
    start = _common_prefix(full, _render(tokenizer, turns[:i], add_generation_prompt=is_assistant))
    end = _turn_end(tokenizer, turns, i, full)
    if is_assistant and open_turns and end < len(full):
        end += 1  # the next role token (or the appended eos) is how this turn ends
    return start, max(start, end)


def _turn_end(tokenizer, turns: list[dict], i: int, full: list[int]) -> int:
    alone = _render(tokenizer, turns[: i + 1])
    end = _common_prefix(full, alone)
    if end == len(alone):
        return end  # the usual case: the turn renders the same whether or not later turns follow
    # Some templates render a turn differently once later turns follow it: GLM-4.5 drops the <think> reasoning of
    # assistant turns before the last user message. Then the turn ends where the tail of its stand-alone rendering best
    # matches the full one, searched up to the end of the next turn (earliest position on ties). No match at all:
    # stop at the divergence, which under-trains rather than training prompt tokens.
    limit = _common_prefix(full, _render(tokenizer, turns[: i + 2])) if i + 2 <= len(turns) else len(full)
    tail, best_end, best_len = alone[end:], end, 0
    for cand in range(end + 1, max(limit, end) + 1):
        k = _common_suffix(full[end:cand], tail)
        if k > best_len:
            best_end, best_len = cand, k
    return best_end


def _leaves_turns_open(tokenizer) -> bool:
    """Whether the template ends an assistant turn with its content (GLM-4.5) rather than with a closing marker."""
    key = (tokenizer.chat_template, tokenizer.eos_token)
    if key not in _open_template_cache:
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE_REPLY}]
        try:
            text = _render_text(tokenizer, probe)
        except DataError:
            text = ""  # a template that cannot render the probe: assume it closes its own turns
        _open_template_cache[key] = text.rstrip().endswith(_PROBE_REPLY)
    return _open_template_cache[key]


def _render_text(tokenizer, turns: list[dict], add_generation_prompt: bool = False) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("the tokenizer has no chat template, so 'messages' records cannot be rendered")
    try:
        if not turns:
            return _render_no_turns(tokenizer, add_generation_prompt)
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja raises many types, e.g. a template's raise_exception("roles must alternate")
        raise DataError(f"the chat template rejected this conversation: {e}") from e


def _render_no_turns(tokenizer, add_generation_prompt: bool) -> str:
    # Where the first turn starts is what the template writes for zero turns ("[gMASK]<sop>"), but
    # apply_chat_template refuses an empty conversation, so call its renderer the way it would.
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[[]],
        chat_template=tokenizer.get_chat_template(),
        add_generation_prompt=add_generation_prompt,
        **tokenizer.special_tokens_map,
    )
    return rendered[0]


def _render(tokenizer, turns: list[dict], add_generation_prompt: bool = False) -> list[int]:
    try:
        text = _render_text(tokenizer, turns, add_generation_prompt)
    except DataError:
        if turns:
            raise
        return []  # a template that cannot render zero turns (e.g. it reads messages[0]): the first turn starts at 0
    # The template already wrote every special token (e.g. [gMASK]<sop>); don't let the tokenizer add its own.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for k in range(n):
        if a[k] != b[k]:
            return k
    return n


def _common_suffix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for k in range(1, n + 1):
        if a[-k] != b[-k]:
            return k - 1
    return n
