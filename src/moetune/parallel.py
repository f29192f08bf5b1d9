"""Distributed setup and the parallelisms, as plain functions applied in a fixed order (torchtitan's shape):

    init_distributed → build on meta → LoRA → apply_ac → apply_compile → apply_fsdp → materialise → load

Launch is whatever sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT (torchrun, accelerate, srun):
we never start processes ourselves. NCCL on GPU, gloo on CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    mesh: object | None = None  # DeviceMesh ("dp_shard",) or ("dp_shard", "ep"); None without a process group
    ep: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def initialized(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def dp_rank(self) -> int:
        return self.rank // self.ep if self.ep > 1 else self.rank

    @property
    def dp_size(self) -> int:
        return self.world_size // self.ep

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


def init_distributed(ep: int = 1, dp_shard: int = -1, device: str | None = None) -> Dist:
    _srun_env()
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    use_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    if not launched:
        if ep != 1:
            raise ValueError("parallel.ep > 1 needs several processes: launch with torchrun")
        dev = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(dev)
        return Dist(device=dev)
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", device_id=dev if use_cuda else None)
    if dp_shard == -1:
        dp_shard = world // ep
    if dp_shard * ep != world:
        raise ValueError(f"parallel.dp_shard ({dp_shard}) × parallel.ep ({ep}) must equal the world size ({world})")
    from torch.distributed.device_mesh import init_device_mesh

    if ep > 1:
        mesh = init_device_mesh(dev.type, (dp_shard, ep), mesh_dim_names=("dp_shard", "ep"))
    else:
        mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp_shard",))
    return Dist(rank, world, local, dev, mesh, ep)


def apply_ac(model, mode: str) -> None:
    """Activation checkpointing per decoder layer: "full" recomputes the whole layer in backward; "selective"
    keeps the GEMM and attention outputs and recomputes only the cheap elementwise ops."""
    for layer in model.model.layers:
        layer.activation_checkpointing = mode


def apply_compile(model) -> None:
    """torch.compile per decoder layer: one graph per layer type, no recompiles across layers."""
    for layer in model.model.layers:
        layer.compile(dynamic=False)


def apply_fsdp(model, mesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype = torch.float32,
               reshard_after_forward: bool = True, cpu_offload: bool = False) -> None:
    """FSDP2: routed experts in their own unit (their all-gather overlaps the attention), each decoder layer
    a unit, the root last (embeddings, final norm, lm_head). Stacked experts mean every rank gathers the same
    tensors whatever its tokens route to, so uneven routing cannot desynchronise collectives.
    cpu_offload keeps the sharded fp32 master weights, gradients and optimizer state in host memory (FSDP2
    copies each unit to the GPU for its forward/backward); it needs an accelerator."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kw = dict(mp_policy=mp, offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())
    dp_mesh = mesh["dp_shard"] if mesh.mesh_dim_names and len(mesh.mesh_dim_names) > 1 else mesh
    n = len(model.model.layers)
    for i, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            fully_shard(experts, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, **kw)
        # the last layer's parameters are needed again at once by backward: keep them gathered
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard_after_forward and i < n - 1, **kw)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, **kw)
