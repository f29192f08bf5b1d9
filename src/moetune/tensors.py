"""The piece of a tensor this process holds: plain tensors and DTensors (FSDP2/EP shards) alike, in one place."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def is_dtensor(t) -> bool:
    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_index(t: torch.Tensor) -> tuple[tuple[slice, ...], torch.Size]:
    """(slices of the global tensor this rank holds, global shape)."""
    offset, shape = local_box(t)
    return tuple(slice(o, o + s) for o, s in zip(offset, shape)), t.shape


def local_box(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offset, local shape) of the piece of t this rank holds."""
    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return tuple(offset), tuple(shape)
    return (0,) * t.dim(), tuple(t.shape)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor; for a DTensor a collective (every rank of its mesh must call it, in the same order)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def all_finite(tensors) -> torch.Tensor:
    """One boolean scalar on the tensors' device: every element of every tensor (local shards) is finite. One fused
    max-abs reduction per dtype and device (torch._foreach_norm with ord inf, which propagates NaN), no host sync
    and no copy; large finite values do not overflow it as a 2-norm would."""
    tensors = [local_tensor(t).detach() for t in tensors]
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.tensor(True)
    by_group: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_group.setdefault((t.device, t.dtype), []).append(t)
    device = tensors[0].device
    peaks = [torch.stack(torch._foreach_norm(group, float("inf"))).float().amax().to(device) for group in by_group.values()]
    return torch.isfinite(torch.stack(peaks).amax())
