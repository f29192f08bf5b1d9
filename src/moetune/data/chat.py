"""Turning one record into token ids and a per-token "trained" mask.

Conversations are rendered with the tokenizer's own chat template (the demo's, or a real GLM-4.5 one), never with a
hand-written format, so training sees exactly what inference will. Which tokens belong to which turn is found the
template-agnostic way: a turn is the stretch between where the renderings of the prefixes ``messages[:i]`` and
``messages[:i+1]`` end inside the full rendering. The conversation is rendered and tokenised once, so this costs time
linear in its length (see _Rendering for how the prefixes' ends are found without tokenising every prefix).

Where a turn ends matters: the model must learn to stop. Some templates close every turn with a marker
(ChatML's ``<|im_end|>``); it then lies inside the turn and is trained with it. GLM-4.5's template does not: an
assistant turn ends where the next role token (``<|user|>``, ``<|observation|>``) begins, and GLM stops generating on
those tokens. For such "open" templates the first token after an assistant turn is trained as its end, and a
conversation that ends with an assistant turn gets ``eos`` appended (trained), as GLM-4.5 fine-tuning recipes do.

Reasoning. An assistant turn may carry reasoning as a ``reasoning_content`` field (GLM-4.5's and vLLM's name) or as a
``<think>…</think>`` block at the start of its content. Templates that know ``reasoning_content`` get it as a field;
for others it is folded into the content as ``<think>…</think>``. In the rendering, the think block (and the
whitespace before it) that opens a trained assistant turn is then:
  - a reasoning turn (non-empty reasoning in the data): trained when ``train_reasoning`` (the default), else context;
  - any other turn: GLM-4.5's template writes an empty ``<think></think>`` there. It is context unless
    ``train_empty_think``: trained, it would teach the model to skip thinking whenever the data has no reasoning.
    The answer after it (from the newline that follows ``</think>``) is trained as usual.
Only the turns located for their mask are looked at, so with ``train_on: all`` every token is trained, think blocks
included. A template that drops the reasoning of earlier turns (GLM-4.5 keeps only the turns after the last user
message) renders an empty block for them: such a turn is still a reasoning turn, and that empty block follows
``train_reasoning``.
"""

from __future__ import annotations

from moetune.errors import MoetuneError

from .formats import DataError

TRAIN_ON = ("assistant", "all")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_PROBE_REPLY = "moetune probe reply 7"
_open_template_cache: dict[tuple, bool] = {}


def tokenize_record(record: dict, tokenizer, train_on: str = "assistant", train_reasoning: bool = True,
                    train_empty_think: bool = False) -> tuple[list[int], list[bool]]:
    """Token ids of a record and whether each token is a training target (True = loss is computed on it)."""
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")
    if "text" in record:
        return _tokenize_text(record["text"], tokenizer)
    think = (train_reasoning, train_empty_think)
    return _tokenize_messages(record["messages"], tokenizer, train_on, think)


def _tokenize_text(text: str, tokenizer) -> tuple[list[int], list[bool]]:
    ids = list(tokenizer(text)["input_ids"])
    eos = tokenizer.eos_token_id
    if eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)  # a document ends: the model learns where text stops
    return ids, [True] * len(ids)


def _tokenize_messages(messages: list[dict], tokenizer, train_on: str,
                       think: tuple[bool, bool] = (True, False)) -> tuple[list[int], list[bool]]:
    turns = [_template_turn(m, tokenizer) for m in messages]  # only what a template knows about
    text = _render_text(tokenizer, turns)
    rendering = _Rendering(tokenizer, turns, text)
    full = list(rendering.ids)
    n_rendered = len(full)
    open_turns = _leaves_turns_open(tokenizer)
    eos = tokenizer.eos_token_id
    if open_turns and turns[-1]["role"] == "assistant" and eos is not None and (not full or full[-1] != eos):
        full.append(eos)  # the end of the last assistant turn (see the module docstring)

    # Start from the mode's default and only locate the turns that differ from it: fewer renders per record.
    default = train_on == "all"
    mask = [default] * len(full)
    think_turns = []  # (token where the turn starts, whether its think block is trained)
    for i, m in enumerate(messages):
        trained = m.get("train", default or m["role"] == "assistant")
        if trained != default:
            start, end = _turn_span(rendering, i, full, open_turns)
            mask[start:end] = [trained] * (end - start)
            if trained and m["role"] == "assistant":
                train_block = think[0] if _has_reasoning(m) else think[1]
                if not train_block:
                    think_turns.append((start, end))
    if think_turns:
        _mask_think_blocks(rendering, full[:n_rendered], mask, think_turns)
    return full, mask


