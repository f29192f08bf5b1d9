"""Where records come from, and tokenised documents cached on disk.

Sources: JSONL (read by formats.py, so a bad line is reported as ``file:line``), Parquet, Arrow (a file, or a
directory written by ``Dataset.save_to_disk``) and, where a network exists, Hugging Face hub names (``org/name`` or
``org/name:split``). Hugging Face ``datasets`` reads the columnar formats and the hub, and writes the cache.

The cache holds tokenised documents (ids and trained mask, before packing: packing is cheap and depends on
seq_len), one Arrow file per key, where the key hashes the source's *content*, the tokenizer (vocabulary, special
tokens, chat template), the masking options and the source of the code that tokenises. So a second run, a resumed
run, ``moetune inspect`` and every rank of a multi-GPU run all read the same file, and any change that could change
a token or a mask makes a new key instead of a stale hit. Entries are written under a temporary name and renamed,
so a crash leaves no half entry and two runs building the same key at once cannot corrupt it.

Ranks: rank 0 builds the entry while the others wait on a gloo barrier with a long timeout (tokenising a big set
takes longer than NCCL's default 10 minutes); where the cache directory is not shared between nodes, the first
rank of each node that cannot see it builds its own copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

from moetune.errors import ConfigError

from .formats import DataError, iter_records, normalize_record, validate_record

CACHE_VERSION = 1
COLUMNAR = (".parquet", ".arrow")
_long_group = None


def default_cache_dir() -> str:
    return os.environ.get("MOETUNE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "moetune", "datasets")


def usable_cache_dir(path: str, key: str) -> str:
    """``path``, created if missing, once it is known to be a directory this process can write; else a ConfigError
    naming ``key`` (the setting it came from) and the path, and how to do without."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=path, prefix=".moetune-write-test-")
        probe.close()
    except FileExistsError:
        raise ConfigError(f"{key}: {path} is a file, not a directory (set data.cache_dir to a directory, or "
                          "data.cache: false)") from None
    except OSError as e:  # permission denied, a read-only file system, a file where a parent should be
        raise ConfigError(f"{key}: {path} cannot be used as the data cache ({e.strerror or type(e).__name__}); set "
                          "data.cache_dir to a writable directory, or data.cache: false") from None
    return path


# ------------------------------------------------------------------------------------------------ sources
def iter_source_records(path: str, skip_malformed: bool = False, cache_dir: str | None = None,
                        columns: dict | None = None):
    """``(where, record)`` pairs, ``where`` being ``file:line`` (JSONL) or ``source: row N``; a malformed record yields
    ``(where, None)`` when skipped and raises DataError naming ``where`` otherwise. ``cache_dir``: where datasets
    may keep its Arrow conversion of a Parquet file or hub download (None: in memory)."""
    if not _is_columnar(path):
        for lineno, record in iter_records(path, skip_malformed, columns):
            yield f"{path}:{lineno}", record
        return
    for i, row in enumerate(_load_columnar(path, cache_dir)):
        where = f"{path}: row {i}"
        record = _drop_nulls(row)  # Arrow fills a missing optional field (a turn's "train") with null
        try:
            record = normalize_record(record, columns)
            validate_record(record)
        except DataError as e:
            if not skip_malformed:
                raise DataError(f"{where}: {e}") from None
            record = None
        yield where, record


def _is_columnar(path: str) -> bool:
    if os.path.isdir(path) or path.endswith(COLUMNAR):
        return True
    return not os.path.exists(path) and _looks_like_hub_name(path)


def _looks_like_hub_name(path: str) -> bool:
    name = path.split(":")[0]
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and "." not in name.split("/")[1][-6:]


def _datasets():
    try:
        import datasets
    except ImportError:
        raise DataError("reading Parquet/Arrow/hub data and the tokenisation cache need Hugging Face `datasets`: "
                        "pip install datasets (or use JSONL with data.cache: false)") from None
    return datasets


