"""The data pipeline: JSONL (or Parquet, Arrow, hub; several sources mixed by weight) -> records -> (token ids, trained mask) -> fixed-length packs -> micro-batches.

    formats.py  read and validate JSONL (errors name file:line); Alpaca, ShareGPT, content parts, column mapping
    cache.py    Parquet/Arrow/hub sources through HF datasets; tokenised documents cached on disk across runs and ranks
    chat.py     render conversations with the tokenizer's chat template; which tokens are trained (reasoning too)
    packing.py  documents -> packs with position ids restarting per document and pre-shifted labels
    loader.py   deterministic, resumable, data-parallel micro-batches; eval batches
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

from moetune.interruptible import interruptible
from moetune.names import IGNORE_INDEX

from .cache import cached_documents, default_cache_dir, iter_source_records, progress_bars, usable_cache_dir
from .chat import tokenize_record
from .formats import DataError, read_records
from .loader import PackedLoader, eval_batches
from .packing import pack_documents

DEMO_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "tokenizer"
LONGEST_DOCUMENT = 1 << 17  # tokens: GLM-4.5's context; a record that surely exceeds it is never tokenised


def build_packs(
    path, tokenizer, seq_len: int, *, train_on: str = "assistant", pack: bool = True, skip_malformed: bool = False,
    train_reasoning: bool = True, train_empty_think: bool = False, cache_dir: str | None = None, dist=None,
    columns: dict | None = None, seed: int = 0, progress: bool = True,
) -> tuple[list[dict], dict]:
    """Read, tokenize and pack the data: one source (JSONL, Parquet, Arrow, hub name) or a list of sources, each a
    path or {"path", "weight"} (see `mix_documents`). Stats: those of pack_documents plus "skipped_malformed",
    "cache" ("hit", "miss" or "off") and "unk_tokens". ``cache_dir`` None tokenises in memory, every time. ``progress``:
    whether Hugging Face datasets may draw its progress bars (tokenising, reading Parquet)."""
    # hours on a large set, and a stop signal may end it at once: what it caches is renamed into place complete
    with interruptible("data preparation"), progress_bars(progress):
        return _build_packs(path, tokenizer, seq_len, train_on=train_on, pack=pack, skip_malformed=skip_malformed,
                            train_reasoning=train_reasoning, train_empty_think=train_empty_think, cache_dir=cache_dir,
                            dist=dist, columns=columns, seed=seed)


def _build_packs(path, tokenizer, seq_len, *, train_on, pack, skip_malformed, train_reasoning, train_empty_think,
                 cache_dir, dist, columns, seed):
    sources = _sources(path)
    docs, skipped, caches = [], 0, []
    for src, weight in sources:
        d, s, cache = tokenized_documents(src, tokenizer, train_on=train_on, skip_malformed=skip_malformed,
                                          train_reasoning=train_reasoning, train_empty_think=train_empty_think,
                                          cache_dir=cache_dir, dist=dist, columns=columns, max_tokens=seq_len)
        _warn_unknown_characters(src, d, tokenizer, dist)
        docs.append((d, weight))
        skipped += s
        caches.append(cache)
    docs = docs[0][0] if len(docs) == 1 and docs[0][1] == 1.0 else mix_documents(docs, seed)
    label = path if isinstance(path, str) else ", ".join(src for src, _ in sources)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise DataError("the tokenizer has neither a pad nor an eos token to pad packs with")
    try:
        packs, stats = pack_documents(docs, seq_len, pad_id, pack=pack)
    except DataError as e:
        suffix = f" ({skipped} malformed lines skipped)" if skipped else ""
        raise DataError(f"{label}: {e}{suffix}") from None
    stats["skipped_malformed"] = skipped
    stats["cache"] = caches[0] if len(set(caches)) == 1 else ",".join(caches)
    return packs, stats


def _sources(path) -> list[tuple[str, float]]:
    """[(path, weight)] of data.train / data.eval: a path, or a list of paths and {"path", "weight"} mappings."""
    if isinstance(path, (str, os.PathLike)):
        return [(os.fspath(path), 1.0)]
    out = []
    for item in path:
        if isinstance(item, (str, os.PathLike)):
            out.append((os.fspath(item), 1.0))
        else:
            item = item if isinstance(item, dict) else item.model_dump()
            out.append((item["path"], float(item.get("weight", 1.0))))
    if not out:
        raise DataError("the list of data sources is empty")
    return out


def mix_documents(sources: list[tuple[list, float]], seed: int = 0) -> list:
    """Documents of several sources by weight: a weight is how many times each document of its source is used per
    epoch — 2.0 repeats every document twice, 0.5 keeps a seeded half, 1.5 every document once plus a seeded
    half. The packer and the loader's shuffle then interleave the sources."""
    import random

    rng = random.Random(seed)
    out = []
    for docs, weight in sources:
        whole, frac = int(weight), weight - int(weight)
        out += docs * whole
        if frac > 0 and docs:
            out += rng.sample(docs, round(frac * len(docs)))
    return out


# the share of <unk> tokens above which a data set is said to lose characters
UNK_WARN_RATIO = 0.001