class _Rendering:
    """A conversation rendered once, tokenised once (with character offsets where the tokenizer gives them), and
    where its prefixes ``turns[:k]`` end in it.

    Finding a prefix's end by rendering and tokenising that prefix costs as much as the conversation: quadratic in
    its turns (a 1 MB line of many turns took minutes). So a *skeleton* of the conversation (the same roles, each
    content and reasoning replaced by a short unique marker) is rendered once too. When the real text is the
    skeleton's with the markers replaced by the real strings (the template writes them verbatim or trimmed), a
    prefix ends at the same place of the text between two markers in both, and where it ends there depends only on
    that text and the roles around it: it is measured on the skeleton once per distinct (roles, text between
    markers) and reused. Whatever does not fit that picture (a template that rewrites contents, a prefix that the
    full rendering does not start with, a boundary inside a token) is found the exact way, by rendering and
    tokenising the prefix (GLM-4.5 drops the reasoning of turns before the last user message: those prefixes)."""

    def __init__(self, tokenizer, turns: list[dict], text: str):
        self.tokenizer, self.turns, self.text = tokenizer, turns, text
        try:
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            self.offsets = enc["offset_mapping"]
        except (NotImplementedError, ValueError, TypeError):  # a slow tokenizer gives no offsets
            enc, self.offsets = tokenizer(text, add_special_tokens=False), None
        self.ids = enc["input_ids"]
        self._token_at = None
        self._skeleton = None
        self._splits: dict[tuple, int | None] = {}

    # -- where a prefix ends, in tokens of the full rendering
    def prefix_end(self, k: int, add_generation_prompt: bool, full: list[int]) -> int:
        at = self._fast_prefix_end(k, add_generation_prompt)
        if at is not None:
            return at
        return _aligned_end(full, _render(self.tokenizer, self.turns[:k], add_generation_prompt=add_generation_prompt))

    def _fast_prefix_end(self, k: int, gen: bool) -> int | None:
        if self.offsets is None or not self.turns:
            return None
        sk = self._skeleton_layout()
        if sk is None:
            return None
        q_text, q_spans, t_spans = sk
        # the stretch between the last marker of turn k-1 and the first of turn k (or the text's ends)
        q_lo = q_spans[k - 1][1] if k > 0 else 0
        q_hi = q_spans[k][0] if k < len(self.turns) else len(q_text)
        t_lo = t_spans[k - 1][1] if k > 0 else 0
        key = (self.turns[k - 1]["role"] if k > 0 else None, self.turns[k]["role"] if k < len(self.turns) else None,
               gen, q_text[q_lo:q_hi])
        if key not in self._splits:
            self._splits[key] = self._measure_split(k, gen, q_text, q_lo, q_hi)
        split = self._splits[key]
        return None if split is None else self._token_index(t_lo + split)

    def _measure_split(self, k, gen, q_text, q_lo, q_hi) -> int | None:
        skeleton_turns = self._skeleton[0]
        try:
            part = _render_text(self.tokenizer, skeleton_turns[:k], add_generation_prompt=gen)
        except DataError:
            return None
        if not q_text.startswith(part) or not q_lo <= len(part) <= q_hi:
            return None
        return len(part) - q_lo

    def _skeleton_layout(self):
        """(skeleton text, [(first, last) marker character span per turn] in it, the same spans in the real text),
        or None when the real text is not the skeleton's with its markers replaced."""
        if self._skeleton is None:
            self._skeleton = (None, None)
            skeleton_turns, strings = [], []
            for i, t in enumerate(self.turns):
                turn = dict(t)
                for field in ("reasoning_content", "content"):
                    if field in t:
                        turn[field] = f"moetune{len(strings)}marker"
                        strings.append(t[field])
                skeleton_turns.append(turn)
            try:
                q_text = _render_text(self.tokenizer, skeleton_turns)
            except DataError:
                return None
            layout = _replace_markers(q_text, skeleton_turns, strings, self.text)
            self._skeleton = (skeleton_turns, layout)
        return self._skeleton[1]

    def _token_index(self, char: int) -> int | None:
        """The token that starts at ``char`` (len(ids) at the end); None when a token straddles it."""
        if self._token_at is None:
            self._token_at = {}
            prev_end = 0
            for j, (a, b) in enumerate(self.offsets):
                if a >= prev_end and a not in self._token_at:
                    self._token_at[a] = j
                prev_end = max(prev_end, b)
            self._end = prev_end
        if char == len(self.text) and self._end <= char:
            return len(self.ids)
        return self._token_at.get(char)


