"""JSONL reading: valid records pass through, every malformed line is reported as path:line or skipped and counted."""

import json

import pytest

from moetune.data import DataError, build_packs, load_tokenizer, read_records

GOOD_TEXT = {"text": "hello"}
GOOD_CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "train": True}]}


def write_lines(tmp_path, lines, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_reads_text_and_messages_and_ignores_blank_lines(tmp_path):
    path = write_lines(tmp_path, [json.dumps(GOOD_TEXT), "", "   ", json.dumps({**GOOD_CHAT, "id": 7})])
    records, skipped = read_records(path)
    assert records == [GOOD_TEXT, {**GOOD_CHAT, "id": 7}]
    assert skipped == 0


@pytest.mark.parametrize(
    "bad_line, reason",
    [
        ('{"text": "unterminated', "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"prompt": "x"}', "exactly one of 'text'"),
        ('{"text": "a", "messages": []}', "it has both"),
        ('{"text": 3}', "'text' must be a string"),
        ('{"messages": []}', "non-empty list"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "role must be one of"),
        ('{"messages": [{"role": "user", "content": ["x"]}]}', "content must be a string"),
        ('{"messages": [{"role": "user"}]}', "content must be a string"),
        ('{"messages": [{"role": "user", "content": "x", "train": "yes"}]}', "train must be true or false"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, bad_line, reason):
    path = write_lines(tmp_path, [json.dumps(GOOD_TEXT), "", bad_line, json.dumps(GOOD_TEXT)])
    with pytest.raises(DataError) as err:
        read_records(path)
    message = str(err.value)
    assert message.startswith(f"{path}:3: "), message  # line 3: the blank line 2 still counts
    assert reason in message


def test_invalid_utf8_is_a_malformed_line(tmp_path):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n')
    with pytest.raises(DataError, match=r":2: not valid UTF-8"):
        read_records(str(path))


def test_skip_malformed_counts_the_skipped_lines(tmp_path):
    path = write_lines(tmp_path, ["not json", json.dumps(GOOD_TEXT), '{"text": 1}', "[]", json.dumps(GOOD_CHAT)])
    records, skipped = read_records(path, skip_malformed=True)
    assert records == [GOOD_TEXT, GOOD_CHAT]
    assert skipped == 3


def test_missing_file_names_the_path(tmp_path):
    path = str(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="nope.jsonl"):
        read_records(path)


def test_build_packs_reports_skipped_lines_and_template_errors_with_their_line(tmp_path):
    tokenizer = load_tokenizer(None)
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"  # a template that rejects everything
    path = write_lines(tmp_path, [json.dumps(GOOD_TEXT), json.dumps(GOOD_CHAT)])
    with pytest.raises(DataError, match=r":2: the chat template rejected this conversation: .*alternate"):
        build_packs(path, tokenizer, seq_len=32)
    packs, stats = build_packs(path, tokenizer, seq_len=32, skip_malformed=True)
    assert stats["skipped_malformed"] == 1 and stats["documents"] == 1


def test_empty_dataset_error_names_the_file(tmp_path):
    path = write_lines(tmp_path, ["", "  "])
    with pytest.raises(DataError, match=r"data.jsonl: the dataset is empty"):
        build_packs(path, load_tokenizer(None), seq_len=32)


@pytest.mark.parametrize("line, where", [
    ('{"text": "a \\ud800 b"}', "'text'"),
    ('{"messages": [{"role": "user", "content": "\\udfff"}, {"role": "assistant", "content": "y"}]}',
     "messages[0].content"),
    ('{"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "\\ud83d"}]}',
     "messages[1].content"),
])
def test_a_lone_surrogate_is_a_malformed_line_named_by_file_and_line(tmp_path, line, where):
    # JSON's \u escapes can spell half a surrogate pair; the tokenizer then raised a TypeError with no location
    path = write_lines(tmp_path, [json.dumps(GOOD_TEXT), line])
    tokenizer = load_tokenizer(None)
    with pytest.raises(DataError, match=rf"^{path}:2: .*surrogate") as err:
        build_packs(path, tokenizer, 64)
    assert where in str(err.value)
    packs, stats = build_packs(path, tokenizer, 64, skip_malformed=True)
    assert stats["skipped_malformed"] == 1 and packs


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32"])
def test_a_utf16_or_utf32_file_is_named_as_such(tmp_path, encoding):
    path = tmp_path / "wide.jsonl"
    path.write_text(json.dumps(GOOD_TEXT) + "\n", encoding=encoding)  # Python writes the BOM first
    with pytest.raises(DataError, match=rf":1: the file is {encoding.upper()}-encoded; JSONL must be UTF-8"):
        read_records(str(path))


def test_byte_order_marks_of_concatenated_files_are_tolerated(tmp_path):
    path = tmp_path / "cat.jsonl"
    line = "\ufeff" + json.dumps(GOOD_TEXT) + "\n"
    path.write_bytes((line + line).encode("utf-8"))
    assert read_records(str(path)) == ([GOOD_TEXT, GOOD_TEXT], 0)


def test_nul_characters_are_text_and_raw_nul_bytes_a_malformed_line(tmp_path):
    path = tmp_path / "nul.jsonl"
    path.write_bytes(b'{"text": "a\\u0000b"}\n{"text": "a\x00b"}\n')
    with pytest.raises(DataError, match=r":2: invalid JSON"):
        read_records(str(path))
    packs, stats = build_packs(str(path), load_tokenizer(None), 64, skip_malformed=True)
    assert stats["skipped_malformed"] == 1 and packs
