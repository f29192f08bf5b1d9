"""The sync group: the trainer's sending rank (rank 0) and every inference worker, joined through a TCP rendezvous of
their own.

It is a bare c10d backend (ProcessGroupNCCL on GPU, ProcessGroupGloo on CPU) built on its own TCPStore, not a group
of torch.distributed's default world: the trainer's world and the inference engine's (vLLM's tensor-parallel
groups) are other worlds, and a process can belong to one default world only. Every member calls `connect` with
the same address and world size; rank 0 hosts the store.

No wait is unbounded: every broadcast is watched against a deadline that scales with its bytes (`deadline`), and a
member that misses one is named (each member writes who it is into the store when it joins). The store also carries
the receivers' answers that the bytes alone cannot (sender.py, receiver.py): "I take this header" (or why not)
before any weight moves, and "I have it all" at the end.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from moetune.errors import MoetuneError
from moetune.sync.wire import decode_header

DEADLINE_S = 120.0  # the fixed part of every wait: a receiver's engine may take that long to call in
MIN_BYTES_PER_S = 100e6  # the slowest link a sync expects (gloo over TCP runs at ~1 GB/s, NVLink at ~100s of GB/s)
_POLL_S = 0.002


class SyncError(MoetuneError):
    """A weight sync that cannot go on: a member refused it or stopped answering."""


class SyncRefused(SyncError):
    """A receiver refused the sync's header (its model differs): no weight was sent."""


class SyncTimeout(SyncError):
    """A member of the sync group did not answer within the sync's deadline."""


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
    deadline_s: float = DEADLINE_S
    min_bytes_per_s: float = MIN_BYTES_PER_S
    syncs: int = 0  # syncs begun: every member counts alike, so store keys of one sync are `s{syncs}/...`

    def deadline(self, nbytes: int) -> float:
        """Seconds a transfer of nbytes may take before its peer counts as gone."""
        return self.deadline_s + nbytes / self.min_bytes_per_s

    def member(self, rank: int) -> str:
        """Who a rank is, as it wrote when it joined."""
        try:
            if self.store.check([f"member/{rank}"]):
                return self.store.get(f"member/{rank}").decode()
        except Exception:  # noqa: BLE001 - the store's host may be the one that is gone
            pass
        return f"rank {rank} of the sync group"

    def wait(self, work, nbytes: int, what: str, peers=None) -> None:
        """work.wait(), bounded by deadline(nbytes); past it, SyncTimeout naming `peers` (default: the other
        members) and what was being waited for."""
        limit = self.deadline(nbytes)
        end = time.monotonic() + limit
        while not work.is_completed():
            if time.monotonic() > end:
                raise self.timeout(peers, what, limit, nbytes)
            time.sleep(_POLL_S)
        work.wait()  # completed: surfaces the collective's own error, if it failed

    def timeout(self, peers, what: str, limit: float, nbytes: int) -> SyncTimeout:
        peers = [r for r in range(self.size) if r != self.rank] if peers is None else peers
        who = "; ".join(self.member(r) for r in peers)
        return SyncTimeout(f"weight sync {self.syncs}: {who} did not answer within {limit:.0f} s ({what}; "
                           f"{nbytes / 1e6:.1f} MB at a deadline of {self.deadline_s:.0f} s + 1 s per "
                           f"{self.min_bytes_per_s / 1e6:.0f} MB). Is it still running? The sync group is unusable "
                           "now: connect again")

    def post(self, key: str, value: str) -> None:
        """Post this member's `key` for the current sync (read by `collect`)."""
        self.store.set(f"s{self.syncs}/{key}/{self.rank}", value)

    def collect(self, key: str, ranks, nbytes: int, what: str) -> dict[int, str]:
        """{rank: value} of `key` posted by each of `ranks` for this sync, waiting up to deadline(nbytes)."""
        keys = {r: f"s{self.syncs}/{key}/{r}" for r in ranks}
        limit = self.deadline(nbytes)
        end = time.monotonic() + limit
        while True:
            missing = [r for r, k in keys.items() if not self.store.check([k])]
            if not missing:
                return {r: self.store.get(k).decode() for r, k in keys.items()}
            if time.monotonic() > end:
                raise self.timeout(missing, what, limit, nbytes)
            time.sleep(_POLL_S * 5)

    def broadcast(self, t: torch.Tensor):
        """Broadcast from rank 0, asynchronously: returns the Work (wait() before reading or reusing `t`; on CUDA
        wait() orders the current stream after the transfer without blocking the host)."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        return self.backend.broadcast([t], opts)

    def send_header(self, data: torch.Tensor) -> None:
        """data: the header as encode_header made it (the sender counts its bytes among its allocations)."""
        self.wait(self.broadcast(torch.tensor([data.numel()], dtype=torch.int64, device=self.device)), 8,
                  "taking the header")
        self.wait(self.broadcast(data), data.numel(), "taking the header")

    def recv_header(self) -> dict:
        """Wait for the next sync: as long as the group's timeout (the trainer decides when it syncs), then bounded."""
        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.broadcast(n).wait()
        data = torch.empty(int(n.item()), dtype=torch.uint8, device=self.device)
        self.wait(self.broadcast(data), data.numel(), "sending the header", peers=[0])
        return decode_header(data)

    def close(self) -> None:
        shutdown = getattr(self.backend, "shutdown", None)
        if shutdown is not None:
            shutdown()


def host_store(address: str, world_size: int, timeout_s: float = 1800.0):
    """The rendezvous store, served by rank 0 before the others know where: port 0 in `address` takes a free port
    from the OS (race-free, unlike probing for one); `.port` is the one to hand to the members. Pass it to
    connect(store=...)."""
    host, port = parse_address(address)
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def connect(address: str, rank: int, world_size: int, device=None, timeout_s: float = 1800.0, name: str | None = None,
            deadline_s: float = DEADLINE_S, min_bytes_per_s: float = MIN_BYTES_PER_S, store=None) -> SyncGroup:
    """Join the sync group at `address` as `rank` of `world_size` (rank 0: the sender, which hosts the rendezvous).

    device: where wire buffers live; a CUDA device selects NCCL, the CPU gloo. Default: the current CUDA device if
    there is one, else the CPU. Blocks until all `world_size` members have joined (timeout_s). name: what the other
    members call this one when it stops answering (default "the trainer" for rank 0, "receiver R" otherwise; host
    and pid are added). deadline_s, min_bytes_per_s: a sync's waits last at most deadline_s + bytes/min_bytes_per_s.
    store: rank 0's store from host_store (else rank 0 serves one at `address`)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    host, port = parse_address(address)
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    store = dist.PrefixStore("moetune-weight-sync", store)
    name = name or ("the trainer" if rank == 0 else f"receiver {rank}")
    store.set(f"member/{rank}", f"{name} (sync rank {rank}, host {socket.gethostname()}, pid {os.getpid()})")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        # the transfer is the critical path: its kernels take SMs ahead of the packing/loading kernels beside them
        opts.is_high_priority_stream = True
        backend = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    else:
        backend = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    return SyncGroup(backend, rank, world_size, device, store, deadline_s, min_bytes_per_s)
