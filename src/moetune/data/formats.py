"""Reading and validating JSONL training data.

Each line is one JSON object, either a plain document ``{"text": "..."}`` or a conversation
``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "...", "train": true}]}``.
Other keys (ids, metadata) are allowed and ignored. Every problem is reported as ``path:line: reason`` so a user can
jump straight to the bad line of a million-line file.

The formats people bring are turned into those two first (``normalize_record``):
  - Alpaca: ``{"instruction", "input" (optional), "output", "system" (optional)}`` -> system?, user, assistant;
  - ShareGPT: ``{"conversations": [{"from": "human" | "gpt" | "system" | ..., "value": "..."}]}``;
  - OpenAI-style content as a list of parts ``[{"type": "text", "text": "..."}]`` (text parts joined; an image or
    audio part is an error: these models read text);
  - other column names through ``data.columns`` (our name -> theirs, e.g. ``{messages: dialog, output: answer}``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from moetune.errors import DataError  # noqa: F401  (re-exported)

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT's speaker names (and those of its variants) -> our roles
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system", "tool": "tool",
                  "observation": "tool", "function_response": "tool", "function": "tool"}
# the fields data.columns may rename: what each format reads
COLUMNS = ("text", "messages", "conversations", "instruction", "input", "output", "system")


def read_records(path: str, skip_malformed: bool = False, columns: dict | None = None) -> tuple[list[dict], int]:
    """All valid records of a JSONL file, and how many malformed lines were skipped (always 0 unless skip_malformed)."""
    records, skipped = [], 0
    for _lineno, record in iter_records(path, skip_malformed, columns):
        if record is None:
            skipped += 1
        else:
            records.append(record)
    return records, skipped


def iter_records(path: str, skip_malformed: bool = False, columns: dict | None = None) -> Iterator[tuple[int, dict | None]]:
    """Yield ``(line number, record)``; a malformed line yields ``(lineno, None)`` when skipped, raises otherwise.

    Kept separate from read_records so that later stages (tokenization) can still name the line of a record.
    """
    if not os.path.isfile(path):
        raise DataError(f"{path}: file not found" + (" (it is a directory)" if os.path.isdir(path) else ""))
    with open(path, "rb") as f:  # bytes, so that a bad encoding is reported with its line instead of mid-read
        for lineno, raw in enumerate(f, start=1):
            try:
                record = _parse_line(raw, first=lineno == 1, columns=columns)
            except DataError as e:
                if not skip_malformed:
                    raise DataError(f"{path}:{lineno}: {e}") from None
                yield lineno, None
                continue
            if record is not None:
                yield lineno, record


# byte-order marks of the encodings a JSONL file is sometimes saved in by mistake (Windows editors, PowerShell)
_OTHER_BOMS = {b"\xff\xfe\x00\x00": "UTF-32", b"\x00\x00\xfe\xff": "UTF-32", b"\xff\xfe": "UTF-16",
               b"\xfe\xff": "UTF-16"}


def _parse_line(raw: bytes, first: bool, columns: dict | None = None) -> dict | None:
    if first:
        for bom, name in _OTHER_BOMS.items():
            if raw.startswith(bom):
                raise DataError(f"the file is {name}-encoded; JSONL must be UTF-8 (e.g. iconv -f {name} -t UTF-8)")
    try:
        # a byte-order mark is tolerated at the start of any line: files concatenated with `cat` carry theirs
        line = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:  # json recurses per nesting level
        raise DataError("JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise DataError(f"expected a JSON object, got {type(obj).__name__}")
    obj = normalize_record(obj, columns)
    validate_record(obj)
    return obj


def normalize_record(obj: dict, columns: dict | None = None) -> dict:
    """A text or messages record from any supported format (see the module docstring); others pass unchanged."""
    if columns:
        obj = dict(obj)
        for ours, theirs in columns.items():
            if theirs in obj and ours not in obj:
                obj[ours] = obj.pop(theirs)
    if "text" in obj or ("messages" not in obj and "conversations" not in obj and "instruction" not in obj):
        if columns and "text" not in obj:  # say what the mapping looked for, not only what the record has
            wanted = ", ".join(f"{theirs!r} (for {ours})" for ours, theirs in columns.items())
            raise DataError(f"no column data.columns names is here: it looks for {wanted}; the record has keys "
                            f"{sorted(obj)}")
        return obj
    if "messages" in obj:
        messages = obj["messages"]
    elif "conversations" in obj:
        messages = _from_sharegpt(obj["conversations"])
    else:
        messages = _from_alpaca(obj)
    if isinstance(messages, list):
        messages = [_join_parts(m, i) if isinstance(m, dict) and isinstance(m.get("content"), list) else m
                    for i, m in enumerate(messages)]
    out = {k: v for k, v in obj.items() if k not in ("conversations", "instruction", "input", "output", "system")}
    out["messages"] = messages
    return out


def _from_alpaca(obj: dict) -> list[dict]:
    for key in ("instruction", "output"):
        if not isinstance(obj.get(key), str):
            raise DataError(f"an Alpaca record needs '{key}' as a string, got {type(obj.get(key)).__name__}")
    for key in ("input", "system"):
        if obj.get(key) is not None and not isinstance(obj[key], str):
            raise DataError(f"Alpaca '{key}' must be a string, got {type(obj[key]).__name__}")
    user = obj["instruction"] + (f"\n\n{obj['input']}" if obj.get("input") else "")
    system = [{"role": "system", "content": obj["system"]}] if obj.get("system") else []
    return system + [{"role": "user", "content": user}, {"role": "assistant", "content": obj["output"]}]


def _from_sharegpt(turns) -> list[dict]:
    if not isinstance(turns, list) or not turns:
        raise DataError("'conversations' must be a non-empty list")
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or "from" not in t or "value" not in t:
            raise DataError(f"conversations[{i}] must be an object with 'from' and 'value'")
        role = SHAREGPT_ROLES.get(str(t["from"]).lower())
        if role is None:
            raise DataError(f"conversations[{i}]: unknown speaker {t['from']!r} (known: {', '.join(SHAREGPT_ROLES)})")
        out.append({"role": role, "content": t["value"], **({"train": t["train"]} if "train" in t else {})})
    return out


def _join_parts(m: dict, i: int) -> dict:
    """OpenAI-style content parts -> one string (text parts only)."""
    texts = []
    for j, part in enumerate(m["content"]):
        if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise DataError(f"messages[{i}]: content must be a string or a list of text parts "
                            f"({{\"type\": \"text\", \"text\": ...}}); content[{j}] is {kind!r}")
    return dict(m, content="".join(texts))


def validate_record(obj: dict) -> None:
    """Raise DataError (without a location) when ``obj`` is not a valid text or messages record."""
    has_text, has_messages = "text" in obj, "messages" in obj
    if has_text == has_messages:
        raise DataError(
            "a record needs exactly one of 'text' (a string) or 'messages' (a list), "
            + ("it has both" if has_text else f"it has keys {sorted(obj)}")
        )
    if has_text:
        if not isinstance(obj["text"], str):
            raise DataError(f"'text' must be a string, got {type(obj['text']).__name__}")
        _check_encodable(obj["text"], "'text'")
        return
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError("'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise DataError(f"{where} must be an object, got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise DataError(f"{where}: role must be one of {', '.join(ROLES)}, got {m.get('role')!r}")
        if not isinstance(m.get("content"), str):
            raise DataError(f"{where}: content must be a string, got {type(m.get('content')).__name__}")
        if "train" in m and not isinstance(m["train"], bool):
            raise DataError(f"{where}: train must be true or false, got {m['train']!r}")
        for key in ("content", "reasoning_content"):
            if isinstance(m.get(key), str):
                _check_encodable(m[key], f"{where}.{key}")


def _check_encodable(text: str, where: str) -> None:
    """JSON's \\u escapes can spell half of a surrogate pair, which is no character: no tokenizer can encode it (the
    Rust tokenizers raise a TypeError), so the record is malformed."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{where} holds {text[e.start]!r} at character {e.start}, half of a UTF-16 surrogate pair "
                        "and not a character: no tokenizer can encode it") from None
