"""Distributed setup and the parallelisms, as plain functions applied in a fixed order (torchtitan's shape):

    init_distributed → build on meta → LoRA → apply_ep → apply_ac → apply_compile → apply_fsdp → materialise → load

Every rank is a data-parallel rank (its own batches). With parallel.ep > 1 the world is a mesh
("dp_shard", "ep"): the routed experts are split by expert over "ep" and FSDP-sharded over "dp_shard"; all
other parameters are FSDP-sharded over the whole world ("dp", the two dimensions flattened).

Launch is whatever sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT (torchrun, accelerate, srun):
we never start processes ourselves. NCCL on GPU, gloo on CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moetune.ac_modes import layer_modes


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    # DeviceMesh ("dp_shard",), ("dp_replicate", "dp_shard") (HSDP) or ("dp_shard", "ep") (+ flattened "dp");
    # None in a single process without a launcher
    mesh: object | None = None
    ep: int = 1
    dp_shard: int = 1  # FSDP shard size; 1: nothing is FSDP-sharded (replicas all-reduce their gradients)

    @property
    def fsdp(self) -> bool:
        """Whether FSDP2 shards the model. With dp_shard 1 every rank holds the whole model (the routed experts
        still split by expert under EP): no per-layer all-gathers, no parameter copies, one all-reduce of the
        gradients per step (`sync_replicated_grads`) — the fast layout for a LoRA base that fits."""
        return self.dp_shard > 1

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
    # Ranks left over by dp_shard × ep replicate (HSDP): a model that fits on fewer GPUs shards over those and
    # only all-reduces gradients across the replicas — for a frozen LoRA base, next to no communication.
    replicate = world // (dp_shard * ep) if dp_shard * ep <= world else 0
    if replicate * dp_shard * ep != world or (replicate > 1 and ep > 1):
        raise ValueError(f"parallel.dp_shard ({dp_shard}) × parallel.ep ({ep}) must equal the world size ({world}), "
                         "or, without expert parallelism, divide it (the rest replicates)")
    from torch.distributed.device_mesh import init_device_mesh

    if replicate > 1:
        mesh = init_device_mesh(dev.type, (replicate, dp_shard), mesh_dim_names=("dp_replicate", "dp_shard"))
    elif ep > 1:
        mesh = init_device_mesh(dev.type, (dp_shard, ep), mesh_dim_names=("dp_shard", "ep"))
        mesh._flatten("dp")  # the whole world as one dimension: FSDP of everything but the routed experts
    else:
        mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp_shard",))
    return Dist(rank, world, local, dev, mesh, ep, dp_shard)


def apply_ep(model, ep_mesh, overlap_chunks: int = 1) -> None:
    """Expert parallelism: shard every MoE layer's routed experts by expert over `ep_mesh` (see shard_experts).
    The router and the shared expert stay whole on every rank, so routing is local. `overlap_chunks` pipeline
    chunks per exchange. 1 by default: on H200 the all-to-all does not run beside the grouped GEMMs (measured,
    BENCHMARKS.md), so splitting only makes the GEMMs smaller."""
    for moe in model.moe_layers():
        shard_experts(moe.experts, ep_mesh, overlap_chunks)


def shard_experts(experts, ep_mesh, overlap_chunks: int = 1) -> None:
    """Split stacked experts (base and LoRA tensors) by expert into DTensors Shard(0) over `ep_mesh` — so init
    and loading by global offset, DCP and export keep working — and give `Experts` the all-to-all dispatcher."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from moetune.model.expert_parallel import AllToAllDispatcher

    if experts.num_experts % ep_mesh.size():
        raise ValueError(f"parallel.ep ({ep_mesh.size()}) must divide the number of routed experts "
                         f"({experts.num_experts})")
    for module in (experts, experts.lora):
        if module is None:
            continue
        for name, p in list(module.named_parameters(recurse=False)):
            # src_data_rank=None: each rank keeps its own slice, no scatter (the model is normally still on meta)
            shard = distribute_tensor(p.data, ep_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, torch.nn.Parameter(shard, requires_grad=p.requires_grad))
    experts.dispatcher = AllToAllDispatcher(ep_mesh.get_group(), overlap_chunks)


