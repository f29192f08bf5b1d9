"""What a training checkpoint may unpickle: the one place that decides it.

DCP pickles its `.metadata` index and torch.save's non-tensor entries. Everything that reads a checkpoint (resume,
export, generate, tests) reads it through CheckpointReader / dcp_load here: the index may name only DCP's own
metadata classes (and the torch and pathlib values they hold) and is checked for shape, an entry may hold only what
torch.load's weights_only allows. A hostile or damaged file is a CheckpointError naming it, never code run or a
traceback.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata

from moetune.errors import CheckpointError

DCP_INDEX = ".metadata"
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_INDEX_GLOBALS = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
                  ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                  ("pathlib", "Path"), ("collections", "OrderedDict")}


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == _DCP_METADATA or (module, name) in _INDEX_GLOBALS:
            obj = super().find_class(module, name)
            if module != _DCP_METADATA or isinstance(obj, type):
                return obj
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not part of a DCP index")


def read_dcp_index(path: str | os.PathLike) -> Metadata:
    """The DCP index (`.metadata`) at ``path``, unpickled with only DCP's classes allowed and checked for shape;
    anything else is a CheckpointError naming the file."""
    try:
        with open(path, "rb") as f:
            md = _IndexUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {Path(path).parent} is incomplete: {Path(path).name} is missing") from None
    except Exception as e:  # noqa: BLE001 - a truncated or hostile pickle raises anything from EOFError to TypeError
        raise CheckpointError(f"checkpoint {Path(path).parent} is damaged: cannot read {path} "
                              f"({type(e).__name__}: {e})") from None
    problem = _index_problem(md)
    if problem:
        raise CheckpointError(f"checkpoint {Path(path).parent} is damaged: {path} {problem}")
    return md


def _index_problem(md) -> str | None:
    if not isinstance(md, Metadata):
        return f"holds a {type(md).__name__}, not a DCP index"
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        return "has no state_dict_metadata or storage_data mapping"
    for key, m in md.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(m, (TensorStorageMetadata, BytesStorageMetadata)):
            return f"describes entry {key!r} as a {type(m).__name__}"
        if isinstance(m, TensorStorageMetadata) and not (
                isinstance(m.size, torch.Size) and all(isinstance(n, int) and n >= 0 for n in m.size)
                and isinstance(getattr(m.properties, "dtype", None), torch.dtype)):
            return f"gives tensor {key} no valid shape and dtype"
    for info in md.storage_data.values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or os.path.basename(rel) != rel or rel in ("", ".", ".."):
            return f"points outside its directory ({rel!r})"  # DCP would read any file it names
        if not all(isinstance(getattr(info, k, None), int) and getattr(info, k) >= 0 for k in ("offset", "length")):
            return f"gives {rel} an offset or length that is not a byte count"
    return None


class CheckpointReader(FileSystemReader):
    """DCP's file reader with the index read by read_dcp_index."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        md = read_dcp_index(os.path.join(self.path, DCP_INDEX if rank is None else f"__{rank}{DCP_INDEX}"))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's planner, with a non-tensor entry read only if torch.load's weights_only allows it (ours are JSON text,
    numbers and lists); DefaultLoadPlanner itself loads them with weights_only=False."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001
            lines = str(e).splitlines() or [type(e).__name__]
            why = next((line.strip() for line in lines if "Unsupported global" in line), lines[0])
            raise CheckpointError(f"entry {read_item.dest_index.fqn} is not plain data ({why})") from None
        value.seek(0)
        super().load_bytes(read_item, value)


def dcp_load(state: dict, path: str | os.PathLike, no_dist: bool = True) -> None:
    """dcp.load of ``state`` in place from the checkpoint at ``path``, through CheckpointReader and _LoadPlanner."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=CheckpointReader(str(path)), planner=_LoadPlanner(), no_dist=no_dist)
    except CheckpointException as e:  # what a rank's reader raised, wrapped: ours is the user's to see
        if isinstance(cause := first_failure(e), CheckpointError):
            raise CheckpointError(f"checkpoint {path} is damaged: {cause}") from None
        raise


def first_failure(e: BaseException) -> BaseException:
    """The first rank's underlying error of a DCP CheckpointException (whose str is every rank's traceback)."""
    failures = getattr(e, "failures", None)
    if failures:
        e = next(iter(failures.values()))
        e = e[0] if isinstance(e, tuple) else e
    return e
