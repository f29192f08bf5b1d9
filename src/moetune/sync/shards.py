"""Assembling row ranges of (possibly sharded) parameters on the sending rank.

FSDP2 and EP keep a parameter as a DTensor whose pieces sit on several ranks of the training group. To stream a row
range (some rows of an embedding, a run of stacked experts) the sending rank needs only the pieces that overlap it:
their owners send exactly those rows, point to point in the training group, and no other rank does anything or
allocates anything. Which rank holds which box of which parameter is read from each DTensor's placements (any mix of
Shard and Replicate over any mesh: FSDP's Shard(0), EP's Shard(0) on experts, both at once) and exchanged once per
sync. A piece held by several ranks (replicas) is taken from the sender itself when it holds it, else from the
lowest rank that does. Every rank of the training group runs the same sequence of `gather` calls (the plan is a
function of names and shapes), so sends and receives pair up in order.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from moetune.model.quant.fp8 import dequantize_
from moetune.sync.alloc import Allocations
from moetune.tensors import local_box, local_tensor  # noqa: F401  (re-exported)


class ShardMap:
    """Where every piece of `tensors` lives across the training group. Collective: every rank constructs it."""

    def __init__(self, tensors: dict[str, torch.Tensor], group=None, root: int = 0, device=None,
                 mem: Allocations | None = None, fp8: dict | None = None):
        """`fp8`: {fp8 weight: (its scale's name, Fp8Scheme)} of an fp8 base, whose rows are gathered dequantised."""
        self.tensors, self.group, self.root = tensors, group, root
        self.fp8 = fp8 or {}
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.device = torch.device(device) if device is not None else None
        self.mem = mem or Allocations()
        mine = {name: local_box(t) for name, t in tensors.items()}
        everyone = [mine]
        if self.world > 1:
            everyone = [None] * self.world
            dist.all_gather_object(everyone, mine, group=group)
        self.boxes = {name: [everyone[r][name] for r in range(self.world)] for name in tensors}

    @property
    def is_root(self) -> bool:
        return self.rank == self.root

    def pieces(self, name: str, lo: int, hi: int) -> list[tuple[int, tuple[slice, ...]]]:
        """[(rank, global index)] of the pieces that cover rows lo:hi of `name` exactly once."""
        chosen: dict = {}
        for r, (off, size) in enumerate(self.boxes[name]):
            if 0 in size or max(lo, off[0]) >= min(hi, off[0] + size[0]):
                continue
            if (off, size) not in chosen or r == self.root:  # replicas: the sender's own, else the lowest rank's
                chosen[(off, size)] = r
        out = []
        for (off, size), r in chosen.items():
            rows = slice(max(lo, off[0]), min(hi, off[0] + size[0]))
            out.append((r, (rows,) + tuple(slice(o, o + s) for o, s in zip(off[1:], size[1:]))))
        shape = self.tensors[name].shape
        covered = sum(math.prod(s.stop - s.start for s in idx) for _, idx in out)
        if covered != (hi - lo) * math.prod(shape[1:]):
            raise ValueError(f"{name}: the pieces of rows {lo}:{hi} held across the training group cover {covered} "
                             f"of {(hi - lo) * math.prod(shape[1:])} elements; only Shard and Replicate placements "
                             "(each rank a box of the tensor) are supported")
        return out

    def _local_part(self, name: str, idx) -> torch.Tensor:
        off = self.boxes[name][self.rank][0]
        return local_tensor(self.tensors[name])[tuple(slice(s.start - o, s.stop - o) for s, o in zip(idx, off))]

    def gather(self, name: str, lo: int, hi: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Rows lo:hi of `name`, whole, on the sending rank (None elsewhere). Into `out` when given (cast to its
        dtype), else a view of the sender's own shard when that holds them all, else a new buffer (counted). An fp8
        weight's rows come dequantised (fp32) with its scales' rows: the wire carries the weights the model computes
        with."""
        if name in self.fp8:
            return self._gather_dequantised(name, lo, hi, out)
        return self._gather(name, lo, hi, out)

    def _gather_dequantised(self, name: str, lo: int, hi: int, out: torch.Tensor | None) -> torch.Tensor | None:
        """The fp8 rows, then their fp32 values in one counted buffer (`out` itself when it is fp32): the scales
        multiply it in place (fp8.dequantize_), so nothing else the size of the rows is allocated."""
        scale_name, scheme = self.fp8[name]
        q = self._gather(name, lo, hi)
        block_rows = scheme.block is not None and self.tensors[name].dim() == 2  # an expert stack's rows are experts
        b0 = scheme.block[0] if block_rows else 1
        s = self._gather(scale_name, lo // b0, -(-hi // b0))  # the block rows covering lo:hi
        if q is None:
            return None
        w = out if out is not None and out.dtype == torch.float32 else self.mem.empty(q.shape, torch.float32, q.device)
        dequantize_(w.copy_(q), s, scheme, lo - lo // b0 * b0)
        if out is None or w is out:
            return w
        out.copy_(w)
        return out

    def _gather(self, name: str, lo: int, hi: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
        pieces = self.pieces(name, lo, hi)
        if not self.is_root:
            for r, idx in pieces:
                if r == self.rank:  # owner of a piece: the only rank besides the sender that takes part
                    piece = self._local_part(name, idx).to(self.device).contiguous()
                    dist.send(piece, group_dst=self.root, group=self.group)
            return None
        native = local_tensor(self.tensors[name])
        if out is None and len(pieces) == 1 and pieces[0][0] == self.rank and native.device == self.device:
            return self._local_part(name, pieces[0][1])
        if out is None:
            out = self.mem.empty((hi - lo, *self.tensors[name].shape[1:]), native.dtype, self.device)
        for r, idx in pieces:
            dst = out[(slice(idx[0].start - lo, idx[0].stop - lo),) + idx[1:]]
            if r == self.rank:
                dst.copy_(self._local_part(name, idx))
            elif dst.is_contiguous() and dst.dtype == native.dtype:
                dist.recv(dst, group_src=r, group=self.group)
            else:
                tmp = self.mem.empty(dst.shape, native.dtype, self.device)
                dist.recv(tmp, group_src=r, group=self.group)
                dst.copy_(tmp)
        return out
