"""A stop signal while the data is prepared (tokenising can take hours) ends it at once with one line, instead of
promising a checkpoint and tokenising on past the scheduler's grace period; no half cache entry is left behind."""

import os
import signal
import subprocess
import sys

import pytest

import moetune.data as data_module
from helpers import small_run_args, write_chat_jsonl
from moetune.data import build_packs, load_tokenizer
from moetune.train.signals import StopSignals, StoppedBySignal


def signal_at_record(monkeypatch, n):
    """Send SIGTERM to this process while tokenising record n; returns the list of records tokenised so far."""
    seen, tokenize = [], data_module.tokenize_record

    def tokenize_and_signal(record, *a, **k):
        seen.append(record)
        if len(seen) == n:
            os.kill(os.getpid(), signal.SIGTERM)
        return tokenize(record, *a, **k)

    monkeypatch.setattr(data_module, "tokenize_record", tokenize_and_signal)
    return seen


@pytest.mark.parametrize("cached", [False, True])
def test_sigterm_while_tokenising_stops_at_once_and_leaves_no_cache_entry(tmp_path, monkeypatch, cached):
    data = write_chat_jsonl(tmp_path / "d.jsonl", n=300)
    seen = signal_at_record(monkeypatch, 5)
    cache = tmp_path / "cache"
    signals = StopSignals()
    try:
        with pytest.raises(StoppedBySignal, match="SIGTERM during data preparation: stopped at once") as err:
            build_packs(data, load_tokenizer(None), 64, cache_dir=str(cache) if cached else None)
    finally:
        signals.close()
    assert err.value.exit_code == 128 + signal.SIGTERM
    assert len(seen) <= 6  # not the 300 records of the set
    if cached:
        assert list(cache.iterdir()) == [] or all(not (e / "info.json").exists() for e in cache.iterdir())
        assert not [p for p in cache.rglob("*") if ".tmp-" in p.name]


def test_a_signal_after_data_preparation_still_promises_a_checkpoint(tmp_path, capsys):
    signals = StopSignals()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # outside data preparation: the handler only records it
    finally:
        signals.close()
    assert signals.received == signal.SIGTERM
    assert "saving a checkpoint at the end of this step" in capsys.readouterr().err


def test_moetune_train_says_one_line_and_exits_with_the_signal(tmp_path):
    args = small_run_args(tmp_path, "sig")
    write_chat_jsonl(tmp_path / "data.jsonl", n=400)
    script = (
        "import os, signal, sys\n"
        "import moetune.data as d\n"
        "tokenize, n = d.tokenize_record, [0]\n"
        "def f(*a, **k):\n"
        "    n[0] += 1\n"
        "    if n[0] == 3: os.kill(os.getpid(), signal.SIGTERM)\n"
        "    assert n[0] < 50, 'tokenising went on after SIGTERM'\n"
        "    return tokenize(*a, **k)\n"
        "d.tokenize_record = f\n"
        "from moetune.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    env = dict(os.environ, MOETUNE_CACHE_DIR=str(tmp_path / "cache"))
    p = subprocess.run([sys.executable, "-c", script, "train", *args], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 128 + signal.SIGTERM, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert "moetune: error: SIGTERM during data preparation: stopped at once" in p.stderr
    assert not (tmp_path / "runs" / "sig").exists()  # a refused start leaves no trace