def _replace_markers(q_text: str, skeleton_turns: list[dict], strings: list[str], text: str):
    """See _Rendering._skeleton_layout."""
    pieces, q_spans, t_spans, q_at, t_len, n = [], [], [], 0, 0, 0
    for turn in skeleton_turns:
        first = last = None
        for field in ("reasoning_content", "content"):
            if field not in turn:
                continue
            marker = turn[field]
            found = q_text.find(marker, q_at)
            if found < 0:
                return None  # the template dropped or reordered it (one it repeats fails the comparison below)
            pieces.append(q_text[q_at:found])
            t_len += found - q_at
            if first is None:
                first = (found, t_len)
            # templates often trim what they write (GLM-4.5: content.strip()): take the form the text holds here
            string = strings[n]
            string = next((c for c in (string, string.strip(), string.lstrip(), string.rstrip())
                           if text.startswith(c, t_len)), string)
            pieces.append(string)
            t_len += len(string)
            q_at, n = found + len(marker), n + 1
            last = (q_at, t_len)
        if first is None:
            return None
        q_spans.append((first[0], last[0]))
        t_spans.append((first[1], last[1]))
    pieces.append(q_text[q_at:])
    if "".join(pieces) != text:
        return None
    return q_text, q_spans, t_spans


def _has_reasoning(m: dict) -> bool:
    if (m.get("reasoning_content") or "").strip():
        return True
    content = m["content"].lstrip()
    return content.startswith(THINK_OPEN) and THINK_CLOSE in content and bool(
        content[len(THINK_OPEN): content.index(THINK_CLOSE)].strip())


def _template_turn(m: dict, tokenizer) -> dict:
    turn = {"role": m["role"], "content": m["content"]}
    reasoning = m.get("reasoning_content")
    if reasoning is None:
        return turn
    if not isinstance(reasoning, str):
        raise DataError(f"reasoning_content must be a string, got {type(reasoning).__name__}")
    if m["role"] != "assistant":
        raise DataError(f"reasoning_content belongs to assistant turns, not {m['role']!r}")
    if "reasoning_content" in (getattr(tokenizer, "chat_template", None) or ""):
        turn["reasoning_content"] = reasoning
    else:  # a template that does not know the field would drop it silently
        turn["content"] = f"{THINK_OPEN}{reasoning}{THINK_CLOSE}{m['content']}"
    return turn


def _mask_think_blocks(rendering: "_Rendering", rendered: list[int], mask: list[bool], spans) -> None:
    """Set the mask to False over the think block (and the whitespace before it) that opens each span [start, end).
    Tokens are mapped to characters with the tokenizer's offsets, so this works whatever the block tokenizes to;
    a token straddling the block's end is masked (under-training beats training context)."""
    text, offsets = rendering.text, rendering.offsets
    if offsets is None or list(rendering.ids) != rendered:
        raise DataError("the tokenizer does not give back the same tokens with offsets; cannot locate <think> blocks")
    for start, end in spans:
        if start >= min(end, len(offsets)):
            continue
        at = offsets[start][0]
        while at < len(text) and text[at].isspace():
            at += 1
        if not text.startswith(THINK_OPEN, at) or text.find(THINK_CLOSE, at) < 0:
            continue  # this turn renders no think block
        block_end = text.index(THINK_CLOSE, at) + len(THINK_CLOSE)
        t = start
        while t < min(end, len(offsets)) and offsets[t][0] < block_end:
            mask[t] = False
            t += 1


def _turn_span(rendering: _Rendering, i: int, full: list[int], open_turns: bool) -> tuple[int, int]:
    """[start, end) of turn i in ``full``. An assistant turn starts after the header the template opens a reply with
    (the generation prompt), since the model is given that header at inference and never produces it."""
    is_assistant = rendering.turns[i]["role"] == "assistant"
    start = rendering.prefix_end(i, is_assistant, full)
    end = rendering.prefix_end(i + 1, False, full)
    if is_assistant and open_turns and end < len(full):
        end += 1  # the next role token (or the appended eos) is how this turn ends
    return start, max(start, end)


def _aligned_end(full: list[int], part: list[int]) -> int:
    """Where the rendering of the first turns, ``part``, ends inside the rendering of all of them, ``full``.

    Usually ``part`` is a prefix of ``full``. Some templates render a turn differently once later turns follow it:
    GLM-4.5 drops the <think> reasoning of assistant turns before the last user message, so the turns rendered alone
    show reasoning that the full conversation drops. Then ``part`` ends where its tail (after the divergence) best
    matches, as a suffix, the full rendering (earliest position on ties). No match at all: the divergence, which
    under-trains rather than training prompt tokens."""
    cp = _common_prefix(full, part)
    if cp == len(part):
        return cp
    tail, best_end, best_len = part[cp:], cp, 0
    for cand in range(cp + 1, len(full) + 1):
        k = 0  # common suffix of full[cp:cand] and tail, without copying slices (most candidates stop at once)
        while k < len(tail) and k < cand - cp and full[cand - 1 - k] == tail[-1 - k]:
            k += 1
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
    except MoetuneError:  # e.g. a stop signal that ends data preparation: not the template's fault
        raise
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
