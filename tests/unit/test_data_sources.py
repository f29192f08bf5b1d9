"""The data people bring: Alpaca, ShareGPT, OpenAI content parts, renamed columns, several sources mixed by weight,
train.epochs, a missing file named as such, and a warning when the tokenizer loses characters to <unk>."""

import json
import logging

import pytest

from moetune.config import ConfigError, load_config, train_steps_for_epochs
from moetune.data import DataError, build_packs, load_tokenizer, read_records, tokenize_record
from moetune.data.formats import normalize_record

CHAT = [{"role": "user", "content": "upper: abc"}, {"role": "assistant", "content": "ABC"}]


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_alpaca_sharegpt_and_content_parts_become_messages(tmp_path):
    rows = [
        {"instruction": "upper:", "input": "abc", "output": "ABC", "id": 7},
        {"instruction": "upper: abc", "output": "ABC", "system": "be terse"},
        {"conversations": [{"from": "human", "value": "upper: abc"}, {"from": "gpt", "value": "ABC"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "upper: "}, {"type": "text", "text": "abc"}]},
                      {"role": "assistant", "content": "ABC"}]},
    ]
    records, _ = read_records(write(tmp_path / "d.jsonl", rows))
    assert records[0]["messages"] == [{"role": "user", "content": "upper:\n\nabc"}, {"role": "assistant", "content": "ABC"}]
    assert records[0]["id"] == 7
    assert records[1]["messages"][0] == {"role": "system", "content": "be terse"}
    assert records[2]["messages"] == CHAT and records[3]["messages"] == CHAT
    tok = load_tokenizer(None)
    ids, mask = tokenize_record(records[2], tok)
    assert ids == tokenize_record({"messages": CHAT}, tok)[0] and any(mask)


