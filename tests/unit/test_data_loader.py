"""The loader's order is global: independent of the number of ranks, reproducible, and resumable exactly."""

import torch

from moetune.data import IGNORE_INDEX, PackedLoader, eval_batches

SEQ = 4


def make_packs(n):
    # Each pack is identifiable by its first token.
    return [{"input_ids": [i] * SEQ, "labels": [i] * SEQ, "position_ids": list(range(SEQ))} for i in range(n)]


def ids(batch):
    return batch["input_ids"][:, 0].tolist()


def test_batch_shapes_and_dtype():
    batch = PackedLoader(make_packs(10), 3, 0, 1, seed=0).next_batch()
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    for t in batch.values():
        assert t.shape == (3, SEQ) and t.dtype == torch.long


def test_one_rank_with_micro_batch_2_sees_what_two_ranks_with_micro_batch_1_see():
    packs = make_packs(23)
    single = PackedLoader(packs, 2, 0, 1, seed=5)
    r0, r1 = PackedLoader(packs, 1, 0, 2, seed=5), PackedLoader(packs, 1, 1, 2, seed=5)
    for _ in range(30):  # several epochs' worth
        assert ids(single.next_batch()) == ids(r0.next_batch()) + ids(r1.next_batch())


def test_an_epoch_is_a_permutation_without_the_incomplete_tail():
    packs = make_packs(10)
    loader = PackedLoader(packs, 3, 0, 1, seed=1)
    seen = [i for _ in range(3) for i in ids(loader.next_batch())]
    assert len(set(seen)) == 9  # 3 full micro-batches of 3; the 10th pack waits for another epoch
    assert loader.state_dict() == {"epoch": 0, "offset": 9}
    loader.next_batch()
    assert loader.state_dict()["epoch"] == 1


def test_epochs_reshuffle_deterministically():
    def epochs(seed):
        loader = PackedLoader(make_packs(12), 4, 0, 1, seed=seed)
        return [[i for _ in range(3) for i in ids(loader.next_batch())] for _ in range(3)]

    a, b, other_seed = epochs(0), epochs(0), epochs(1)
    assert a == b  # same seed: same order
    assert a[0] != a[1] and a[1] != a[2]  # a new permutation every epoch
    assert all(sorted(e) == list(range(12)) for e in a)
    assert a != other_seed


def test_no_shuffle_is_the_file_order():
    loader = PackedLoader(make_packs(5), 2, 0, 1, seed=0, shuffle=False)
    assert [ids(loader.next_batch()) for _ in range(3)] == [[0, 1], [2, 3], [0, 1]]


def test_state_dict_resumes_the_exact_same_batches():
    packs = make_packs(17)
    loader = PackedLoader(packs, 2, 1, 2, seed=3)
    for _ in range(6):  # past the first epoch boundary (17 // 4 = 4 batches per epoch)
        loader.next_batch()
    state = loader.state_dict()
    expected = [ids(loader.next_batch()) for _ in range(8)]

    resumed = PackedLoader(packs, 2, 1, 2, seed=3)
    resumed.load_state_dict(state)
    assert [ids(resumed.next_batch()) for _ in range(8)] == expected


def test_fewer_packs_than_a_global_batch_repeat_to_fill_it():
    # 4 ranks x micro-batch 2 = 8 packs per global micro-batch, from only 3 packs.
    everyone = sum((ids(PackedLoader(make_packs(3), 2, r, 4, seed=0).next_batch()) for r in range(4)), [])
    assert len(everyone) == 8
    assert sorted(set(everyone)) == [0, 1, 2] and min(everyone.count(i) for i in range(3)) >= 2


def test_eval_batches_cover_everything_once_with_equal_counts_per_rank():
    packs = make_packs(7)
    per_rank = [eval_batches(packs, 2, r, 2) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == 2  # ceil(7 / 4): the same count on every rank
    real = []
    for step in range(2):
        for r in range(2):
            b = per_rank[r][step]
            assert b["input_ids"].shape == (2, SEQ)
            for row in range(2):
                if (b["labels"][row] != IGNORE_INDEX).any():
                    real.append(b["input_ids"][row, 0].item())
    assert real == list(range(7))  # in order, each once; the filler row has only ignored labels


def test_eval_batches_on_more_ranks_than_packs():
    per_rank = [eval_batches(make_packs(1), 1, r, 3) for r in range(3)]
    assert [len(b) for b in per_rank] == [1, 1, 1]
    assert (per_rank[2][0]["labels"] == IGNORE_INDEX).all()
