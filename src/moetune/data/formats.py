"""Reading and validating JSONL training data.

Each line is one JSON object, either a plain document ``{"text": "..."}`` or a conversation
``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "...", "train": true}]}``.
Other keys (ids, metadata) are allowed and ignored. Every problem is reported as ``path:line: reason`` so a user can
jump straight to the bad line of a million-line file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from moetune.errors import DataError  # noqa: F401  (re-exported)

ROLES = ("system", "user", "assistant", "tool")


def read_records(path: str, skip_malformed: bool = False) -> tuple[list[dict], int]:
    """All valid records of a JSONL file, and how many malformed lines were skipped (always 0 unless skip_malformed)."""
    records, skipped = [], 0
    for _lineno, record in iter_records(path, skip_malformed):
        if record is None:
            skipped += 1
        else:
            records.append(record)
    return records, skipped


def iter_records(path: str, skip_malformed: bool = False) -> Iterator[tuple[int, dict | None]]:
    """Yield ``(line number, record)``; a malformed line yields ``(lineno, None)`` when skipped, raises otherwise.

    Kept separate from read_records so that later stages (tokenization) can still name the line of a record.
    """
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such data file" + (" (it is a directory)" if os.path.isdir(path) else ""))
    with open(path, "rb") as f:  # bytes, so that a bad encoding is reported with its line instead of mid-read
        for lineno, raw in enumerate(f, start=1):
            try:
                record = _parse_line(raw, first=lineno == 1)
            except DataError as e:
                if not skip_malformed:
                    raise DataError(f"{path}:{lineno}: {e}") from None
                yield lineno, None
                continue
            if record is not None:
                yield lineno, record


def _parse_line(raw: bytes, first: bool) -> dict | None:
    try:
        line = raw.decode("utf-8-sig" if first else "utf-8")  # tolerate a byte-order mark on line 1
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
    validate_record(obj)
    return obj


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