@pytest.mark.parametrize("row,error", [
    ({"conversations": [{"from": "narrator", "value": "x"}]}, "unknown speaker 'narrator'"),
    ({"instruction": "x"}, "needs 'output'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "content\\[0\\] is 'image_url'"),
])
def test_malformed_new_formats_name_the_line(tmp_path, row, error):
    with pytest.raises(DataError, match=f"d.jsonl:2: .*{error}"):
        read_records(write(tmp_path / "d.jsonl", [{"text": "ok"}, row]))


def test_column_mapping_from_the_config(tmp_path):
    cfg = load_config(None, ["--data.columns", "{instruction: question, output: answer}"])
    assert normalize_record({"question": "upper: abc", "answer": "ABC"}, cfg.data.columns)["messages"] == CHAT
    path = write(tmp_path / "d.jsonl", [{"question": "upper: abc", "answer": "ABC"}] * 3)
    packs, stats = build_packs(path, load_tokenizer(None), 64, columns=cfg.data.columns)
    assert stats["documents"] == 3
    with pytest.raises(ConfigError, match="data.columns.*unknown field 'instructions'.*did you mean 'instruction'"):
        load_config(None, ["--data.columns", "{instructions: q}"])


def test_sources_mixed_by_weight(tmp_path):
    a = write(tmp_path / "a.jsonl", [{"text": f"a{i}"} for i in range(10)])
    b = write(tmp_path / "b.jsonl", [{"text": f"b{i}"} for i in range(10)])
    tok = load_tokenizer(None)
    cfg = load_config(None, ["--data.train", f"[{a}, {{path: {b}, weight: 0.5}}]"])
    assert cfg.data.train[1].weight == 0.5
    _, stats = build_packs(cfg.data.train, tok, 16, pack=False)
    assert stats["documents"] == 15  # all of a, a seeded half of b
    _, stats = build_packs([{"path": a, "weight": 2.0}], tok, 16, pack=False)
    assert stats["documents"] == 20
    with pytest.raises(ConfigError, match="data.train"):
        load_config(None, ["--data.train", "[]"])


def test_epochs_give_the_steps():
    cfg = load_config(None, ["--train.epochs", "2.5", "--train.grad_accum", "2"])
    assert train_steps_for_epochs(cfg, batches_per_epoch=10) == 13  # ceil(2.5 * 10 / 2)
    with pytest.raises(ConfigError, match="train.epochs"):
        load_config(None, ["--train.epochs", "0"])


def test_missing_local_file_says_file_not_found(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl: file not found"):
        build_packs(str(tmp_path / "nope.jsonl"), load_tokenizer(None), 64)


def test_warns_when_the_tokenizer_maps_many_characters_to_unk(tmp_path, caplog):
    path = write(tmp_path / "d.jsonl", [{"text": "größe café naïve"}] * 4)
    with caplog.at_level(logging.WARNING, logger="moetune"):
        build_packs(path, load_tokenizer(None), 64)
    assert any("are <unk>" in r.getMessage() and "data.tokenizer" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moetune"):
        build_packs(write(tmp_path / "ok.jsonl", [{"text": "plain ascii"}]), load_tokenizer(None), 64)
    assert not caplog.records


def test_a_run_with_epochs_trains_that_many_passes(tmp_path):
    import yaml

    from helpers import run_inprocess, small_run_args, step_losses

    run = run_inprocess(small_run_args(tmp_path, "ep", **{"train.epochs": 1, "train.steps": 999}))
    # 48 conversations pack into 25 packs of 64 tokens: 12 global micro-batches of 2 per epoch
    assert len(step_losses(run)) == 12
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 12


@pytest.mark.parametrize("cache", [True, False])
def test_damaged_columnar_files_and_plain_directories_are_named(tmp_path, cache):
    """A file that is not what its suffix says, or a folder of JSONL files, was a pyarrow / datasets traceback."""
    tok = load_tokenizer(None)
    fake_parquet, fake_arrow, folder = tmp_path / "d.parquet", tmp_path / "d.arrow", tmp_path / "folder"
    fake_parquet.write_text("not parquet\n")
    fake_arrow.write_bytes(b"garbage!" * 4)
    folder.mkdir()
    write(folder / "train.jsonl", [{"messages": CHAT}])
    cache_dir = str(tmp_path / "cache") if cache else None
    for path, said in ((fake_parquet, "cannot read it as Parquet"), (fake_arrow, "cannot read it as an Arrow file"),
                       (folder, f"not one written by Dataset.save_to_disk; list its data files instead, e.g. "
                                f"[{folder / 'train.jsonl'}]")):
        with pytest.raises(DataError) as e:
            build_packs(str(path), tok, 64, cache_dir=cache_dir)
        assert str(e.value).startswith(f"{path}: ") and said in str(e.value) and "\n" not in str(e.value)


def test_a_column_mapping_that_matches_nothing_says_what_it_looked_for(tmp_path):
    path = write(tmp_path / "d.jsonl", [{"dialogue": CHAT}])
    with pytest.raises(DataError) as e:
        read_records(path, columns={"messages": "dialog"})
    assert str(e.value) == (f"{path}:1: no column data.columns names is here: it looks for 'dialog' (for messages); "
                            "the record has keys ['dialogue']")
    assert read_records(path, columns={"messages": "dialogue"})[0][0]["messages"] == CHAT


def test_a_tokenizer_that_cannot_load_is_one_line_with_the_whole_reason(monkeypatch, tmp_path):
    """transformers says what it looked for on one line and why on the next ones; only the first reached the user."""
    from types import SimpleNamespace

    from moetune.errors import ConfigError
    from moetune.train import data_setup

    def failing(src):
        raise OSError(f"Can't load tokenizer for '{src}'.\n\nMake sure that:\n- it is a folder with tokenizer.json")

    monkeypatch.setattr(data_setup, "load_tokenizer", failing)
    cfg = SimpleNamespace(data=SimpleNamespace(tokenizer=str(tmp_path)), model=SimpleNamespace(path=None))
    with pytest.raises(ConfigError) as e:
        data_setup.run_tokenizer(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "Can't load tokenizer" in msg and "it is a folder with tokenizer.json" in msg, msg
