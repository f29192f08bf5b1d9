"""Text a user gives (a config file, a command-line value, a prompt) must be UTF-8: the one check, and the one message
for it. Bytes that are not UTF-8 reach Python from argv and stdin as lone surrogates (PEP 383) and JSON's \\u escapes
can spell them; no tokenizer, YAML reader or file encodes them, and each failed with its own traceback."""

from __future__ import annotations

from moetune.errors import MoetuneError, TextError


def check_text(text: str, where: str, error: type[MoetuneError] = TextError) -> str:
    """`text` as is, or `error` naming `where` and the first character that is not text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        what = (f"the byte 0x{code - 0xDC00:02x}, which is not UTF-8" if 0xDC80 <= code <= 0xDCFF
                else f"{text[e.start]!r}, half of a UTF-16 surrogate pair")
        raise error(f"{where}: character {e.start + 1} is {what}; moetune reads UTF-8 text") from None
    return text


def decode_utf8(data: bytes, label: str, error: type[MoetuneError] = TextError) -> str:
    """The text of a file's bytes, or `error` naming the file, line and byte that is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise error(f"{label}:{line}: the byte 0x{data[e.start]:02x} is not UTF-8; moetune reads UTF-8 text") from None
