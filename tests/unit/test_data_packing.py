"""Packing: documents share rows without leaking into each other; labels are pre-shifted and masked."""

import pytest

from moetune.data import DataError, pack_documents

PAD = 0


def doc(ids, trained=None):
    return list(ids), [True] * len(ids) if trained is None else list(trained)


def documents_of(pack):
    """Split a pack back into its documents using position ids == 0 as the only boundary signal."""
    starts = [t for t, p in enumerate(pack["position_ids"]) if p == 0] + [len(pack["position_ids"])]
    return [(a, b) for a, b in zip(starts, starts[1:])]


def test_position_ids_restart_at_each_document_and_padding_is_its_own_document():
    packs, stats = pack_documents([doc([11, 12, 13]), doc([21, 22])], seq_len=8, pad_id=PAD)
    assert len(packs) == 1 and stats["packs"] == 1
    p = packs[0]
    assert p["input_ids"] == [11, 12, 13, 21, 22, PAD, PAD, PAD]
    assert p["position_ids"] == [0, 1, 2, 0, 1, 0, 1, 2]
    assert documents_of(p) == [(0, 3), (3, 5), (5, 8)]


def test_labels_are_shifted_and_never_cross_a_document_boundary():
    packs, _ = pack_documents([doc([11, 12, 13]), doc([21, 22])], seq_len=8, pad_id=PAD)
    # t=2 is the last token of doc 1: it must not predict 21 (the next document's first token).
    assert packs[0]["labels"] == [12, 13, -100, 22, -100, -100, -100, -100]


def test_untrained_tokens_are_not_targets():
    packs, stats = pack_documents([doc([1, 2, 3, 4, 5], [False, False, True, True, False])], seq_len=6, pad_id=PAD)
    assert packs[0]["labels"] == [-100, 3, 4, -100, -100, -100]
    assert stats["targets"] == 2 and stats["tokens"] == 5


def test_every_row_has_exactly_seq_len_tokens_and_padding_is_never_a_target():
    docs = [doc(range(1, n + 1)) for n in (5, 3, 7, 2, 8, 2, 4)]
    packs, stats = pack_documents(docs, seq_len=8, pad_id=PAD)
    for p in packs:
        assert len(p["input_ids"]) == len(p["labels"]) == len(p["position_ids"]) == 8
        for (a, b) in documents_of(p):
            if all(t == PAD for t in p["input_ids"][a:b]):
                assert p["labels"][a:b] == [-100] * (b - a)
    assert stats["documents"] == len(docs)
    assert stats["tokens"] == sum(len(d[0]) for d in docs)


def test_first_fit_in_order_is_deterministic():
    # lengths 5, 4, 3, 2 into rows of 8: 5 -> row0, 4 -> row1, 3 -> row0 (fits: 5+3), 2 -> row1.
    docs = [doc([n] * n) for n in (5, 4, 3, 2)]
    packs, _ = pack_documents(docs, seq_len=8, pad_id=PAD)
    assert [p["input_ids"] for p in packs] == [[5] * 5 + [3] * 3, [4] * 4 + [2] * 2 + [PAD] * 2]
    assert pack_documents(docs, seq_len=8, pad_id=PAD)[0] == packs


def test_pack_false_puts_one_document_per_row():
    packs, stats = pack_documents([doc([1, 2]), doc([3, 4])], seq_len=8, pad_id=PAD, pack=False)
    assert [p["input_ids"][:3] for p in packs] == [[1, 2, PAD], [3, 4, PAD]]
    assert stats["packs"] == 2


def test_too_long_and_targetless_documents_are_dropped_and_counted():
    docs = [doc([1] * 9), doc([1] * 8), doc([1, 2, 3], [True, False, False]), doc([7])]
    packs, stats = pack_documents(docs, seq_len=8, pad_id=PAD)
    assert stats["dropped_too_long"] == 1  # 9 > 8; exactly 8 still fits
    assert stats["dropped_no_targets"] == 2  # token 0 alone can never be a target
    assert stats["documents"] == 1 and stats["packs"] == 1


def test_empty_dataset_is_a_clear_error():
    with pytest.raises(DataError, match="empty"):
        pack_documents([], seq_len=8, pad_id=PAD)


def test_all_samples_too_long_names_seq_len_and_the_longest():
    with pytest.raises(DataError, match=r"every sample is longer than seq_len=8 \(the longest has 12 tokens\)"):
        pack_documents([doc([1] * 10), doc([1] * 12)], seq_len=8, pad_id=PAD)


def test_nothing_trainable_left_explains_why():
    with pytest.raises(DataError, match="1 longer than seq_len=4.*1 without any trained token"):
        pack_documents([doc([1] * 10), doc([1, 2], [True, False])], seq_len=4, pad_id=PAD)


def test_many_documents_pack_fast_and_tightly():
    import random

    rng = random.Random(0)
    docs = [doc([1] * rng.randint(2, 64)) for _ in range(20000)]
    packs, stats = pack_documents(docs, seq_len=256, pad_id=PAD)
    # First fit wastes little: fewer than 3% more rows than the token count strictly needs.
    assert len(packs) < 1.03 * stats["tokens"] / 256
