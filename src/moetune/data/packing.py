"""Packing tokenized documents into fixed-length rows.

A pack is ``{"input_ids", "labels", "position_ids"}``, each a list of ``seq_len`` ints. Several documents share a row
without seeing each other: ``position_ids`` restart at 0 where a document starts, and the model builds its
block-diagonal attention from exactly that. Labels are already shifted (``labels[t]`` is the target predicted at
``t``), and never point across a document boundary, so the loss needs no further masking.
"""

from __future__ import annotations

from moetune.names import IGNORE_INDEX

from .formats import DataError


def pack_documents(
    docs: list[tuple[list[int], list[bool]]], seq_len: int, pad_id: int, pack: bool = True
) -> tuple[list[dict], dict]:
    """Greedy first-fit packing in document order (deterministic); ``pack=False`` puts one document per row.

    Dropped, and counted in the stats: documents longer than ``seq_len`` (cutting them would train on a truncated
    answer) and documents without any trained target (they would cost compute and teach nothing).
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    stats = {"documents": 0, "tokens": 0, "targets": 0, "dropped_too_long": 0, "dropped_no_targets": 0, "packs": 0}
    kept, longest = [], 0
    for ids, mask in docs:
        if len(ids) != len(mask):
            raise ValueError(f"a document has {len(ids)} ids but {len(mask)} mask entries")
        longest = max(longest, len(ids))
        if len(ids) > seq_len:
            stats["dropped_too_long"] += 1
        elif not any(mask[1:]):  # token 0 of a document can never be a target: nothing before it predicts it
            stats["dropped_no_targets"] += 1
        else:
            kept.append((ids, mask))
    if not kept:
        raise DataError(_nothing_left_message(len(docs), stats, seq_len, longest))

    rows = _first_fit([len(ids) for ids, _ in kept], seq_len) if pack else [[i] for i in range(len(kept))]
    packs = [_build_row([kept[i] for i in row], seq_len, pad_id) for row in rows]
    stats["documents"] = len(kept)
    stats["tokens"] = sum(len(ids) for ids, _ in kept)
    stats["targets"] = sum(sum(lab != IGNORE_INDEX for lab in p["labels"]) for p in packs)
    stats["packs"] = len(packs)
    return packs, stats


def _nothing_left_message(n_docs: int, stats: dict, seq_len: int, longest: int) -> str:
    if n_docs == 0:
        return "the dataset is empty: it holds no documents"
    if stats["dropped_too_long"] == n_docs:
        return (
            f"every sample is longer than seq_len={seq_len} (the longest has {longest} tokens): "
            f"raise seq_len or shorten the samples"
        )
    return (
        f"no trainable sample left out of {n_docs}: {stats['dropped_too_long']} longer than seq_len={seq_len} "
        f"(the longest has {longest} tokens), {stats['dropped_no_targets']} without any trained token "
        f"(e.g. conversations without an assistant turn, or every turn marked train: false)"
    )


def _first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Put each item, in order, into the first row with room for it.

    A max segment tree over the rows' free space finds that row in O(log n): a plain scan over all open rows
    is quadratic and takes minutes on a million short samples. Row j's leaf starts at full capacity, so the
    leftmost fitting leaf is either an existing row or the next new one.
    """
    size = 1
    while size < len(lengths):
        size *= 2
    free = [capacity] * (2 * size)  # free[1] is the root; leaves are free[size:]; every node holds its children's max
    rows: list[list[int]] = []
    for item, length in enumerate(lengths):
        node = 1
        while node < size:  # descend towards the leftmost leaf with enough room
            node = 2 * node if free[2 * node] >= length else 2 * node + 1
        row = node - size
        if row == len(rows):
            rows.append([])
        rows[row].append(item)
        free[node] -= length
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return rows


def _build_row(docs: list[tuple[list[int], list[bool]]], seq_len: int, pad_id: int) -> dict:
    input_ids, labels, position_ids = [], [], []
    for ids, mask in docs:
        input_ids += ids
        position_ids += range(len(ids))
        # labels[t] = ids[t+1] when that token is trained; the last token of a document predicts nothing.
        labels += [nxt if trained else IGNORE_INDEX for nxt, trained in zip(ids[1:], mask[1:])]
        labels.append(IGNORE_INDEX)
    pad = seq_len - len(input_ids)
    # Padding is a pseudo-document of its own (positions restart at 0), so real tokens never attend to it.
    input_ids += [pad_id] * pad
    position_ids += range(pad)
    labels += [IGNORE_INDEX] * pad
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
