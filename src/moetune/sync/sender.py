"""The trainer's side of a weight sync.

    group = connect("tcp://trainer0:29600", rank=0, world_size=1 + n_workers) if train_rank == 0 else None
    sender = WeightSender(model, group, format="bf16")      # or "fp8", "fp8_rows"; lora="merge" | "adapter" | "base"
    sender.sync()                                           # on every rank of the training group

Every training rank calls `sync`: the owners of the shards a bucket needs send them to the sending rank (shards.py);
other ranks only walk the plan. On the sending rank, for each bucket of the plan (plan.py): wait until the ring slot's
previous broadcast has left, produce every unit straight into the slot — gather its rows, merge LoRA in fp32, cast
or quantize — and start the broadcast without waiting for it: the next bucket is produced while this one is on the
wire. Two slots are enough for that overlap and are the memory the bound allows (plan.py).

Producing must stay faster than the link or the link waits: on CUDA every LoRA merge and every block-fp8
quantization of routed experts is one fused kernel (kernels.py: one read and one write per weight); on the CPU, and
for the fp8 formats' requantisation of plain weights and fp8_rows's of experts everywhere (no fused kernel yet), torch
ops do it with export/merged.py's arithmetic (the CPU tests hold a synced model bit-exact to a whole-tensor merge, and
an fp8 sync of an FP8 base to `export merged --dtype fp8`).
Plain copies (no LoRA, bf16) are gathered straight into the bucket.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from moetune.model.quant.fp8 import quantize_rows_
from moetune.model.quant.modules import fp8_weights, scale_name
from moetune.sync.alloc import Allocations
from moetune.sync.fp8 import BLOCK, quantize_
from moetune.sync.group import SyncGroup, SyncRefused
from moetune.sync.plan import MAX_EXPERTS_PER_UNIT, ExpertUnit, Plan, build_plan, plan_tensors, staging_rows
from moetune.sync.shards import ShardMap, local_tensor
from moetune.sync.wire import Bucket, dtype_name, encode_header


def _reshard(model) -> None:
    """FSDP2 modules left unsharded (reshard_after_forward=False, an interrupted step) would show their full
    parameters on every rank; the plan assumes the sharded state, which is also the one that costs no memory."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


