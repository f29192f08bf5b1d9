"""Tokenised data cached on disk through Hugging Face datasets: reused across runs and ranks, keyed so that a change
of data, tokenizer or masking options is never served stale; Parquet sources read like JSONL ones."""

import json
import multiprocessing as mp
import os
import pytest

import moetune.data as data
from moetune.data import build_packs, data_options, load_tokenizer

from helpers import free_port, write_chat_jsonl

pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture
def counted(monkeypatch):
    """Counts the records actually tokenised (a cache hit tokenises none)."""
    calls = []
    real = data.tokenize_record

    def counting(record, tokenizer, **kw):
        calls.append(1)
        return real(record, tokenizer, **kw)

    monkeypatch.setattr(data, "tokenize_record", counting)
    return calls


def entries(cache_dir):
    return sorted(p for p in cache_dir.iterdir() if p.is_dir())


def test_second_run_hits_the_cache(tmp_path, tok, counted):
    path = write_chat_jsonl(tmp_path / "d.jsonl", n=40)
    cache = tmp_path / "cache"
    packs1, stats1 = build_packs(path, tok, 64, cache_dir=str(cache))
    assert stats1["cache"] == "miss" and len(counted) == 40
    (entry,) = entries(cache)
    arrow = next(entry.glob("*.arrow"))
    mtime = arrow.stat().st_mtime_ns
    packs2, stats2 = build_packs(path, tok, 64, cache_dir=str(cache))
    assert stats2["cache"] == "hit" and len(counted) == 40  # nothing tokenised the second time
    assert arrow.stat().st_mtime_ns == mtime and entries(cache) == [entry]
    assert packs1 == packs2 == build_packs(path, tok, 64)[0]  # the same packs as without a cache
    assert stats1 == dict(stats2, cache="miss")
    # packing options are applied after the cache: another seq_len still hits
    assert build_packs(path, tok, 128, cache_dir=str(cache))[1]["cache"] == "hit"


def test_config_resolves_the_cache_dir(tmp_path, monkeypatch):
    from moetune.config import load_config

    monkeypatch.setenv("MOETUNE_CACHE_DIR", str(tmp_path / "env"))
    assert data_options(load_config(None).data)["cache_dir"] == str(tmp_path / "env")
    assert data_options(load_config(None, ["--data.cache_dir", str(tmp_path / "x")]).data)["cache_dir"] == str(tmp_path / "x")
    assert data_options(load_config(None, ["--data.cache", "false"]).data)["cache_dir"] is None


def test_a_change_of_data_tokenizer_or_masking_misses(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    write_chat_jsonl(path, n=10)
    cache = str(tmp_path / "cache")
    assert build_packs(str(path), tok, 64, cache_dir=cache)[1]["cache"] == "miss"
    assert build_packs(str(path), tok, 64, cache_dir=cache, train_reasoning=False)[1]["cache"] == "miss"
    assert build_packs(str(path), tok, 64, cache_dir=cache, train_on="all")[1]["cache"] == "miss"
    other = load_tokenizer(None)
    other.chat_template = other.chat_template.replace("'\\n'", "'\\n\\n'")
    assert build_packs(str(path), other, 64, cache_dir=cache)[1]["cache"] == "miss"
    write_chat_jsonl(path, n=11)  # same name, new content
    assert build_packs(str(path), tok, 64, cache_dir=cache)[1]["cache"] == "miss"
    assert len(os.listdir(cache)) == 5


def test_parquet_source_matches_jsonl(tmp_path, tok):
    import datasets

    rows = [{"messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "A1", "train": False},
                          {"role": "user", "content": "q2"}, {"role": "assistant", "content": "A2"}]},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "B",
                                                             "reasoning_content": "think"}]}]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = tmp_path / "d.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))  # Arrow fills the missing fields with nulls
    want = build_packs(str(jsonl), tok, 64)[0]
    assert build_packs(str(parquet), tok, 64)[0] == want
    assert build_packs(str(parquet), tok, 64, cache_dir=str(tmp_path / "cache"))[0] == want
    bad = tmp_path / "bad.parquet"
    datasets.Dataset.from_list([{"messages": [{"role": "robot", "content": "x"}]}]).to_parquet(str(bad))
    with pytest.raises(data.DataError, match=r"bad.parquet: row 0: messages\[0\]: role must be"):
        build_packs(str(bad), tok, 64)


def test_malformed_line_still_names_file_and_line_with_the_cache(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    write_chat_jsonl(path, n=3)
    with open(path, "a") as f:
        f.write("{not json\n")
    with pytest.raises(data.DataError, match=r"d.jsonl:4: invalid JSON"):
        build_packs(str(path), tok, 64, cache_dir=str(tmp_path / "cache"))
    assert not os.path.exists(tmp_path / "cache") or entries(tmp_path / "cache") == []  # no half-written entry


def _rank(rank, port, path, cache, out):
    import torch.distributed as dist

    from moetune.parallel.mesh import Dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    calls = []
    real = data.tokenize_record
    data.tokenize_record = lambda *a, **k: calls.append(1) or real(*a, **k)
    tok = load_tokenizer(None)
    packs, stats = build_packs(path, tok, 64, cache_dir=cache, dist=Dist(rank=rank, world_size=2, local_rank=rank))
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"calls": len(calls), "packs": packs}, f)
    dist.destroy_process_group()


def test_rank0_tokenises_and_the_other_rank_reads(tmp_path):
    path = write_chat_jsonl(tmp_path / "d.jsonl", n=30)
    ctx = mp.get_context("spawn")
    port, out = free_port(), str(tmp_path / "out")
    procs = [ctx.Process(target=_rank, args=(r, port, path, str(tmp_path / "cache"), out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    assert [p.exitcode for p in procs] == [0, 0]
    r0, r1 = (json.load(open(f"{out}.{r}")) for r in range(2))
    assert r0["calls"] == 30 and r1["calls"] == 0
    assert r0["packs"] == r1["packs"]
