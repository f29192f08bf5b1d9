"""`logging.progress_bar: false` turns off the tokenising bars too, not only the training bar."""

import sys

import pytest

import moetune.train.data_setup as data_setup
from helpers import run_inprocess, small_run_args, write_chat_jsonl
from moetune.data import build_packs, load_tokenizer


@pytest.mark.parametrize("progress", [True, False])
def test_tokenising_draws_bars_only_when_asked(tmp_path, capfd, progress):
    data = write_chat_jsonl(tmp_path / "d.jsonl", n=20)
    build_packs(data, load_tokenizer(None), 64, cache_dir=str(tmp_path / "cache"), progress=progress)
    assert ("tokenizing d.jsonl" in capfd.readouterr().err) == progress


class Stop(Exception):
    pass


@pytest.mark.parametrize("setting", [True, False])
def test_the_training_config_decides_the_tokenising_bars(tmp_path, monkeypatch, setting):
    asked = {}

    def recording_build_packs(*args, **kw):
        asked.update(kw)
        raise Stop

    monkeypatch.setattr(data_setup, "build_packs", recording_build_packs)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a person watches: only the setting decides
    with pytest.raises(Stop):
        run_inprocess(small_run_args(tmp_path, "bars", **{"logging.progress_bar": setting}))
    assert asked["progress"] is setting
