"""The data pipeline: JSONL -> records -> (token ids, trained mask) -> fixed-length packs -> micro-batches.

    formats.py  read and validate JSONL (errors name file:line)
    chat.py     render conversations with the tokenizer's chat template; which tokens are trained
    packing.py  documents -> packs with position ids restarting per document and pre-shifted labels
    loader.py   deterministic, resumable, data-parallel micro-batches; eval batches
"""

from __future__ import annotations

from pathlib import Path

from .chat import tokenize_record
from .formats import DataError, iter_records, read_records
from .loader import PackedLoader, eval_batches
from .packing import IGNORE_INDEX, pack_documents

DEMO_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "tokenizer"


def build_packs(
    path: str, tokenizer, seq_len: int, *, train_on: str = "assistant", pack: bool = True, skip_malformed: bool = False
) -> tuple[list[dict], dict]:
    """Read, tokenize and pack one JSONL file. Stats: those of pack_documents plus "skipped_malformed"."""
    docs, skipped = [], 0
    for lineno, record in iter_records(path, skip_malformed):
        if record is None:
            skipped += 1
            continue
        try:
            docs.append(tokenize_record(record, tokenizer, train_on))
        except DataError as e:  # e.g. the chat template rejects the conversation: say which line
            if not skip_malformed:
                raise DataError(f"{path}:{lineno}: {e}") from None
            skipped += 1
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise DataError("the tokenizer has neither a pad nor an eos token to pad packs with")
    try:
        packs, stats = pack_documents(docs, seq_len, pad_id, pack=pack)
    except DataError as e:
        suffix = f" ({skipped} malformed lines skipped)" if skipped else ""
        raise DataError(f"{path}: {e}{suffix}") from None
    stats["skipped_malformed"] = skipped
    return packs, stats


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
    "eval_batches",
    "load_tokenizer",
    "pack_documents",
    "read_records",
    "tokenize_record",
]