class WeightSender:
    def __init__(self, model, group: SyncGroup | None, format: str = "bf16", lora: str = "merge",
                 train_group="default", root: int = 0, bucket_bytes: int | None = None,
                 max_experts_per_unit: int = MAX_EXPERTS_PER_UNIT, fused_kernels: bool = True, device=None):
        """group: the sync group on the sending rank (training rank `root`), None on the other training ranks.
        device: without a group, where `buckets()` produces (a WeightSource over this sender, vllm_engine.py).
        train_group: the training process group whose ranks hold the shards ("default": torch.distributed's
        world when initialised, else none: a single process). fused_kernels: use kernels.py on CUDA."""
        if train_group == "default":
            train_group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        self.model, self.group, self.format, self.lora = model, group, format, lora
        self.train_group, self.root = train_group, root
        self.bucket_bytes, self.max_experts_per_unit = bucket_bytes, max_experts_per_unit
        self.is_root = (dist.get_rank(train_group) if train_group is not None else 0) == root
        if self.is_root and group is None and device is None:
            raise ValueError("the sending rank needs the sync group: pass group=connect(address, 0, world_size)")
        self.device = torch.device(device) if device is not None else None
        self.mem = Allocations()
        self.plan: Plan | None = None
        self.kernels = None
        if fused_kernels and self.is_root and self._device(group).type == "cuda" and format != "fp32":
            try:
                from moetune.sync import kernels as _kernels
                self.kernels = _kernels
            except ImportError:  # no Triton: the torch path, slower to pack but the same wire
                pass
        self._signature = None

    def _device(self, group) -> torch.device:
        return group.device if group is not None else self.device

    def metadata(self) -> dict:
        """The header the next sync sends (names, dtypes, shapes of every bucket), without sending anything. Every
        training rank calls it (the plan is agreed on by all)."""
        _reshard(self.model)
        tensors = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        device = self._device(self.group) if self.is_root else local_tensor(next(iter(tensors.values()))).device
        self._prepare(tensors, device)
        return self.plan.header

    @torch.no_grad()
    def buckets(self, before_reuse=None):
        """Produce the model bucket by bucket (every training rank; call metadata() first): yields each Bucket on
        the sending rank (None on the others, which only take part in the gathers). A bucket's tensors are valid
        until the next but one is produced: two ring slots are the memory bound. before_reuse(slot) runs before a
        slot is overwritten (sync: wait for its broadcast)."""
        plan = self.plan
        self.mem.reset()
        ring = [self.mem.empty(max(b.meta["nbytes"] for b in plan.buckets), torch.uint8, self.shards.device)
                for _ in range(min(2, len(plan.buckets)))] if self.is_root else []
        for k, b in enumerate(plan.buckets):
            bucket = None
            if ring:
                if before_reuse is not None:
                    before_reuse(k % len(ring))
                bucket = Bucket(b.meta, ring[k % len(ring)][: b.meta["nbytes"]], plan.header["format"])
            for u in b.units:
                self._produce(u, bucket)
            yield bucket

    def _prepare(self, tensors: dict, device) -> None:
        """The shard map and the plan, rebuilt only when a name, shape, dtype or placement changed (on any rank):
        between two syncs of a training run nothing does, and rebuilding costs Python time on every sync."""
        sig = (self.format, self.lora, self.bucket_bytes, self.max_experts_per_unit,
               tuple((n, t.shape, t.dtype, getattr(t, "placements", None), id(getattr(t, "device_mesh", None)))
                     for n, t in tensors.items()))  # what a box is a function of, cheaper to read than the box
        changed = sig != self._signature
        if self.train_group is not None and dist.get_world_size(self.train_group) > 1:
            flag = torch.tensor([int(changed)], device=device if dist.get_backend(self.train_group) == "nccl" else "cpu")
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.train_group)  # all rebuild, or none
            changed = bool(flag.item())
        if changed:
            # an fp8 base: its weights travel dequantised (then in the wire's format), its scales not at all
            fp8 = {w: (scale_name(w, q), q) for w, q in fp8_weights(self.model)}
            self.shards = ShardMap(tensors, self.train_group, self.root, device, self.mem, fp8)
            self.plan = build_plan(self.model, plan_tensors(self.model, tensors), self.format, self.lora,
                                   self.bucket_bytes, self.max_experts_per_unit)
            self._header = encode_header(self.plan.header, "cpu")
            self._signature = sig
        self.shards.tensors = tensors  # FSDP may have swapped the parameter objects; their boxes are the same

    @torch.no_grad()
    def sync(self) -> dict:
        """Stream the model once. Returns {"bytes", "buckets", "seconds", "peak_alloc", "bound", ...}.

        Before any weight moves, every receiver checks the header (names, shapes, format) against its model and
        answers; one refusal stops the sync on every rank (SyncRefused, naming the receiver and what differs).
        Every wait is bounded (group.deadline: a fixed part plus the bytes at the slowest expected rate); a
        receiver that does not answer in time is named (SyncTimeout) instead of blocking the trainer."""
        t0 = time.perf_counter()
        header = self.metadata()
        refusal = self._header_round() if self.is_root else None
        self._agree(refusal)
        if not self.is_root:
            for _ in self.buckets():
                pass
            return {"bytes": 0, "buckets": len(self.plan.buckets), "seconds": time.perf_counter() - t0}

        group, n = self.group, len(header["buckets"])
        in_flight = [None, None]

        def before_reuse(slot):  # on CUDA: the producing stream waits, the host runs ahead
            if in_flight[slot] is not None:
                group.wait(*in_flight[slot])

        for k, bucket in enumerate(self.buckets(before_reuse)):
            in_flight[k % 2] = (group.broadcast(bucket.buf), bucket.meta["nbytes"], f"taking bucket {k + 1} of {n}")
        for work in in_flight:
            if work is not None:
                group.wait(*work)
        if group.device.type == "cuda":
            torch.cuda.current_stream(group.device).synchronize()
        plan = self.plan
        # the broadcasts may have completed on the sender's side while a receiver still reads: its word that it has
        # everything ends the sync
        group.collect("done", range(1, group.size), plan.wire_bytes, "confirming it received the whole sync")
        return {"format": plan.header["format"], "bytes": plan.wire_bytes, "buckets": len(plan.buckets),
                "seconds": time.perf_counter() - t0, "peak_alloc": self.mem.peak, "bound": plan.bound,
                "largest_group": plan.largest_group, "expert_bf16": plan.expert_bf16,
                "experts_per_unit": plan.experts_per_unit, "bucket": plan.bucket, "fused": self.kernels is not None}

    def _header_round(self) -> str | None:
        """The sending rank: send the header, collect every receiver's answer, tell them all whether the sync goes
        on. Returns the refusal (None: it goes on)."""
        group = self.group
        group.syncs += 1
        group.send_header(self.mem.track(self._header.to(group.device)))
        answers = group.collect("verdict", range(1, group.size), self._header.numel(), "checking the header")
        refused = {r: v for r, v in sorted(answers.items()) if v != "ok"}
        group.post("go", "ok" if not refused else "refused")
        if not refused:
            return None
        return "; ".join(f"{group.member(r)} refused it: {v}" for r, v in refused.items())

    def _agree(self, refusal: str | None) -> None:
        """Every training rank learns the sending rank's outcome (the others would otherwise wait in gathers the
        sender never starts)."""
        flag = 1 if refusal else 0
        if self.train_group is not None and dist.get_world_size(self.train_group) > 1:
            t = torch.tensor([flag], device=self.shards.device if dist.get_backend(self.train_group) == "nccl" else "cpu")
            dist.broadcast(t, group_src=self.root, group=self.train_group)
            flag = int(t.item())
        if flag:
            raise SyncRefused("weight sync refused before any weight was sent: " + (
                refusal or f"a receiver refused it (training rank {self.root}'s error names it)"))

    # -------------------------------------------------------------------------------------------- producing
    def _produce(self, u, bucket: Bucket | None) -> None:
        """Write unit u into its place in `bucket` (None off the sending rank: only take part in the gathers)."""
        if isinstance(u, ExpertUnit):
            self._experts(u, bucket.experts if bucket is not None else None)
        else:
            self._tensor(u, bucket.tensor(u.name) if bucket is not None else None,
                         bucket.tensor(u.scale) if bucket is not None and u.scale else None)

    def _f32(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == torch.float32 else self.mem.track(t.float())

    def _merged(self, W, A, B, scaling: float) -> torch.Tensor:
        """W + scaling·B·A in fp32 with export/merged.py's arithmetic: the product, scaled, then W added."""
        out = self.mem.empty(W.shape, torch.float32, self.shards.device)
        torch.matmul(self._f32(B), self._f32(A), out=out)
        return out.mul_(scaling).add_(W)

    def _tensor(self, u, dst: torch.Tensor | None, scale_dst: torch.Tensor | None = None) -> None:
        src = local_tensor(self.shards.tensors[u.src])
        rows = u.shape[0]
        A_name, B_name, scaling = u.lora or (None, None, None)
        rank = self.shards.tensors[A_name].shape[0] if u.lora else 0
        step = rows  # a copy as it is: whole, received straight into the bucket
        if u.lora or u.scales or dtype_name(src.dtype) != u.dtype:  # staged: as many rows as the budget holds
            step = staging_rows(self.plan.staging_budget, self.shards.tensors, u)
            if u.scales == "block" and step < rows:  # whole 128-row blocks: each chunk fills its own rows of the grid
                step = max(BLOCK, step - step % BLOCK)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            part = dst[r0:r1] if dst is not None else None
            if not u.lora and not u.scales:
                self.shards.gather(u.src, r0, r1, out=part)  # cast on the way in
                continue
            W = self.shards.gather(u.src, r0, r1)
            A, B = (self.shards.gather(A_name, 0, rank), self.shards.gather(B_name, r0, r1)) if u.lora else (None,) * 2
            if part is None:
                continue
            if u.scales == "row":  # fp8_rows: the merged rows requantised, a scale a row (export merged's values)
                self._requantise(u.src, W, A, B, scaling, part, scale_dst[r0:r1], quantize_rows_)
            elif u.scales == "block":  # fp8 of a block-scaled base: the merged rows requantised per 128×128 block
                self._requantise(u.src, W, A, B, scaling, part, scale_dst[r0 // BLOCK: -(-r1 // BLOCK)], quantize_)
            if u.scales:
                del W, A, B  # before the next rows are gathered: the staging budget holds one chunk
                continue
            if self.kernels is not None and part.dim() == 2:  # CUDA: one fused pass (a linear is one "expert")
                self.kernels.merge_experts_(W[None], part[None], A[None], B[None], scaling)
            else:
                part.copy_(self._merged(W, A, B, scaling))

    def _requantise(self, src: str, W, A, B, scaling: float, q_out, scale_out, quantize) -> None:
        """W (+ scaling·B·A) requantised into q_out and scale_out by `quantize` (a row or a block at a time), which
        divides its fp32 scratch in place: the merge's output, or W itself when it is an fp8 weight's dequantised
        rows (a buffer of its own; a view of a parameter is copied first)."""
        if A is not None:
            x = self._merged(W, A, B, scaling)
        else:
            x = W if src in self.shards.fp8 and W.dtype == torch.float32 else self.mem.track(W.float())
        quantize(x, q_out, scale_out)

    def _experts(self, u: ExpertUnit, slabs) -> None:
        a, b = u.first, u.first + u.count
        rel = slice(a - slabs.first, b - slabs.first) if slabs is not None else None
        scaling = u.lora["scaling"] if u.lora else 0.0
        for part, proj in (("w13", "gate_up"), ("w2", "down")):
            src = f"{u.prefix}.{proj}_proj"
            wire = getattr(slabs, part)[rel] if slabs is not None else None
            if u.scales == "row":  # fp8_rows: merged, requantised a row at a time (rows never mix experts)
                W = self.shards.gather(src, a, b)
                A, B = (self.shards.gather(name, a, b) for name in u.lora[proj]) if u.lora else (None, None)
                if wire is not None:
                    self._requantise(src, W, A, B, scaling, wire, getattr(slabs, f"{part}_scale")[rel], quantize_rows_)
                del W, A, B  # before the next projection is gathered (the plan stages one at a time)
                continue
            if u.lora is None and not u.fp8:
                self.shards.gather(src, a, b, out=wire)  # cast on the way in
                continue
            scratch = None  # torch fp8 without LoRA: gathered straight into the fp32 scratch quantize_ scales in place
            if u.lora is None and self.kernels is None and wire is not None:
                scratch = self.mem.empty(wire.shape, torch.float32, self.shards.device)
            W = self.shards.gather(src, a, b, out=scratch)
            A, B = (self.shards.gather(name, a, b) for name in u.lora[proj]) if u.lora else (None, None)
            if wire is None:
                continue
            if self.kernels is None and u.lora:
                W, A, B = self._merged(W, A, B, scaling), None, None
            if not u.fp8:
                if self.kernels is not None:
                    self.kernels.merge_experts_(W, wire, A, B, scaling)
                else:
                    wire.copy_(W)
                continue
            scale = getattr(slabs, f"{part}_scale")[rel]
            I, nI = u.I, scale.shape[1] // 2  # gate and up blocked apart: each keeps its HF tensor's scale grid
            jobs = [(slice(None), slice(None))]
            if part == "w13":
                jobs = [(slice(0, I), slice(0, nI)), (slice(I, 2 * I), slice(nI, 2 * nI))]
            for rows, srows in jobs:
                Bp = B[:, rows] if B is not None else None
                if self.kernels is not None:
                    self.kernels.merge_experts_(W[:, rows], wire[:, rows], A, Bp, scaling, scale=scale[:, srows])
                else:
                    quantize_(W[:, rows], wire[:, rows], scale[:, srows])  # W is fp32 scratch here: scaled in place
