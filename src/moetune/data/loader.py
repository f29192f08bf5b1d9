"""Serving packs to data-parallel ranks, resumably.

The order is global and depends only on (seed, epoch), never on the number of ranks: the k-th call on every rank
takes the k-th *global* micro-batch (the next ``dp_world * micro_batch_size`` packs) and rank r keeps its slice. So
1 rank with micro-batch 2 trains on exactly the packs that 2 ranks with micro-batch 1 see together, and a run
resumed from a checkpoint continues with exactly the batches it would have seen.
"""

from __future__ import annotations

import hashlib

import torch

from moetune.names import IGNORE_INDEX

FIELDS = ("input_ids", "labels", "position_ids")


class PackedLoader:
    """Endless iterator of micro-batches ``{"input_ids", "labels", "position_ids"}``, each ``[micro_batch_size, seq_len]``."""

    def __init__(
        self, packs: list[dict], micro_batch_size: int, dp_rank: int, dp_world: int, seed: int, shuffle: bool = True
    ):
        if not packs:
            raise ValueError("PackedLoader needs at least one pack")
        if micro_batch_size < 1 or not 0 <= dp_rank < dp_world:
            raise ValueError(f"bad micro_batch_size={micro_batch_size} / dp_rank={dp_rank} / dp_world={dp_world}")
        self.packs = packs
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.seed, self.shuffle = seed, shuffle
        self.global_batch = micro_batch_size * dp_world
        self.epoch, self.offset = 0, 0  # offset counts packs of this epoch's order already served (all ranks)
        self._order_epoch, self._order = None, None

    @property
    def batches_per_epoch(self) -> int:
        # The tail that does not fill a whole global micro-batch is dropped for the epoch (a micro-batch never
        # straddles two epochs); with fewer packs than one global micro-batch, packs repeat to fill exactly one.
        return max(1, len(self.packs) // self.global_batch)

    def next_batch(self) -> dict[str, torch.Tensor]:
        if self.offset + self.global_batch > self.batches_per_epoch * self.global_batch:
            self.epoch, self.offset = self.epoch + 1, 0
        order = self._epoch_order(self.epoch)
        start = self.offset + self.dp_rank * self.micro_batch_size
        rows = [self.packs[i] for i in order[start : start + self.micro_batch_size]]
        self.offset += self.global_batch
        return collate(rows)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, sd: dict) -> None:
        # Stored in packs, not batches, so that the position still means the same data if the number of ranks or
        # the micro-batch size changes on resume.
        self.epoch, self.offset = int(sd["epoch"]), int(sd["offset"])

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            n = len(self.packs)
            if self.shuffle:
                order = torch.randperm(n, generator=_generator(self.seed, epoch)).tolist()
            else:
                order = list(range(n))
            while len(order) < self.global_batch:
                order += order[: self.global_batch - len(order)]
            self._order_epoch, self._order = epoch, order
        return self._order


def _generator(seed: int, epoch: int) -> torch.Generator:
    # Hash (seed, epoch) into one 63-bit seed: distinct pairs never collide the way seed + epoch would.
    digest = hashlib.sha256(f"moetune-data:{seed}:{epoch}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def eval_batches(packs: list[dict], micro_batch_size: int, dp_rank: int, dp_world: int) -> list[dict]:
    """The whole eval set in order, split across ranks like training batches.

    Every rank gets the same number of batches, the last global batch filled up with rows whose labels are all
    ignored: under FSDP every rank must enter every forward, or the collectives hang.
    """
    global_batch = micro_batch_size * dp_world
    batches = []
    for first in range(0, len(packs), global_batch):
        rows = packs[first : first + global_batch]
        rows = rows + [_ignored_row(packs[0])] * (global_batch - len(rows))
        start = dp_rank * micro_batch_size
        batches.append(collate(rows[start : start + micro_batch_size]))
    return batches


def _ignored_row(pack: dict) -> dict:
    # A real pack's ids and positions (valid inputs for the model) with nothing to predict.
    return {**pack, "labels": [IGNORE_INDEX] * len(pack["labels"])}


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor([r[k] for r in rows], dtype=torch.long) for k in FIELDS}
