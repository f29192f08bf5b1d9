"""What a step does across ranks to the gradients: FSDP's accumulation switches per micro-batch, the all-reduce of
the gradients FSDP does not manage, and the global norm and clipping across meshes."""

from __future__ import annotations

import torch

from moetune.parallel.mesh import Dist


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