def _load_columnar(path: str, cache_dir: str | None = None):
    ds = _datasets()
    hf_cache = dict(cache_dir=os.path.join(cache_dir, "hf")) if cache_dir else dict(keep_in_memory=True)
    if os.path.isdir(path):
        if not any(os.path.isfile(os.path.join(path, f)) for f in ("dataset_info.json", "dataset_dict.json")):
            files = sorted(f for f in os.listdir(path) if f.endswith((".jsonl", ".json", ".parquet", ".arrow")))
            more = ", ..." if len(files) > 2 else ""
            example = f", e.g. [{', '.join(os.path.join(path, f) for f in files[:2])}{more}]"
            raise DataError(f"{path}: a directory, but not one written by Dataset.save_to_disk; list its data files "
                            f"instead{example if files else ''}")
        return _read_local(path, "a saved data set", ds.load_from_disk, path)
    if path.endswith(".parquet"):
        return _read_local(path, "Parquet", ds.Dataset.from_parquet, path, **hf_cache)
    if path.endswith(".arrow"):
        return _read_local(path, "an Arrow file", ds.Dataset.from_file, path)
    name, _, split = path.partition(":")
    try:
        return ds.load_dataset(name, split=split or "train", **hf_cache)
    except Exception as e:  # offline, unknown name, gated: one message that says what was tried
        raise DataError(f"{path}: not a local file, and loading it as a Hugging Face hub data set failed: {e}") from None


def _read_local(path: str, what: str, read, *args, **kwargs):
    """A local columnar file through `datasets`; one that is damaged or of another format is the user's to fix (a
    DataError naming it), whatever pyarrow or datasets raise for it (ArrowInvalid, DatasetGenerationError, OSError)."""
    import pyarrow  # optional, as datasets (which needs it)
    from datasets.exceptions import DatasetsError

    # datasets logs an ERROR line of its own before raising: the DataError says it once
    hf_log = logging.getLogger("datasets")
    level = hf_log.level
    hf_log.setLevel(logging.CRITICAL)
    try:
        return read(*args, **kwargs)
    except (OSError, ValueError, pyarrow.ArrowException, DatasetsError) as e:
        cause = e.__cause__ or e
        raise DataError(f"{path}: cannot read it as {what} ({type(cause).__name__}: {str(cause)[:200]})") from None
    finally:
        hf_log.setLevel(level)


def _drop_nulls(row: dict) -> dict:
    out = {k: v for k, v in row.items() if v is not None}
    if isinstance(out.get("messages"), list):
        out["messages"] = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
                           for m in out["messages"]]
    return out


@contextmanager
def progress_bars(on: bool):
    """Hugging Face datasets' bars (tokenising, reading Parquet) on or off for a while; its switch is global."""
    if on:
        yield
        return
    ds = _datasets_if_installed()
    was_on = ds is not None and not ds.are_progress_bars_disabled()
    if was_on:
        ds.disable_progress_bars()
    try:
        yield
    finally:
        if was_on:
            ds.enable_progress_bars()


def _datasets_if_installed():
    try:
        import datasets
    except ImportError:
        return None
    return datasets


# ------------------------------------------------------------------------------------------------ keys
def source_fingerprint(path: str, cache_dir: str | None = None) -> str:
    """Content hash of a file or directory; a hub data set's own fingerprint (name, revision, files)."""
    h = hashlib.sha256()
    if os.path.isfile(path):
        _hash_file(h, path)
    elif os.path.isdir(path):
        for f in sorted(Path(path).rglob("*")):
            if f.is_file():
                h.update(str(f.relative_to(path)).encode())
                _hash_file(h, f)
    else:
        h.update(f"hub:{path}:{getattr(_load_columnar(path, cache_dir), '_fingerprint', '')}".encode())
    return h.hexdigest()


def _hash_file(h, path) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    h.update(json.dumps([tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token], default=str).encode())
    return h.hexdigest()


def _code_fingerprint() -> str:
    # The code that turns a record into ids and a mask: edit it and old entries stop matching.
    here = Path(__file__).resolve().parent
    return hashlib.sha256(b"".join((here / f).read_bytes() for f in ("chat.py", "formats.py"))).hexdigest()


