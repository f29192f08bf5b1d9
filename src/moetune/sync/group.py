"""The sync group: the trainer's sending rank (rank 0) and every inference worker, joined through a TCP rendezvous of
their own.

It is a bare c10d backend (ProcessGroupNCCL on GPU, ProcessGroupGloo on CPU) built on its own TCPStore, not a group
of torch.distributed's default world: the trainer's world and the inference engine's (vLLM's tensor-parallel
groups) are other worlds, and a process can belong to one default world only. Every member calls `connect` with
the same address and world size; rank 0 hosts the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from moetune.sync.wire import decode_header


def parse_address(address: str) -> tuple[str, int]:
    """"tcp://host:port" or "host:port" -> (host, port)."""
    rest = address.removeprefix("tcp://")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"weight sync address {address!r}: expected tcp://host:port")
    return host.strip("[]"), int(port)


@dataclass
class SyncGroup:
    backend: object  # a c10d Backend: broadcast(tensor, root) -> Work
    rank: int
    size: int
    device: torch.device
    store: object = None  # the rendezvous store; rank 0's process serves it for as long as the group lives

    def broadcast(self, t: torch.Tensor):
        """Broadcast from rank 0, asynchronously: returns the Work (wait() before reading or reusing `t`; on CUDA
        wait() orders the current stream after the transfer without blocking the host)."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        return self.backend.broadcast([t], opts)

    def send_header(self, data: torch.Tensor) -> None:
        """data: the header as encode_header made it (the sender counts its bytes among its allocations)."""
        self.broadcast(torch.tensor([data.numel()], dtype=torch.int64, device=self.device)).wait()
        self.broadcast(data).wait()

    def recv_header(self) -> dict:
        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.broadcast(n).wait()
        data = torch.empty(int(n.item()), dtype=torch.uint8, device=self.device)
        self.broadcast(data).wait()
        return decode_header(data)

    def close(self) -> None:
        shutdown = getattr(self.backend, "shutdown", None)
        if shutdown is not None:
            shutdown()


def connect(address: str, rank: int, world_size: int, device=None, timeout_s: float = 1800.0) -> SyncGroup:
    """Join the sync group at `address` as `rank` of `world_size` (rank 0: the sender, which hosts the rendezvous).

    device: where wire buffers live; a CUDA device selects NCCL, the CPU gloo. Default: the current CUDA device if
    there is one, else the CPU. Blocks until all `world_size` members have joined."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    host, port = parse_address(address)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    store = dist.PrefixStore("moetune-weight-sync", store)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        # the transfer is the critical path: its kernels take SMs ahead of the packing/loading kernels beside them
        opts.is_high_priority_stream = True
        backend = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    else:
        backend = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    return SyncGroup(backend, rank, world_size, device, store)
