"""The inference side of a weight sync: `receive` takes one sync off the group and hands each bucket to a consumer.

    group = connect("tcp://trainer0:29600", rank=1, world_size=2)
    receive(group, ModelUpdater(model))                       # a moetune or a transformers GLM model
    receive(group, lambda b: engine_model.load_weights(b.tensors()))   # what the vLLM extension does (vllm.py)

The header (wire.py) arrives first; the receiver then allocates two bucket buffers and keeps the next bucket's
receive posted while the consumer loads the current one, so loading overlaps the transfer as producing does on the
sender. A bucket's tensors are views of the buffer, valid only during the consumer call: consumers copy.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from moetune.model.quant.modules import scale_name
from moetune.sync.fp8 import dequantize
from moetune.sync.plan import WIRE_SCHEMES
from moetune.sync.group import SyncGroup, SyncRefused
from moetune.sync.wire import Bucket


def receive(group: SyncGroup, consume: Callable[[Bucket], None]) -> dict:
    """Receive one sync and call consume(bucket) for each bucket, in order. Returns {"format", "bytes", "buckets",
    "seconds"}. A consumer with a `check(header) -> str | None` method answers the header first: a reason (its
    model differs) refuses the sync before any weight is sent, on every member (SyncRefused)."""
    t0 = time.perf_counter()
    group.syncs += 1
    header = group.recv_header()
    check = getattr(consume, "check", None)
    reason = check(header) if check is not None else None
    group.post("verdict", reason or "ok")
    go = group.collect("go", [0], 0, "deciding whether the sync goes on")[0]
    if reason:
        raise SyncRefused(f"weight sync refused by this receiver ({group.member(group.rank)}) before any weight "
                          f"was sent: {reason}")
    if go != "ok":
        raise SyncRefused("weight sync called off by the trainer before any weight was sent: another receiver "
                          "refused it (the trainer's error names it)")
    metas = header["buckets"]
    ring = [torch.empty(max(m["nbytes"] for m in metas), dtype=torch.uint8, device=group.device)
            for _ in range(min(2, len(metas)))]
    pending = {}

    def post(k):
        pending[k] = group.broadcast(ring[k % len(ring)][: metas[k]["nbytes"]])

    for k in range(len(ring)):
        post(k)
    for k, meta in enumerate(metas):
        group.wait(pending.pop(k), meta["nbytes"], f"sending bucket {k + 1} of {len(metas)}", peers=[0])
        consume(Bucket(meta, ring[k % len(ring)][: meta["nbytes"]], header["format"]))
        if k + len(ring) < len(metas):
            post(k + len(ring))  # on CUDA it waits, on its stream, for the copies consume() just queued
    if group.device.type == "cuda":
        torch.cuda.current_stream(group.device).synchronize()
    group.post("done", "ok")
    return {"format": header["format"], "bytes": sum(m["nbytes"] for m in metas), "buckets": len(metas),
            "seconds": time.perf_counter() - t0}


class ModelUpdater:
    """Copies received weights into a model in place. moetune's models and transformers' (Glm4MoeForCausalLM,
    Glm4MoeLiteForCausalLM, GlmMoeDsaForCausalLM) name every tensor alike (experts fused as gate_up_proj [E, 2I, H]
    and down_proj [E, H, I]), so one updater serves both.

    bf16 buckets: plain tensors by name, expert sections as one copy per projection. fp8 buckets: every fp8 weight,
    plain or expert (one at a time), is dequantized with its scales (q·s per 128×128 block, fp8.py); fp8_rows
    buckets: likewise with row scales (q·s per row). Adapter buckets: LoRA tensors by name
    (a moetune model with the same LoRA applied). A model that carries LoRA should receive merged weights only if
    its LoRA is zero, or it would apply the update twice."""

    def __init__(self, model):
        self.targets = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        self.updated: set[str] = set()

    def check(self, header: dict) -> str | None:
        """Why this model cannot take the sync described by `header` (None: it can)."""
        problems = []
        for meta in header["buckets"]:
            scales = {scale for scale, _ in _plain_scales(meta).values()}
            for name, _, shape, _ in meta["tensors"]:
                if name in scales:
                    continue  # read with its weight
                t = self.targets.get(name)
                if t is None or tuple(t.shape) != tuple(shape):
                    problems.append(f"{name} {list(shape)}: " + ("not in this model" if t is None else
                                                                f"this model's is {list(t.shape)}"))
            sec = meta["experts"]
            if sec:
                want = {"gate_up_proj": (2 * sec["I"], sec["H"]), "down_proj": (sec["H"], sec["I"])}
                for proj, shape in want.items():
                    t = self.targets.get(f"{sec['prefix']}.{proj}")
                    if t is None or tuple(t.shape[1:]) != shape or t.shape[0] < sec["first"] + sec["count"]:
                        problems.append(f"{sec['prefix']}.{proj} experts {sec['first']}..{sec['first'] + sec['count'] - 1}"
                                        f" of {list(shape)}: " + ("not in this model" if t is None else
                                                                  f"this model's is {list(t.shape)}"))
        if not problems:
            return None
        return (f"the sync's model differs from this one in {len(problems)} tensors: " + "; ".join(problems[:3])
                + (" ..." if len(problems) > 3 else ""))

    def _target(self, name: str, shape) -> torch.Tensor:
        t = self.targets.get(name)
        if t is None:
            raise KeyError(f"received {name}, which this model does not have")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(f"received {name} of shape {list(shape)}, the model's is {list(t.shape)}")
        self.updated.add(name)
        return t

    @torch.no_grad()
    def __call__(self, bucket: Bucket) -> None:
        scales = _plain_scales(bucket.meta)
        scale_names = {scale for scale, _ in scales.values()}
        for name, t in bucket.plain():
            if name in scale_names:
                continue
            if name in scales:
                scale, scheme = scales[name]
                t = scheme.dequantize(t, bucket.tensor(scale))
            self._target(name, t.shape).copy_(t)
        ex = bucket.experts
        if ex is None:
            return
        gate_up = self._target(f"{ex.prefix}.gate_up_proj", None)
        down = self._target(f"{ex.prefix}.down_proj", None)
        if gate_up.shape[1:] != ex.w13.shape[1:] or down.shape[1:] != ex.w2.shape[1:]:
            raise ValueError(f"{ex.prefix}: received experts of shapes {list(ex.w13.shape[1:])}, {list(ex.w2.shape[1:])}; "
                             f"the model's are {list(gate_up.shape[1:])}, {list(down.shape[1:])}")
        rows = slice(ex.first, ex.first + ex.count)
        if not ex.fp8:
            gate_up[rows].copy_(ex.w13)
            down[rows].copy_(ex.w2)
            return
        if ex.scales == "row":
            for i, e in enumerate(ex.experts):
                gate_up[e].copy_(ex.w13[i].float() * ex.w13_scale[i])
                down[e].copy_(ex.w2[i].float() * ex.w2_scale[i])
            return
        I, nI = ex.I, ex.w13_scale.shape[1] // 2
        for i, e in enumerate(ex.experts):
            gate_up[e, :I].copy_(dequantize(ex.w13[i, :I], ex.w13_scale[i, :nI]))
            gate_up[e, I:].copy_(dequantize(ex.w13[i, I:], ex.w13_scale[i, nI:]))
            down[e].copy_(dequantize(ex.w2[i], ex.w2_scale[i]))


def _plain_scales(meta: dict) -> dict[str, tuple]:
    """{fp8 weight: (its scale, its wire scheme)} of a bucket's plain tensors: `X.weight_scale` (rows, fp8_rows) or
    `X.weight_scale_inv` (blocks, fp8) follows `X.weight`."""
    names = {name for name, _, _, _ in meta["tensors"]}
    return {name: (scale_name(name, scheme), scheme) for name, dtype, _, _ in meta["tensors"]
            if dtype == "float8_e4m3fn" for scheme in WIRE_SCHEMES.values() if scale_name(name, scheme) in names}


def receive_into(group: SyncGroup, model) -> dict:
    """Receive one sync into `model` (moetune's or transformers' GLM model) in place; the stats also list
    which of the model's tensors were updated ("updated")."""
    updater = ModelUpdater(model)
    stats = receive(group, updater)
    stats["updated"] = sorted(updater.updated)
    return stats