def cache_key(path: str, tokenizer, options: dict, cache_dir: str | None = None) -> str:
    blob = json.dumps({"v": CACHE_VERSION, "source": source_fingerprint(path, cache_dir), "tokenizer": tokenizer_fingerprint(tokenizer),
                       "code": _code_fingerprint(), "options": options}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


# ------------------------------------------------------------------------------------------------ cache
def cached_documents(path: str, tokenizer, tokenize, options: dict, cache_dir: str, dist=None):
    """(docs, skipped, "hit" | "miss") with docs [(ids, mask)], building the entry if this process must.
    ``tokenize(record) -> (ids, mask)``; ``options`` are what ``tokenize`` depends on (they go into the key)."""
    os.makedirs(cache_dir, exist_ok=True)
    multi = dist is not None and dist.initialized and dist.world_size > 1
    key = _broadcast(cache_key(path, tokenizer, options, cache_dir) if dist.is_main else None) if multi \
        else cache_key(path, tokenizer, options, cache_dir)
    entry = Path(cache_dir) / key
    hit = _complete(entry)
    if not multi:
        if not hit:
            _build(entry, path, tokenize, options, cache_dir)
        return (*_load(entry), "hit" if hit else "miss")
    if dist.is_main and not hit:
        _build(entry, path, tokenize, options, cache_dir)
    _long_barrier()
    import torch

    missing = torch.tensor([0 if _complete(entry) else 1])
    _long_group_all_reduce(missing)
    if missing.item():  # some node does not share this cache directory: its first rank builds a copy
        if dist.local_rank == 0 and not _complete(entry):
            _build(entry, path, tokenize, options, cache_dir)
        _long_barrier()
    return (*_load(entry), "hit" if hit else "miss")


def _complete(entry: Path) -> bool:
    return (entry / "info.json").is_file()


def _build(entry: Path, path: str, tokenize, options: dict, cache_dir: str) -> None:
    ds = _datasets()
    lines, records, skipped = [], [], 0
    for where, record in iter_source_records(path, options.get("skip_malformed", False), cache_dir,
                                             options.get("columns")):
        if record is None:
            skipped += 1
        else:
            lines.append(where)
            records.append(json.dumps(record))

    def tokenize_batch(batch):
        out = {"input_ids": [], "mask": []}
        for where, text in zip(batch["where"], batch["record"]):
            try:
                ids, mask = tokenize(json.loads(text))
            except DataError as e:  # e.g. the chat template rejects the conversation: say which line
                if not options.get("skip_malformed", False):
                    raise DataError(f"{where}: {e}") from None
                continue
            out["input_ids"].append(ids)
            out["mask"].append(mask)
        return out

    tmp = entry.with_name(f"{entry.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        features = ds.Features({"input_ids": ds.List(ds.Value("int32")), "mask": ds.List(ds.Value("bool"))})
        source = ds.Dataset.from_dict({"where": lines, "record": records})
        docs = source.map(tokenize_batch, batched=True, batch_size=256, remove_columns=["where", "record"],
                          features=features, cache_file_name=str(tmp / "tokenized.arrow"),
                          new_fingerprint=entry.name, desc=f"tokenizing {os.path.basename(path)}")
        skipped += len(records) - len(docs)
        info = {"source": path, "documents": len(docs), "skipped_malformed": skipped, "options": options}
        (tmp / "info.json").write_text(json.dumps(info, indent=1))  # written last: marks the entry complete
        del docs, source
        try:
            os.rename(tmp, entry)
        except OSError:  # another process completed the same key first: theirs is identical
            if not _complete(entry):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load(entry: Path) -> tuple[list[tuple[list[int], list[bool]]], int]:
    ds = _datasets()
    info = json.loads((entry / "info.json").read_text())
    files = sorted(entry.glob("*.arrow"))
    if not files:
        return [], info["skipped_malformed"]
    table = ds.concatenate_datasets([ds.Dataset.from_file(str(f)) for f in files]).data
    docs = list(zip(table.column("input_ids").to_pylist(), table.column("mask").to_pylist()))
    return docs, info["skipped_malformed"]


# ------------------------------------------------------------------------------------------------ ranks
def _group():
    global _long_group
    if _long_group is None:
        import torch.distributed as tdist

        # gloo on the CPU whatever the training backend: a barrier that can wait for hours without a GPU stream
        _long_group = tdist.new_group(backend="gloo", timeout=timedelta(hours=6))
    return _long_group


def _long_barrier() -> None:
    import torch.distributed as tdist

    tdist.barrier(group=_group())


def _long_group_all_reduce(t) -> None:
    import torch.distributed as tdist

    tdist.all_reduce(t, group=_group())


def _broadcast(value):
    import torch.distributed as tdist

    box = [value]
    tdist.broadcast_object_list(box, src=0, group=_group())
    return box[0]
