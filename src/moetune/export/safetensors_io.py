"""Streaming safetensors: read one tensor (or a run of leading rows) with plain file reads, and write sharded
files tensor by tensor from a plan made up front.

Why not `safetensors.safe_open` / `save_file`: safe_open memory-maps whole files, and every page a merge touches
stays resident in the process (RSS grows to the checkpoint's size over a full pass); save_file needs every tensor
of a shard in memory at once. A safetensors file is an 8-byte little-endian header length, a JSON header of
{name: {dtype, shape, data_offsets}}, then the raw bytes, so with shapes known beforehand both sides stream.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from dataclasses import dataclass

import torch

from moetune.errors import CheckpointError

log = logging.getLogger("moetune")

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
NAMES = {v: k for k, v in DTYPES.items()}


@dataclass
class Entry:
    file: str
    dtype: torch.dtype
    shape: tuple
    start: int  # absolute byte offset in the file
    end: int


def read_header(path: str) -> tuple[dict, dict]:
    """({name: Entry}, __metadata__) of one safetensors file. A file that is not one, or that is shorter than its
    header says (a copy cut short), is a CheckpointError naming it: its tensors would read as zeros."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"a header of {n} bytes in a file of {size}")
            header = json.loads(f.read(n))
        meta = header.pop("__metadata__", {}) or {}
        base = 8 + n
        entries = {}
        for name, h in header.items():
            s, e = h["data_offsets"]
            entries[name] = Entry(path, DTYPES.get(h["dtype"]), tuple(h["shape"]), base + s, base + e)
    except (struct.error, ValueError, TypeError, KeyError, AttributeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e}); re-download or re-save it") from None
    for name, ent in entries.items():
        if ent.dtype is None:
            raise CheckpointError(f"{path}: tensor {name} has dtype {header[name]['dtype']}, which this reader does "
                                  "not handle")
    if (end := max((ent.end for ent in entries.values()), default=base)) > size:
        raise CheckpointError(f"{path}: truncated ({size} bytes, its header needs {end}); re-download or re-save it")
    return entries, meta


class Reader:
    """The tensors of a checkpoint directory (sharded with an index, or bare *.safetensors files)."""

    def __init__(self, path: str):
        from moetune.model.hf_io import shard_files

        self.path = path
        self.entries: dict[str, Entry] = {}
        for name in shard_files(path):
            self.entries.update(read_header(os.path.join(path, name))[0])

    def __contains__(self, name):
        return name in self.entries

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """The tensor `name`, or only rows[start:stop] of its leading dimension (contiguous on disk)."""
        e = self.entries[name]
        shape = list(e.shape)
        start, end = e.start, e.end
        if rows is not None:
            row_bytes = (end - start) // max(shape[0], 1)
            r0, r1, _ = rows.indices(shape[0])
            start, end, shape[0] = start + r0 * row_bytes, start + r1 * row_bytes, r1 - r0
        buf = bytearray(end - start)
        with open(e.file, "rb") as f:
            f.seek(start)
            got = f.readinto(buf)
        if got != len(buf):  # shortened since its header was read
            raise CheckpointError(f"{e.file}: truncated: tensor {name} reads {got} of {len(buf)} bytes")
        if not buf:
            return torch.empty(shape, dtype=e.dtype)
        return torch.frombuffer(buf, dtype=e.dtype).reshape(shape)


def _nbytes(shape, dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


class ShardedWriter:
    """Write tensors, announced up front as (name, shape, dtype) in order, into files of at most `max_shard_bytes`
    (a tensor larger than that gets a file of its own), then `model.safetensors.index.json` (HF's layout; a single
    file is named model.safetensors). `write` must be called in the announced order."""

    def __init__(self, out_dir: str, plan: list[tuple[str, tuple, torch.dtype]], max_shard_bytes: float):
        self.out_dir = out_dir
        shards: list[list[tuple[str, tuple, torch.dtype]]] = [[]]
        size = 0
        for item in plan:
            b = _nbytes(item[1], item[2])
            if shards[-1] and size + b > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(item)
            size += b
        n = len(shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.shards = list(zip(names, shards))
        self.order = [item[0] for item in plan]
        self.expect = {item[0]: (tuple(item[1]), item[2]) for item in plan}
        self.total = sum(_nbytes(s, d) for _, s, d in plan)
        self._pos = 0
        self._shard = -1
        self._left_in_shard = 0
        self._f = None

    def _open_next(self):
        self._close()
        self._shard += 1
        fname, items = self.shards[self._shard]
        header, off = {}, 0
        for name, shape, dtype in items:
            b = _nbytes(shape, dtype)
            header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [off, off + b]}
            off += b
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
        # written under a temporary name: a crashed export never leaves a complete-looking shard behind
        self._f = open(os.path.join(self.out_dir, fname + ".tmp"), "wb")
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._left_in_shard = len(items)

    def _close(self):
        if self._f is not None:
            path = self._f.name
            self._f.close()
            os.replace(path, path[: -len(".tmp")])
            self._f = None
            # a merged export of a large model writes for minutes: say where it is
            log.info("export: %s written (%d/%d)", os.path.basename(path[: -len(".tmp")]), self._shard + 1,
                     len(self.shards))

    def write(self, name: str, t: torch.Tensor) -> None:
        if self._pos >= len(self.order) or self.order[self._pos] != name:
            raise RuntimeError(f"ShardedWriter: got {name}, expected {self.order[self._pos] if self._pos < len(self.order) else 'nothing'}")
        shape, dtype = self.expect[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise RuntimeError(f"ShardedWriter: {name} is {list(t.shape)} {t.dtype}, planned {list(shape)} {dtype}")
        if self._left_in_shard == 0:
            self._open_next()
        t = t.contiguous()
        if t.numel():
            self._f.write(t.reshape(-1).view(torch.uint8).numpy().data)
        self._left_in_shard -= 1
        self._pos += 1

    def finish(self) -> dict:
        if self._pos != len(self.order):
            raise RuntimeError(f"ShardedWriter: {len(self.order) - self._pos} planned tensors were never written")
        self._close()
        weight_map = {name: fname for fname, items in self.shards for name, _, _ in items}
        if len(self.shards) > 1:
            with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f, indent=2)
        return weight_map
