"""The parallelisms, as plain functions applied in a fixed order (torchtitan's shape), each reading the layout:

    build on meta → LoRA → parallelize: apply_ep → apply_ac → apply_compile → apply_fsdp → materialise → load

Every rank is a data-parallel rank (its own batches). Under expert parallelism (mesh ("dp_shard", "ep")) the routed
experts are split by expert over "ep" and FSDP-sharded over "dp_shard"; all other parameters are FSDP-sharded over
the whole world ("dp", the two dimensions flattened).
"""

from __future__ import annotations

import torch

from moetune.errors import ConfigError
from moetune.parallel.ac_modes import layer_modes


def parallelize(model, layout, mesh, *, compile: bool, param_dtype: torch.dtype,
                reshard_after_forward: bool = True, overlap_chunks: int = 1, cuda_graphs: bool = False) -> None:
    """Apply `layout` (layout.Layout) to a model still on meta: EP → activation checkpointing → compile → FSDP2.
    `cuda_graphs`: the compiled layers replay as CUDA graphs (check_cuda_graphs says where they can)."""
    if layout.ep > 1:
        apply_ep(model, mesh["ep"], overlap_chunks, compiled=compile)
    apply_ac(model, layout.recompute)
    if compile:
        apply_compile(model, mode="reduce-overhead" if cuda_graphs else None)
    if layout.fsdp:
        apply_fsdp(model, mesh, param_dtype=param_dtype, reshard_after_forward=reshard_after_forward,
                   cpu_offload=layout.cpu_offload)


def apply_ep(model, ep_mesh, overlap_chunks: int = 1, compiled: bool = False) -> None:
    """Expert parallelism: shard every MoE layer's routed experts by expert over `ep_mesh` (see shard_experts).
    The router and the shared expert stay whole on every rank, so routing is local. `overlap_chunks` pipeline
    chunks per exchange. 1 by default: on 2 × H200 the all-to-all did not run beside torch's grouped GEMM (measured,
    BENCHMARKS.md), so splitting only made the GEMMs smaller; today's persistent TMA kernel is not yet measured there
    (benchmarks/ep_exchange.py). `compiled`: the exchange's local work compiled on its own, as the layers around it
    are (expert_parallel.AllToAllDispatcher)."""
    for moe in model.moe_layers():
        shard_experts(moe.experts, ep_mesh, overlap_chunks, compiled)


def shard_experts(experts, ep_mesh, overlap_chunks: int = 1, compiled: bool = False) -> None:
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
    experts.dispatcher = AllToAllDispatcher(ep_mesh.get_group(), overlap_chunks, compiled)


def apply_ac(model, spec) -> None:
    """Activation checkpointing per decoder layer (`spec`: Layout.recompute, or a setting ac_modes reads): "full"
    recomputes the whole layer in backward (under EP a MoE layer's attention and expert work apart, the exchange's
    rows kept: model/recompute.split_modes); "attention" only its attention block; "selective" keeps the GEMM and
    attention outputs and recomputes only the cheap elementwise ops."""
    layers = model.model.layers
    for layer, mode in zip(layers, layer_modes(spec, len(layers))):
        layer.activation_checkpointing = mode


def check_cuda_graphs(layout, compile: bool, device) -> None:
    """train.cuda_graphs: true where CUDA graphs cannot replay the layers is a ConfigError naming the reason."""
    reason = ("train.compile is false" if not compile else "the device is not a GPU"
              if torch.device(device).type != "cuda" else "" if layout.allows_cuda_graphs
              else "FSDP is on (parallel layout)")
    if reason:
        raise ConfigError(f"train.cuda_graphs: true, but {reason}: CUDA graphs replay compiled layers on a GPU "
                          "whose parameters stay in place; set it to false")


def apply_compile(model, backend: str = "inductor", mode: str | None = None) -> None:
    """torch.compile per decoder layer: one graph per layer type, no recompiles across layers. Under expert
    parallelism the exchange is a graph break (expert_parallel.AllToAllDispatcher); what surrounds it stays compiled.
    mode "reduce-overhead": each compiled layer replays as a CUDA graph (torch's CUDA graph trees): the host no
    longer launches a layer's kernels one by one (an fp8 base's GLM-4.7-Flash step waits on them); an fp8 base's
    dense operands are then quantised by the one-pass row kernel, whose launches the graphs replay (quant.matmul's
    DENSE_QUANT "auto")."""
    from moetune.model.quant import matmul
    from moetune.model.step_inputs import StepInputs, unstaged

    matmul.REPLAYED_AS_CUDA_GRAPHS = mode == "reduce-overhead"
    # the graphs' backward takes the inputs its forward saved at the addresses its recording saw
    model.step_inputs = StepInputs() if mode == "reduce-overhead" else unstaged
    for layer in model.model.layers:
        layer.compile(dynamic=False, backend=backend, **({"mode": mode} if mode else {}))


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
    cpu_offload keeps the sharded parameters (full mode's fp32 master weights, or a LoRA run's frozen base),
    gradients and optimizer state in host memory (FSDP2 copies each unit to the GPU for its forward/backward), with a
    shard group of one process too (one GPU); pinned host memory only where there is an accelerator to copy to. An
    fp8 base stays as stored there and on its way: FSDP2 keeps each parameter's dtype, copies the shard to the GPU
    as it is, and casts the all-gather's input only to a param_dtype, which setup passes as None for an fp8 base.
    Its scales are parameters (frozen), so they travel with their weights; buffers FSDP2 does not manage:
    place_buffers."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kw = dict(mp_policy=mp, offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy())
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
