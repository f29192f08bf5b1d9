"""Process groups: the launcher's environment, and init_distributed, which creates the process group and the
layout's mesh (Layout.build_mesh). The shape itself — sizes, dimension names, FSDP — is the Layout's (layout.py);
nothing here re-derives it.

Launch is whatever sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT (torchrun, accelerate, srun): we never
start processes ourselves. NCCL on GPU, gloo on CPU. One process without a launcher has no process group, unless its
layout runs FSDP (CPU offload on one GPU): then it is a group of itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    """This process's place in the run: its rank, its device and the layout's mesh (None without a process group)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    mesh: object | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def initialized(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    # Expert parallelism does not take ranks from data parallelism: every rank reads its own batches (the
    # experts' gradients are still a mean over all ranks: apply_fsdp sets their divide factor to the world).
    @property
    def dp_rank(self) -> int:
        return self.rank

    @property
    def dp_size(self) -> int:
        return self.world_size

    def barrier(self):
        if self.initialized:
            dist.barrier()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.initialized and self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t


def _srun_env():
    """srun sets SLURM_* but not torch's variables; map them so `srun moetune train` works like torchrun."""
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ and "MASTER_ADDR" in os.environ:
        os.environ.setdefault("RANK", os.environ["SLURM_PROCID"])
        os.environ.setdefault("WORLD_SIZE", os.environ["SLURM_NTASKS"])
        os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))


def launch_world_size() -> int:
    """The number of processes the launcher started (1 without one), before any process group exists."""
    _srun_env()
    return int(os.environ.get("WORLD_SIZE", 1)) if "RANK" in os.environ else 1


def launch_gpus_per_node() -> int | None:
    """Processes per node as the launcher says (torchrun: LOCAL_WORLD_SIZE; srun: SLURM_NTASKS_PER_NODE)."""
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(key, "").split("(")[0]  # SLURM writes "8(x2)" for heterogeneous counts
        if value.isdigit():
            return int(value)
    return None


def cap_allocator(memory, device: torch.device) -> None:
    """Hold the CUDA caching allocator to `parallel.gpu_memory_gib` (`memory`: Layout.memory, stated by the user) when
    it is below the device's memory: the layout was chosen for a GPU of that size, and a run on a larger one is then
    an honest emulation of it (out of memory where that GPU would be) rather than a run that only fits here."""
    if memory is None or memory.host or not memory.stated:
        return
    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    if memory.gib < total:
        torch.cuda.set_per_process_memory_fraction(memory.gib / total, device)


def init_distributed(layout, device: str | None = None) -> Dist:
    """The process group `layout` (layout.Layout) needs and its mesh; the device of this rank (its GPU, else the
    CPU, or `device`)."""
    _srun_env()
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank, world, local = ((int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
                          if launched else (0, 1, 0))
    if world != layout.world_size:  # the layout is resolved from launch_world_size: a caller's mistake
        raise ValueError(f"the layout is for {layout.world_size} process(es), the launcher started {world}")
    use_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    dev = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
        cap_allocator(layout.memory, dev)
    if not (launched or layout.needs_process_group):
        return Dist(device=dev)
    if not dist.is_initialized():
        # one process without a launcher (FSDP for CPU offload): a group of itself, through an in-process store
        alone = {} if launched else dict(store=dist.HashStore(), rank=0, world_size=1)
        # CPU offload leaves FSDP's sharded parameters and gradients in host memory, and what reduces them across
        # ranks there (the gradient norm, full_tensor in an export) needs a CPU backend beside NCCL (as torchtitan's
        # enable_cpu_backend): NCCL alone refuses CPU tensors
        backend = ("cuda:nccl,cpu:gloo" if layout.cpu_offload else "nccl") if use_cuda else "gloo"
        dist.init_process_group(backend=backend, device_id=dev if use_cuda else None, **alone)
    return Dist(rank, world, local, dev, layout.build_mesh(dev.type))


def shutdown_distributed(finished: bool) -> None:
    """Free the (sharded) model while its process groups still exist, then destroy them. FSDP/DTensor modules
    sit in reference cycles, so without the collect they outlive the groups and gloo aborts at interpreter exit
    ("terminate called without an active exception"), seen with expert parallelism.
    The barrier only after a finished run: a rank that failed alone would wait in it for ranks that wait in the
    collective it left, forever and before its error is printed (NCCL does not time out there) — how a failure on
    2 × H200 looked like a hang. Exiting shows the error and lets the launcher stop the others."""
    import gc

    if dist.is_available() and dist.is_initialized():
        if finished:
            dist.barrier()
        gc.collect()
        dist.destroy_process_group()