def sync_replicated_grads(params, dist: Dist) -> None:
    """Make the gradients FSDP does not manage the same all-rank mean FSDP's are: parameters held whole on every
    rank are all-reduced (one flat bucket: LoRA gradients are small) and divided by the world; routed experts
    split by EP alone already hold the sum over every rank's tokens (the all-to-all's backward) and are divided.
    Called once per step, after the last micro-batch's backward."""
    if not dist.initialized or dist.world_size == 1:
        return
    whole, ep_only = [], []
    for p in params:
        if p.grad is None:
            continue
        mesh = getattr(p, "device_mesh", None)
        if mesh is None:
            whole.append(p.grad)
        elif mesh.mesh_dim_names == ("ep",):
            ep_only.append(p.grad.to_local())
    for dtype in {g.dtype for g in whole}:  # one bucket per dtype
        grads = [g for g in whole if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce_sum(flat)
        flat.div_(dist.world_size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    for g in ep_only:
        g.div_(dist.world_size)


def clip_grad_norm(params, max_norm: float) -> float:
    """Global gradient norm over all ranks, clipped when max_norm > 0. Under expert parallelism the experts'
    gradients are DTensors on another mesh than the rest, and DTensor ops cannot mix meshes: one norm per
    mesh, made whole (full_tensor), then combined."""
    by_mesh: dict = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    if not by_mesh:
        return 0.0
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    if max_norm > 0:
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return float(total)


def apply_ac(model, spec) -> None:
    """Activation checkpointing per decoder layer (ac_modes: `spec` one mode for all layers or
    {mode: layers}): "full" recomputes the whole layer in backward; "attention" only its
    attention block; "selective" keeps the GEMM and attention outputs and recomputes only the cheap elementwise
    ops."""
    layers = model.model.layers
    for layer, mode in zip(layers, layer_modes(spec, len(layers))):
        layer.activation_checkpointing = mode


def apply_compile(model, backend: str = "inductor") -> None:
    """torch.compile per decoder layer: one graph per layer type, no recompiles across layers. Under expert
    parallelism the exchange is a graph break (expert_parallel.AllToAllDispatcher); what surrounds it stays compiled."""
    for layer in model.model.layers:
        layer.compile(dynamic=False, backend=backend)


def place_buffers(model, device) -> None:
    """Move every buffer (the router's e_score_correction_bias) to the compute device. FSDP2's CPU offload
    manages parameters only: a model materialised in host memory for it would keep its buffers there."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != torch.device(device):
                module._buffers[name] = buf.to(device)


def apply_fsdp(model, mesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype = torch.float32,
               reshard_after_forward: bool = True, cpu_offload: bool = False) -> None:
    """FSDP2: routed experts in their own unit (their all-gather overlaps the attention), each decoder layer
    a unit, the root last (embeddings, final norm, lm_head). Stacked experts mean every rank gathers the same
    tensors whatever its tokens route to, so uneven routing cannot desynchronise collectives.
    With expert parallelism the experts' unit shards over "dp_shard" only (they are already split over "ep"),
    everything else over the whole world ("dp").
    cpu_offload keeps the sharded fp32 master weights, gradients and optimizer state in host memory (FSDP2
    copies each unit to the GPU for its forward/backward); it needs an accelerator."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kw = dict(mp_policy=mp, offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())
    dp_mesh = mesh["dp"] if "ep" in (mesh.mesh_dim_names or ()) else mesh  # a 2-D mesh here means HSDP
    n = len(model.model.layers)
    for i, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and experts.dispatcher is not None:
            fully_shard(experts, mesh=mesh["dp_shard"], reshard_after_forward=reshard_after_forward, **kw)
            # The all-to-all's backward already sums an expert's gradient over its ep group; dividing by the
            # world (not dp_shard) makes it the same all-rank mean as every other gradient.
            experts.set_gradient_divide_factor(float(dp_mesh.size()))
            if mesh["dp_shard"].size() > 1:
                # sum, then divide (gloo has no PREMUL_SUM); not on a dp_shard of 1, where torch 2.13 would divide twice
                experts.set_force_sum_reduction_for_comms(True)
        elif experts is not None:
            fully_shard(experts, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, **kw)
        # the last layer's parameters are needed again at once by backward: keep them gathered
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard_after_forward and i < n - 1, **kw)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, **kw)
    _set_prefetch(model.model.layers)


def _fsdp_units(layer) -> list:
    """A decoder layer's FSDP units in the order its forward uses them (the layer, then its routed experts)."""
    experts = getattr(layer.mlp, "experts", None)
    return [layer] + ([experts] if experts is not None and hasattr(experts, "unshard") else [])


def _set_prefetch(layers) -> None:
    """Explicit prefetch: each layer's forward starts the all-gather of the next layer's units, each layer's
    backward that of the previous layer's, so the gathers are queued before the host reaches that layer (the
    implicit schedule issues them only when the layer's hook runs, which a host-bound step delays)."""
    for i, layer in enumerate(layers):
        if i + 1 < len(layers):
            layer.set_modules_to_forward_prefetch(_fsdp_units(layers[i + 1]))
        if i > 0:
            layer.set_modules_to_backward_prefetch(_fsdp_units(layers[i - 1]))


def fsdp_micro_batch(model, last: bool, keep_gathered: bool, defer_reduce: bool) -> None:
    """Call before each micro-batch of a step. `keep_gathered` (the parameters already stay gathered from forward
    to backward: reshard_after_forward false) keeps them gathered after backward too until the last
    micro-batch, so an accumulated step gathers the base once instead of once per micro-batch. `defer_reduce`
    (LoRA: the trainable gradients are small) reduces gradients once, after the last micro-batch, instead of
    after each."""
    if not hasattr(model, "set_requires_gradient_sync"):  # not FSDP-wrapped (one process)
        return
    if keep_gathered:
        model.set_reshard_after_backward(last, recurse=True)
    if defer_reduce:
        model.set_requires_gradient_sync(last, recurse=True)
