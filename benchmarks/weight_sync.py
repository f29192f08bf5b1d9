"""Weight sync from trainer to inference worker: throughput and memory, next to a plain broadcast of the same bytes.

    torchrun --nproc-per-node 2 benchmarks/weight_sync.py                      # 2 GPUs, AIR shapes
    torchrun --nproc-per-node 2 benchmarks/weight_sync.py --shape glm5         # 2 GPUs, GLM-5 layers at full width
    torchrun --nproc-per-node 2 benchmarks/weight_sync.py --device cpu --tiny  # a check on CPU (gloo), tiny shapes
    torchrun --nproc-per-node 2 benchmarks/weight_sync.py --device cpu --shape glm5 --scale-down 8 --layers 3
                                                                   # a CPU rehearsal of the GLM-5 run, 1/8 the width

Layout: rank 0 is the trainer, a training group of one with the model whole on cuda:0 (an FSDP group of one holds
the same tensors), rank 1 the inference worker on cuda:1. The sync and the plain broadcast run on the sync group
(its own rendezvous, as deployed); torchrun's world only lines the two processes up between measurements.

Model (--shape): GLM-4.5-Air (hidden 4096, 128 experts × 1408, vocab 151552; the default), GLM-5 (`glm5`: hidden
6144, MLA with q_lora 2048 / kv_lora 512 and 64 heads, the DSA indexer, 256 experts × 2048, vocab 154880; one MoE layer
is 19.3 GB in bf16, 9.7 GB in fp8) or GLM-4.7-Flash (`glm47-flash`); --layers decoder layers (layer 0 dense, the rest
MoE), random weights, LoRA rank 16 on attention (MLA: q_a, q_b, kv_a, kv_b, o) and experts with random B (so the
merge is real work). --scale-down K divides every width (hidden, intermediate sizes, experts, heads, latent ranks) by
K and the vocabulary by K² (so the embeddings keep their proportion to a layer), keeping the architecture: a
rehearsal of a shape that does not fit the machine.
The GLM-5 rows answer issue 14: the sender's and the worker's transient per sync against the 1.25 × largest-layer
bound (the plan's 1.25·L + one expert), and against the 31 GiB per layer the reference RL system needed after its
fix (49 GiB before), with fp8 experts, and bytes/s against a plain broadcast.
Rows, each the best of --iters after a warm-up:
  sync bf16 merged       WeightSender(format="bf16")  -> receive_into(a moetune bf16 model on the worker)
  sync bf16 base         the same, LoRA not merged (lora="base"): the copy-only path
  sync fp8 merged        WeightSender(format="fp8")   -> a worker that keeps experts in fp8 (as vLLM does)
  broadcast             one broadcast of a buffer of the sync's wire bytes, on the same group
  gather-everything      per layer: full_tensor() of every tensor, LoRA merged on the whole stacks, torch.stack of
                         the HF per-expert tensors, one broadcast of the layer (what a naive exporter does)
  broadcast in buckets   the bf16 sync's bytes in its buckets, two in flight, nothing packed: the cost of bucketing
  pack only              the sender's producing alone, nothing sent: the headroom under the link
On CUDA the sender's fused expert kernels are also checked against its torch path ("fused_check" in the JSON).
seconds: the slower side, both starting after a barrier; bytes/s = wire bytes / seconds; ratio = bytes/s over the
broadcast's of the same format. peak: torch.cuda.max_memory_allocated during the call minus before it (CPU: the
sender's tracked allocations; the worker's are not measured on CPU). Output: a table, and JSON in $OUT (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist

from moetune.model.config import GLM5, GLM45_AIR, GLM47_FLASH, TINY, ModelConfig
from moetune.model.hf_io import build_model, cast_model, init_weights
from moetune.model.lora import apply_lora
from moetune.sync import ModelUpdater, WeightSender, connect, receive
from moetune.sync.plan import lora_sources
from moetune.sync.wire import Bucket

GiB = 1 << 30
SHAPES = {"air": GLM45_AIR, "glm5": GLM5, "glm47-flash": GLM47_FLASH, "tiny": TINY}
REFERENCE_GIB = {"glm5": 31}  # the reference system's transient per GLM-5.2 layer after its fix (issue 14)
_WIDTHS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "n_routed_experts", "num_attention_heads",
           "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "index_n_heads")


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shape", default="air", choices=sorted(SHAPES), help="model shapes (default: GLM-4.5-Air)")
    p.add_argument("--tiny", action="store_true", help="the tiny demo shapes (= --shape tiny; for --device cpu)")
    p.add_argument("--scale-down", type=int, default=1, metavar="K", help="divide every width by K (CPU rehearsal)")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers: 1 dense + (layers-1) MoE (default 4; glm5: 3, two 19.3 GB MoE layers)")
    p.add_argument("--no-naive", action="store_true", help="skip the gather-everything row (its fp32 whole-stack "
                   "merge needs ~4× a layer's bf16 bytes)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    if a.tiny:
        a.shape = "tiny"
    if a.layers is None:
        a.layers = 3 if a.shape == "glm5" else 4
    return a


def model_config(a) -> ModelConfig:
    """The shape's config with --layers layers (the first dense, the rest MoE), widths divided by --scale-down."""
    d = dict(SHAPES[a.shape], num_hidden_layers=a.layers, first_k_dense_replace=1)
    if a.scale_down > 1:
        for k in _WIDTHS:
            if d.get(k):
                d[k] = max(1, d[k] // a.scale_down)
        # a layer's experts shrink by K³ (experts × hidden × intermediate), the embeddings by K × (vocab / K²): the
        # non-layer group keeps its proportion to a layer, so the largest group is a MoE layer, as at full width
        d["vocab_size"] = max(1, d["vocab_size"] // a.scale_down**2)
        d["num_experts_per_tok"] = min(d["num_experts_per_tok"], d["n_routed_experts"])
    return ModelConfig.from_hf_dict(d)


def build_trainer_model(cfg, device, rank):
    model = build_model(cfg, "meta")
    cast_model(model, torch.bfloat16)
    attention = (["q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"] if cfg.is_mla
                 else ["q_proj", "k_proj", "v_proj", "o_proj"])
    apply_lora(model, attention + ["experts"], rank, 2.0 * rank)
    model.to_empty(device=device)
    with torch.no_grad():
        init_weights(model, seed=0)
        g = torch.Generator(device=device).manual_seed(1)
        for name, p in model.named_parameters():
            if ".lora" in name:
                p.normal_(0.0, 0.02, generator=g)
    return model


class Fp8Worker:
    """A worker holding routed experts in fp8 (w13/w2 + block scales, preallocated like an engine's) and the rest in
    a bf16 model: fp8 expert sections are copied as they are, everything else goes to the model."""

    def __init__(self, model):
        self.model_update = ModelUpdater(model)
        self.experts = {}

    @torch.no_grad()
    def __call__(self, bucket):
        ex = bucket.experts
        if ex is None or not ex.fp8:
            return self.model_update(bucket)
        for name, t in bucket.plain():
            self.model_update._target(name, t.shape).copy_(t)
        if ex.prefix not in self.experts:  # first sync (the warm-up): allocate as an engine would at start
            E = self.model_update.targets[f"{ex.prefix}.gate_up_proj"].shape[0]
            parts = {p: getattr(ex, p) for p in ("w13", "w2", "w13_scale", "w2_scale")}
            self.experts[ex.prefix] = {p: torch.empty((E, *t.shape[1:]), dtype=t.dtype, device=t.device)
                                       for p, t in parts.items()}
        rows = slice(ex.first, ex.first + ex.count)
        for p, dst in self.experts[ex.prefix].items():
            dst[rows].copy_(getattr(ex, p))


@torch.no_grad()
def gather_everything_send(model, group):
    """The naive approach: for each layer, every tensor whole (full_tensor), LoRA merged on whole stacks in fp32,
    per-expert HF tensors stacked into one flat buffer, one broadcast per layer."""
    linear, experts = lora_sources(model)
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    by_layer: dict = {}
    for name in params:
        if ".lora" not in name:
            key = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
            by_layer.setdefault(key, []).append(name)
    full = lambda n: params[n].full_tensor() if hasattr(params[n], "full_tensor") else params[n]  # noqa: E731
    for key in sorted(by_layer):
        tensors = []
        for name in by_layer[key]:
            W = full(name)
            prefix, leaf = name.rsplit(".", 1)
            if leaf in ("gate_up_proj", "down_proj") and prefix in experts:
                A, B = (full(n) for n in experts[prefix][leaf.removesuffix("_proj")])
                W = (W.float() + torch.bmm(B.float(), A.float()) * experts[prefix]["scaling"]).to(torch.bfloat16)
                I = W.shape[1] // 2
                parts = [W[:, :I], W[:, I:]] if leaf == "gate_up_proj" else [W]
                tensors += [torch.stack(list(p.unbind(0))) for p in parts]  # the HF per-expert tensors, stacked
            elif name in linear:
                A, B, s = linear[name]
                tensors.append((W.float() + (full(B).float() @ full(A).float()) * s).to(torch.bfloat16))
            else:
                tensors.append(W if name.endswith("e_score_correction_bias") else W.to(torch.bfloat16))
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
        del tensors
        group.broadcast(torch.tensor([flat.numel()], device=flat.device)).wait()
        group.broadcast(flat).wait()
        del flat


def gather_everything_recv(group, sink):
    n = torch.zeros(1, dtype=torch.int64, device=group.device)
    while True:  # layers until the sender's sentinel (size 0)
        group.broadcast(n).wait()
        if int(n.item()) == 0:
            return
        flat = torch.empty(int(n.item()), dtype=torch.uint8, device=group.device)
        group.broadcast(flat).wait()
        sink[: flat.numel()].copy_(flat)  # the load a worker would do
        del flat


@torch.no_grad()
def pack_only(sender, device):
    """Produce every bucket of the sender's (cached) plan into one buffer, sending nothing."""
    plan = sender.plan
    ring = torch.empty(max(b.meta["nbytes"] for b in plan.buckets), dtype=torch.uint8, device=device)
    for b in plan.buckets:
        bucket = Bucket(b.meta, ring[: b.meta["nbytes"]], plan.header["format"])
        for u in b.units:
            sender._produce(u, bucket)


@torch.no_grad()
def check_fused(model):
    """The fused kernels against the torch path on 8 real experts of layer 1: bf16 mismatches (an fp32 rounding
    apart at most) and fp8 codes/scales that differ, and the fp8 error against its bound."""
    from moetune.sync import kernels
    from moetune.sync.fp8 import FP8, dequantize, error_bound, quantize

    ex = model.model.layers[1].mlp.experts
    W, A, B, s = ex.gate_up_proj[:8], ex.lora.gate_up_A[:8], ex.lora.gate_up_B[:8], ex.lora.scaling
    ref = torch.matmul(B, A).mul_(s).add_(W)
    out = torch.empty_like(W)
    kernels.merge_experts_(W, out, A, B, s)
    I = W.shape[1] // 2
    q = torch.empty(8, I, W.shape[2], dtype=FP8, device=W.device)
    scale = torch.empty(8, -(-I // 128), -(-W.shape[2] // 128), device=W.device)
    kernels.merge_experts_(W[:, :I], q, A, B[:, :I], s, scale=scale)
    q_ref, s_ref = quantize(ref[:, :I])
    return {"bf16_mismatch_fraction": (out != ref.to(torch.bfloat16)).float().mean().item(),
            "bf16_max_abs_diff": (out.float() - ref.to(torch.bfloat16).float()).abs().max().item(),
            "fp8_code_mismatch_fraction": (q.view(torch.uint8) != q_ref.view(torch.uint8)).float().mean().item(),
            "fp8_scale_max_rel_diff": ((scale - s_ref).abs() / s_ref).max().item(),
            "fp8_within_bound": bool(((dequantize(q, scale) - ref[:, :I]).abs() <= error_bound(ref[:, :I], scale)).all())}


def measure(fn, device, iters, rank):
    """Best of `iters` after a warm-up: (seconds of the slower side, peak bytes of this side, result)."""
    best, peak, out = float("inf"), 0, None
    for i in range(iters + 1):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i > 0:
            best = min(best, dt.item())
            if device.type == "cuda":
                peak = max(peak, torch.cuda.max_memory_allocated(device) - before)
    return best, peak, out


def main():
    a = parse()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if a.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == 2, "run with torchrun --nproc-per-node 2 (rank 0 trainer, rank 1 worker)"
    torch.manual_seed(0)
    cfg = model_config(a)
    port = [None]
    if rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port[0] = s.getsockname()[1]
    dist.broadcast_object_list(port, src=0)
    group = connect(f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{port[0]}", rank, 2, device)

    if rank == 0:
        model = build_trainer_model(cfg, device, a.rank)
        senders = {k: WeightSender(model, group, train_group=None, **kw) for k, kw in
                   {"bf16": dict(format="bf16"), "bf16_base": dict(format="bf16", lora="base"),
                    "fp8": dict(format="fp8")}.items()}
    else:
        model = build_model(cfg, "meta")
        cast_model(model, torch.bfloat16)
        model.to_empty(device=device)
        fp8_worker = Fp8Worker(model)
    rows, stats = {}, {}

    for key in ("bf16", "bf16_base", "fp8"):
        if rank == 0:
            fn = senders[key].sync
        else:
            fn = (lambda: receive(group, fp8_worker)) if key == "fp8" else (lambda: receive(group, ModelUpdater(model)))
        secs, peak, st = measure(fn, device, a.iters, rank)
        stats[key] = st
        rows[f"sync {key}"] = {"seconds": secs, "bytes": st["bytes"], "peak": peak, "tracked_peak": st.get("peak_alloc")}
        if rank == 0:
            rows[f"sync {key}"].update(bound=st["bound"], largest_layer=st["largest_group"], buckets=st["buckets"],
                                       experts_per_unit=st["experts_per_unit"], bucket=st["bucket"])

    for key in ("bf16", "fp8"):
        n = torch.tensor([stats[key]["bytes"]], device=device)
        dist.broadcast(n, src=0)  # the worker learns the sender's byte count (it received the same)
        buf = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
        secs, peak, _ = measure(lambda: group.broadcast(buf).wait(), device, a.iters, rank)
        rows[f"broadcast ({key} bytes)"] = {"seconds": secs, "bytes": int(n.item()), "peak": peak}
        del buf

    # the same bytes in the sync's buckets, two in flight as the sync keeps them: the cost of cutting into buckets
    sizes = [[b.meta["nbytes"] for b in senders["bf16"].plan.buckets] if rank == 0 else None]
    dist.broadcast_object_list(sizes, src=0)
    ring = [torch.empty(max(sizes[0]), dtype=torch.uint8, device=device) for _ in range(2)]

    def bucketed():
        works = [None, None]
        for k, n in enumerate(sizes[0]):
            if works[k % 2] is not None:
                works[k % 2].wait()
            works[k % 2] = group.broadcast(ring[k % 2][:n])
        for w in works:
            w.wait()

    secs, peak, _ = measure(bucketed, device, a.iters, rank)
    rows["broadcast in sync's buckets"] = {"seconds": secs, "bytes": sum(sizes[0]), "peak": peak}
    del ring
    largest = [stats["bf16"]["largest_group"] if rank == 0 else None]  # a layer at a time arrives: one layer's room
    dist.broadcast_object_list(largest, src=0)
    sink = torch.empty(largest[0], dtype=torch.uint8, device=device) if rank == 1 else None
    end = torch.zeros(1, dtype=torch.int64, device=device)

    def naive():
        if rank == 1:
            return gather_everything_recv(group, sink)
        try:
            gather_everything_send(model, group)
        except torch.OutOfMemoryError:  # what this approach does at full width; the worker gets the end marker
            torch.cuda.empty_cache()
            return "out of memory"
        finally:
            group.broadcast(end).wait()

    if not a.no_naive:
        secs, peak, failed = measure(naive, device, max(1, a.iters - 1), rank)
        failed = [failed]
        dist.broadcast_object_list(failed, src=0)
        rows["gather-everything bf16"] = {"seconds": secs, "bytes": rows["sync bf16"]["bytes"], "peak": peak,
                                          "failed": failed[0]}
    del sink
    for key in ("bf16", "fp8"):
        fn = (lambda: pack_only(senders[key], device)) if rank == 0 else (lambda: None)
        secs, peak, _ = measure(fn, device, a.iters, rank)
        rows[f"pack only {key}"] = {"seconds": secs, "bytes": rows[f"sync {key}"]["bytes"], "peak": peak}
    fused = check_fused(model) if rank == 0 and senders["bf16"].kernels is not None else None

    for name, r in rows.items():
        fmt = "fp8" if "fp8" in name else "bf16"
        r["bytes_per_s"] = r["bytes"] / r["seconds"]
        r["ratio_to_broadcast"] = r["bytes_per_s"] / (rows[f"broadcast ({fmt} bytes)"]["bytes"] /
                                                       rows[f"broadcast ({fmt} bytes)"]["seconds"])
    peaks = [None, None]
    dist.all_gather_object(peaks, {k: r["peak"] for k, r in rows.items()})
    if rank == 0:
        report(a, cfg, device, rows, peaks, fused)
    group.close()
    dist.barrier()
    dist.destroy_process_group()


def report(a, cfg, device, rows, peaks, fused):
    shape = a.shape + (f" / {a.scale_down}" if a.scale_down > 1 else "")
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "shapes": shape, "layers": cfg.num_hidden_layers, "lora_rank": a.rank, "fused_check": fused,
           "reference_transient_gib": REFERENCE_GIB.get(a.shape) if a.scale_down == 1 else None,
           "rows": {k: dict(r, peak_sender=peaks[0][k], peak_worker=peaks[1][k]) for k, r in rows.items()}}
    small = rows["sync bf16"]["bytes"] < GiB
    unit, u = (1 << 20, "MiB") if small else (GiB, "GiB")
    print(f"\nweight sync, {shape} × {cfg.num_hidden_layers} layers, {out['device']}")
    print(f"{'':26}{'bytes/s':>12}{'vs bcast':>10}{'seconds':>10}{u + ' wire':>10}{'peak send':>11}{'peak recv':>11}"
          f"{'bound':>9}")
    for k, r in out["rows"].items():
        if r.get("failed"):
            print(f"{k:26}{r['failed']:>12}  (peak send {(r['peak_sender'] or 0) / unit:.2f} {u})")
            continue
        bound = r.get("bound")
        print(f"{k:26}{r['bytes_per_s'] / GiB:>8.2f} GiB{r['ratio_to_broadcast']:>10.2f}{r['seconds']:>10.4f}"
              f"{r['bytes'] / unit:>10.2f}{(r['peak_sender'] or r.get('tracked_peak') or 0) / unit:>11.2f}"
              f"{r['peak_worker'] / unit:>11.2f}{bound / unit if bound else float('nan'):>9.2f}")
    print("\ntransient per sync (= per layer: a sync holds one layer's buckets and staging at a time)")
    for key in ("sync bf16", "sync fp8"):
        r = out["rows"][key]
        sender = r["peak_sender"] or r.get("tracked_peak") or 0
        ref = out["reference_transient_gib"]
        print(f"  {key[5:]:5} largest layer {r['largest_layer'] / unit:.2f} {u}, bound 1.25·L + e {r['bound'] / unit:.2f} {u}:"
              f" sender {sender / unit:.2f} {u} ({sender / r['bound']:.2f} of the bound), worker "
              + (f"{r['peak_worker'] / unit:.2f} {u}" if device.type == "cuda" else "not measured on CPU")
              + (f"; the reference system: {ref} GiB" if ref else ""))
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "weight_sync.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print(f"\n{json.dumps(out)}\nwritten to {path}")


if __name__ == "__main__":
    main()