def _warn_unknown_characters(path: str, docs, tokenizer, dist=None) -> None:
    """The embedded demo tokenizer (and any with an <unk>) silently maps what it cannot represent to <unk>: say so."""
    unk = tokenizer.unk_token_id
    if unk is None or not docs or (dist is not None and not getattr(dist, "is_main", True)):
        return
    n_unk = sum(ids.count(unk) for ids, _ in docs)
    total = sum(len(ids) for ids, _ in docs)
    if n_unk > UNK_WARN_RATIO * total:
        logging.getLogger("moetune").warning(
            "%s: %d of %d tokens (%.2f%%) are %s: the tokenizer cannot represent these characters (the embedded demo "
            "tokenizer knows ASCII only); set data.tokenizer or model.path to the model's tokenizer",
            path, n_unk, total, 100.0 * n_unk / total, tokenizer.unk_token)


def tokenized_documents(path: str, tokenizer, *, train_on: str = "assistant", skip_malformed: bool = False,
                        train_reasoning: bool = True, train_empty_think: bool = False, cache_dir: str | None = None,
                        dist=None, columns: dict | None = None, max_tokens: int | None = None
                        ) -> tuple[list[tuple[list[int], list[bool]]], int, str]:
    """(documents as (ids, trained mask), malformed records skipped, cache "hit" | "miss" | "off"). A record whose
    text is too long to fit in ``max_tokens`` tokens whatever the tokenizer does is not tokenised at all (a huge line
    would cost minutes): it stands in as a document one token too long, which packing drops. The bound is at least
    LONGEST_DOCUMENT tokens, so that the cache (which does not depend on seq_len) serves every usual seq_len."""
    options = dict(train_on=train_on, train_reasoning=train_reasoning, train_empty_think=train_empty_think)
    bound = None if max_tokens is None else max(max_tokens, LONGEST_DOCUMENT)
    max_chars = None if bound is None else bound * _max_chars_per_token(tokenizer)

    def tokenize(record):
        if max_chars is not None and _record_chars(record) > max_chars:
            return [0] * (bound + 1), [False] * (bound + 1)
        return tokenize_record(record, tokenizer, **options)

    if cache_dir is not None:
        key_options = dict(options, skip_malformed=skip_malformed, **({"max_chars": max_chars} if max_chars else {}),
                           **({"columns": columns} if columns else {}))
        return cached_documents(path, tokenizer, tokenize, key_options, cache_dir, dist)
    docs, skipped = [], 0
    for where, record in iter_source_records(path, skip_malformed, columns=columns):
        if record is None:
            skipped += 1
            continue
        try:
            docs.append(tokenize(record))
        except DataError as e:  # e.g. the chat template rejects the conversation: say which line
            if not skip_malformed:
                raise DataError(f"{where}: {e}") from None
            skipped += 1
    return docs, skipped, "off"


def _max_chars_per_token(tokenizer) -> int:
    """An upper bound on the characters one token stands for: its vocabulary string is at least as long as what it
    decodes to (byte-level and SentencePiece vocabularies), doubled for safety."""
    return 2 * max((len(t) for t in tokenizer.get_vocab()), default=1)


def _record_chars(record: dict) -> int:
    if isinstance(record.get("text"), str):
        return len(record["text"])
    total = 0
    for m in record.get("messages") or []:
        if isinstance(m, dict):
            total += sum(len(m[k]) for k in ("content", "reasoning_content") if isinstance(m.get(k), str))
    return total


def data_options(data_cfg, progress_bar: bool = True) -> dict:
    """build_packs' keyword arguments from the config's `data` section (the cache directory resolved).
    ``progress_bar``: logging.progress_bar; bars are drawn only where a person watches (a terminal), as the
    training bar is."""
    cache_dir = None
    if data_cfg.cache and importlib.util.find_spec("datasets") is None:
        # JSONL needs no datasets: train uncached rather than fail (Parquet/Arrow/hub sources still say what to install)
        logging.getLogger("moetune").info("data.cache: Hugging Face datasets is not installed, so tokenised data is "
                                          "not cached (pip install datasets)")
    elif data_cfg.cache:
        if data_cfg.cache_dir:
            cache_dir = usable_cache_dir(os.path.expanduser(data_cfg.cache_dir), "data.cache_dir")
        else:
            key = "MOETUNE_CACHE_DIR" if os.environ.get("MOETUNE_CACHE_DIR") else "the default data.cache_dir"
            cache_dir = usable_cache_dir(default_cache_dir(), key)
    return dict(train_on=data_cfg.train_on, pack=data_cfg.pack, skip_malformed=data_cfg.skip_malformed,
                train_reasoning=data_cfg.train_reasoning, train_empty_think=data_cfg.train_empty_think,
                cache_dir=cache_dir, columns=getattr(data_cfg, "columns", None) or None,
                progress=progress_bar and sys.stderr.isatty())


def load_tokenizer(name_or_path: str | None):
    """A Hugging Face tokenizer; None gives the embedded demo tokenizer shipped in moetune/assets/tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_TOKENIZER_DIR) if name_or_path is None else name_or_path)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token  # packs pad with it; padded positions are never trained
    return tokenizer


__all__ = [
    "DataError",
    "IGNORE_INDEX",
    "PackedLoader",
    "build_packs",
    "data_options",
    "eval_batches",
    "load_tokenizer",
    "pack_documents",
    "read_records",
    "tokenize_record",
    "tokenized_documents",
]
