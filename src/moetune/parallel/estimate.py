"""Peak GPU memory of a training step, estimated from the config (for `moetune inspect`; nothing is allocated).

The layout (ep, dp_shard, each layer's activation checkpointing, cpu_offload, whether FSDP shards) is read from
layout.Layout, which calls this for each layout it considers; everything else from the config. Which parameters train
is model/trainable.prepare_trainable's, the function the run's own setup calls.

Notation: P parameters (P_t trainable), S = dp_shard × ep ranks over which FSDP2 shards, b bytes of the compute
dtype (2 for bf16), T = micro_batch_size × seq_len tokens per micro-batch, H hidden, nH/nKV heads, D head_dim,
I dense intermediate, Im expert intermediate, k experts per token, Is shared intermediate, E routed experts,
V vocabulary, c = min(T, 2048) tokens per loss chunk.

Static (per GPU). FSDP2 shards when dp_shard > 1 or with cpu_offload (Layout.fsdp; one process too). Without it
(one process; replicas with dp_shard 1) a rank holds the whole model, but only its 1/ep of the routed experts: there
P below means P - P_experts + P_experts/ep, and S = 1.
  weights    LoRA: frozen base b·P/S, an fp8 base's weights and scales at their own bytes (frozen_bytes: every frozen
             base weight's bytes come from there).
             Full, sharded: fp32 master 4·P/S.  Full without FSDP: b·P (no master copy).
  LoRA       fp32 adapter weights and gradients: (4 + 4)·P_lora/S.
  optimizer  AdamW's two moments in the trainable parameters' dtype: 8·P_t/S (full without FSDP: 2b·P_t).
  gradients  full mode: 4·P_t/S sharded (b·P_t without FSDP); they exist at the end of backward.
  gathered   FSDP2 only: the root unit (embeddings, lm_head, final norm) stays unsharded the whole step, plus two
             units in flight (the one running and the one prefetched), each the larger of a layer's routed experts
             (÷ ep) or the rest of a layer, in the compute dtype (full mode: + their unsharded b + fp32 gradients).
             On a shard group of one (cpu_offload with dp_shard 1) FSDP2 still copies a unit into its unsharded
             buffer, but only when it runs: one unit; the experts split by EP alone are not copied (measured).
  cpu_offload moves weights, gradients and optimizer state to host memory (an fp8 base's shards as stored): only
             "gathered" stays on the GPU, + on a shard group of several the shard each all-gather first copies in
             from the host (1/S of a unit; not measured). What stays in host memory, per rank: host_bytes, with
             torch's pinned allocator's rounding of each shard up to a power of two; a GPU run's layout checks it
             against the node's RAM.
Activations (what each layer saves for backward, per token, by the module that saves it, under each recompute mode
and expert parallelism): activations.py, checked against a census of saved tensors.
Working set on top of the saved activations, at the start of backward: one MoE layer's backward
  (2b·k·H + 10·k·Im per token: gradients of the permuted rows, of the expert output and of the fp32 SwiGLU), or the
  loss's forward: 2b·c·V (a chunk's logits and their gradient; model/loss.py's loop unbinds the previous chunk's
  gradient before making the next: tests/unit/test_loss_memory.py); when lm_head trains, the larger of that plus its
  fp32 gradient kept from the forward (4VH) and, at the start of backward, that gradient with the backward's fp32
  product and bf16 cast (10VH). The loss's chunks are gone when backward starts: the larger of the two counts (until
  2026-12, both were added as a margin; the loop then held a third chunk, seen on GLM-4.7-Flash on an H200: 75.50 GiB
  measured without recompute, 74.89 once it was unbound).
Peak = static + max(saved activations + working set [+ gradients when grad_accum > 1], gradients).

Calibration (AIR-8 proxy, 4 × 1024 tokens, bf16, no activation checkpointing, 1 H200, torch max_memory_allocated):
  LoRA q,k,v,o, torch.compile:   measured 39.2 GiB, estimated 39.2 GiB (+0.1 %)
  LoRA q,k,v,o, eager:           measured 43.4 GiB before 82752e3a (the eager SwiGLU then kept 3 more tensors per
                                 row), estimated 40.1 GiB for today's code: not re-measured
  full fine-tuning, 2 layers:    measured 29.5 GiB, estimated 29.6 GiB compiled (+0.4 %), 30.3 GiB eager (+2.6 %)
GLM-4.7-Flash (full size, 1 H200, torch 2.11, LoRA r16 on every MLA projection, 1 × 4096, compiled): no recompute
measured 74.89 GiB (moetune train, packed, 2026-12-02, two loss chunks), estimated 74.90; with the loss loop's third
chunk, 75.50 measured and 75.47 estimated; attention on 29 layers, none on 18: measured 68.59, estimated 68.82 (with
the third chunk; 74.48 and 68.28 before the compiled attention's normed input and that chunk were counted).
Full-size GLM-4.5-Air on an fp8 base, 1 H200, torch 2.11, compiled, 1 × 4096 packed, moetune train: LoRA q,k,v,o,
layout auto (no recompute) measured 126.0 GiB, estimated 126.9; LoRA also on the shared and routed experts, auto's
{full: 23, attention: 23} measured 131.9, estimated 132.5 (before the compiled `full` tagged the ops inside the fp8
autograd.Functions, model/recompute.full_checkpoint_context, the same run kept 11.7 GiB more; before the LoRA
gradients were counted from backward on, the estimate was 4.4 GiB higher and auto chose {full: 31, attention: 15}).
Weights are 33.3 of the 39.2 GiB (LoRA) and 21.4 of the 29.5 GiB (full, with the optimizer), so these figures test
the activation terms much less than the totals suggest: the activation + working-set part alone is 5.9 GiB measured
vs 5.9 estimated (compiled) and 10.0 vs 8.5 (eager, -15 %, before 82752e3a). The compiled formula was written
knowing the compiled figure. tests/unit/test_observability_inspect.py pins these and checks the eager per-layer
formula against a census of the tensors autograd saves.
Multi-GPU (full-size GLM-4.5-Air, 2 × H200, seq 4096 packed, LoRA q,k,v,o, full activation checkpointing, eager,
issue 11's table measured at d05efb6): FSDP micro-batch 1 measured 113.7 GiB, estimated 114.8 (+1.0 %); micro-batch 4
123.0 / 124.6 (+1.3 %); LoRA also on the experts 121.4 / 123.9 (+2.0 %). These are dominated by the weights (99.5
GiB). On the AIR-8 proxy (2 GPUs, compiled, 4 × 1024): FSDP measured 31.8 / estimated 33.1 GiB, dp_shard 1
(replicated) 44.4 / 45.7; one GPU, selective checkpointing, compiled: 42.1 measured when selective kept LoRA's
full-width B outputs (estimated 42.0 for that policy); since it recomputes them (rank ≤ 64) estimated 40.9, not
re-measured. The EP measurements of the
same table (full Air ep 2: 108.0 GiB; AIR-8 ep 2: 28.7) are of the exchange before a6764f9, which kept nothing.
The token exchange (c6b0d86f, BENCHMARKS.md), full Air, ep 2, compiled, LoRA q,k,v,o + shared + routed experts, full
checkpointing, 1 × 4096: measured 122.4 GiB, estimated 125.9 (+2.8 %; 127.5 before the compiled MoE half's bf16 norm
input and the two-piece recompute under EP were counted). Of the 3.5 GiB over, 1.1 is the layer working set added
to the loss's (the margin above), 0.3 the skew margin, the rest not located. Not measured: the exchange without
recompute of trainable experts (recipes since 1bfb026b), attention checkpointing, cpu_offload.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from moetune.names import INDEXER_CHUNK_SCORES, LOSS_CHUNK_TOKENS
from moetune.parallel.ac_modes import describe
from moetune.parallel.activations import (activation_bytes_per_token, ep_layer_bytes_per_token, ep_skew,
                                          expert_row_bytes_per_token, layer_halves, ranks_per_token, receives_topk,
                                          sparse_attention)

GIB = 2**30
# A layout fits when its estimate is under this share of the GPU's memory: the rest is the CUDA context, NCCL's
# buffers and allocator fragmentation, which torch.cuda.max_memory_allocated (what we estimate) does not see.
# Measured: full-size Air, ep 2 on 2 × H200 without recompute: 132.1 GiB of 139.8 allocated at peak (94.5%), ran
# (5,057 tokens/s per GPU, the exchange at 82752e3a; today's estimate of that run is 132.6).
FIT_FRACTION = 0.95
# torch.cuda.get_device_properties(0).total_memory of common GPUs, GiB: what `moetune inspect` chooses for when it has
# no memory to choose for. H100 and H200 as measured in this project; B200 from nvidia-smi's 183,359 MiB (not measured
# here with torch, which reports a little less than nvidia-smi: 139.8 against 140.4 GiB on the H200).
COMMON_GPUS = {"H100/A100 80GB": 79.1, "H200 141GB": 139.8, "B200 192GB": 178.4}


@dataclass(frozen=True)
class Frozen:
    """Frozen parameters of a group: the elements kept in the compute dtype (2-D weights, 3-D expert stacks, norms,
    biases: `plain`), and those whose storage is fixed whatever the compute dtype — an fp8 base's weights (1 byte)
    and their fp32 scales (model/quant): `stored` elements taking `stored_bytes`."""

    plain: float = 0
    stored: float = 0
    stored_bytes: float = 0

    @property
    def numel(self) -> float:
        return self.plain + self.stored

    def __add__(self, other: "Frozen") -> "Frozen":
        return Frozen(self.plain + other.plain, self.stored + other.stored, self.stored_bytes + other.stored_bytes)

    def __sub__(self, other: "Frozen") -> "Frozen":
        return Frozen(self.plain - other.plain, self.stored - other.stored, self.stored_bytes - other.stored_bytes)

    def __truediv__(self, k: float) -> "Frozen":
        return Frozen(self.plain / k, self.stored / k, self.stored_bytes / k)

    @staticmethod
    def of(params) -> "Frozen":
        out = Frozen()
        for p in params:
            if p.requires_grad:
                continue
            n = p.numel()
            out += Frozen(0, n, n * p.element_size()) if is_fp8_storage(p) else Frozen(n, 0, 0)
        return out


def is_fp8_storage(p) -> bool:
    """An fp8 base's weight or scale (its bytes do not depend on the compute dtype)."""
    return p.element_size() == 1 or getattr(p, "fp8_scale", False)


def frozen_bytes(f: Frozen, dtype_bytes: int) -> float:
    """Bytes of a group's frozen parameters: the compute dtype's `dtype_bytes` each, an fp8 base's as stored. Every
    frozen base weight the estimate counts (static, FSDP's gathered units) goes through here."""
    return dtype_bytes * f.plain + f.stored_bytes


@dataclass
class ParamCounts:
    total: int
    trainable: int
    lora: int
    root: int  # embeddings, lm_head, final norm: FSDP's root unit
    max_expert_unit: int  # one layer's routed experts
    max_layer_rest: int  # the rest of one layer
    lm_head_trains: bool
    experts: int = 0  # all routed experts (base and their LoRA)
    experts_trainable: int = 0
    experts_lora: int = 0
    # the frozen part of: the whole model, all routed experts, the root unit, the units max_expert_unit and
    # max_layer_rest count
    frozen: Frozen = Frozen()
    experts_frozen: Frozen = Frozen()
    root_frozen: Frozen = Frozen()
    expert_unit_frozen: Frozen = Frozen()
    layer_rest_frozen: Frozen = Frozen()
    # every parameter as FSDP2 shards it (dim 0), for what CPU offload keeps in host memory (host_bytes)
    tensors: tuple[TensorShape, ...] = ()
    # the row-scaled fp8 weights' bytes, all and those of the routed experts: what their kept transposed copies take
    # (Layout.fp8_copies)
    fp8_copy_bytes: float = 0
    fp8_copy_expert_bytes: float = 0


@dataclass(frozen=True)
class TensorShape:
    """A parameter as host_bytes needs it: its rows (dim 0, what FSDP2 shards), elements, bytes per element when
    its storage is fixed (an fp8 base's weights and scales; 0: the compute dtype, or fp32 when it trains)."""

    rows: int
    numel: int
    stored_bytes: int
    trainable: bool
    expert: bool


@dataclass
class Estimate:
    rows: list[tuple[str, float, str]]  # (component, GiB, how it was counted)
    total_gib: float
    phase: str  # which phase is the peak
    notes: list[str] = field(default_factory=list)
    host_gib: float = 0.0  # cpu_offload: host memory per rank as allocated (host_bytes), else 0


def count_params(model) -> ParamCounts:
    """Parameter counts of a built model (meta device is fine), LoRA applied or trainability set."""
    total = trainable = lora = root = experts_trainable = experts_lora = 0
    expert_units, rests = [(0, Frozen())], [(0, Frozen())]
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        trainable += n if p.requires_grad else 0
        lora += n if ".lora" in name else 0
        if not name.startswith("model.layers."):
            root += n
        if ".mlp.experts." in name:
            experts_trainable += n if p.requires_grad else 0
            experts_lora += n if ".lora" in name else 0
    for layer in model.model.layers:
        ex = getattr(layer.mlp, "experts", None)
        ex_params = list(ex.parameters()) if ex is not None else []
        ex_ids = {id(p) for p in ex_params}
        rest = [p for p in layer.parameters() if id(p) not in ex_ids]
        expert_units.append((sum(p.numel() for p in ex_params), Frozen.of(ex_params)))
        rests.append((sum(p.numel() for p in rest), Frozen.of(rest)))
    unit, rest = max(expert_units, key=lambda t: t[0]), max(rests, key=lambda t: t[0])
    params = dict(model.named_parameters())
    tensors = tuple(TensorShape(p.shape[0] if p.dim() else 1, p.numel(),
                                p.element_size() if is_fp8_storage(p) and not p.requires_grad else 0,
                                p.requires_grad, ".mlp.experts." in n) for n, p in params.items())
    from moetune.model.quant.modules import fp8_weights

    copies = [(n, params[n].numel()) for n, scheme in fp8_weights(model) if scheme.block is None]
    return ParamCounts(total, trainable, lora, root, unit[0], rest[0], model.lm_head.weight.requires_grad,
                       sum(e for e, _ in expert_units), experts_trainable, experts_lora,
                       frozen=Frozen.of(params.values()),
                       experts_frozen=Frozen.of(p for n, p in params.items() if ".mlp.experts." in n),
                       root_frozen=Frozen.of(p for n, p in params.items() if not n.startswith("model.layers.")),
                       expert_unit_frozen=unit[1], layer_rest_frozen=rest[1], tensors=tensors,
                       fp8_copy_bytes=sum(n for _, n in copies),
                       fp8_copy_expert_bytes=sum(n for name, n in copies if ".mlp.experts." in name))


def gathers_expert_inputs(cfg, counts: ParamCounts) -> bool:
    """Whether a GPU run's routed experts read their LoRA rows through the token map inside the grouped GEMMs
    (model/experts.py's gathers_in_gemm, whose settings part decides here) and so keep the tokens, not the expanded
    rows, for A's gradient. Off the GPU the rows are expanded; the estimate is a GPU's."""
    from moetune.model import experts

    return (cfg.finetune.mode != "full" and "experts" in cfg.lora.targets and cfg.model.dtype == "bfloat16"
            and experts.gathers_in_gemm_settings(counts.experts_frozen.stored > 0, cfg.lora.rank,
                                                 bool(cfg.lora.dropout)))


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else n


def host_bytes(counts: ParamCounts, layout, b: int) -> tuple[float, float]:
    """(bytes, bytes as allocated) per rank that CPU offload keeps in host memory: each parameter's shard as FSDP2
    pads it (dim 0 rounded up to a multiple of the shard group; routed experts split by ep first), at its own bytes
    (an fp8 base's weights 1, their scales 4, the rest of the frozen base b, what trains fp32), and for what trains
    its fp32 gradient and AdamW's two fp32 moments. With a GPU FSDP2 pins the shards (and the gradients it copies
    back), and torch's pinned allocator (CachingHostAllocator) rounds each allocation up to a power of two unless
    PYTORCH_ALLOC_CONF sets pinned_max_round_threshold_mb: the second figure (GLM-5's expert shards over 8 ranks, 768
    and 384 MiB, take 1024 and 512)."""
    exact = allocated = 0
    for t in counts.tensors:
        rows, group = t.rows, layout.shard_size
        if t.expert and layout.ep > 1:
            rows, group = rows // layout.ep, layout.dp_shard
        shard = -(-rows // group) * (t.numel // max(t.rows, 1))  # elements of the padded shard
        nbytes = shard * (4 if t.trainable else t.stored_bytes or b)
        exact, allocated = exact + nbytes, allocated + _pow2(nbytes)
        if t.trainable:  # the gradient (pinned, as FSDP2 copies it back) and AdamW's moments (pageable)
            exact, allocated = exact + 12 * shard, allocated + _pow2(4 * shard) + 8 * shard
    return exact, allocated


def build_meta_model(cfg, m):
    """The model as `train` builds it (meta device, no memory), its trainable parameters marked by the same
    prepare_trainable."""
    from moetune.model.hf_io import build_model, checkpoint_reader
    from moetune.model.quant.checkpoint import prepare_fp8_base
    from moetune.model.trainable import prepare_trainable

    model = build_model(m, "meta")
    if cfg.finetune.mode != "full":  # the frozen base as the run stores it (fp8 for model.quantize or an FP8 checkpoint)
        path = cfg.model.path
        has_weights = path and os.path.isdir(path) and any(f.endswith(".safetensors") for f in os.listdir(path))
        prepare_fp8_base(model, checkpoint_reader(path) if has_weights else None, cfg.model.quantize)
    prepare_trainable(model, cfg)
    return model


def estimate_memory(cfg, m, counts: ParamCounts, layout) -> Estimate:
    """Peak memory per GPU of `cfg` (Config) laid out as `layout` (layout.Layout: world size, ep, dp_shard, whether
    FSDP shards, each layer's activation checkpointing, cpu_offload) for the model config `m` (the frozen base as
    `counts` found it: an fp8 base's weights and scales at their own bytes)."""
    b = 2 if cfg.model.dtype == "bfloat16" else 4
    full = cfg.finetune.mode == "full"
    world_size, ep, dp_shard = layout.world_size, layout.ep, layout.dp_shard
    fsdp, S, offload = layout.fsdp, layout.shard_size, layout.cpu_offload
    skew = ep_skew(ep)
    T = cfg.train.micro_batch_size * cfg.data.seq_len
    c = min(T, LOSS_CHUNK_TOKENS)
    V, H = m.vocab_size, m.hidden_size
    lora = set(cfg.lora.targets) if not full else set()
    rows, notes = [], []

    def add(name, nbytes, how):
        rows.append((name, nbytes / GIB, how))
        return nbytes

    # ---- static
    if fsdp:
        P, P_t, P_lora, per = counts.total / S, counts.trainable / S, counts.lora / S, f"/{S}"
    else:  # the experts split by ep (1: whole), the rest whole
        P, P_t, P_lora = (n - e + e / ep for n, e in ((counts.total, counts.experts),
                                                      (counts.trainable, counts.experts_trainable),
                                                      (counts.lora, counts.experts_lora)))
        per = f" (experts /{ep})" if ep > 1 else ""
    if full and not fsdp:
        where = "one process" if world_size == 1 else "replicas without FSDP"
        w = add("weights", b * P, f"{b}·P{per}, {where}: the {cfg.model.dtype} weights are the master copy")
        grads = b * P_t
        add("optimizer", 2 * b * P_t, f"AdamW moments in {cfg.model.dtype}: 2·{b}·P_trainable{per}")
    elif full:
        w = add("weights", 4 * P, f"fp32 master weights sharded: 4·P{per}")
        grads = 4 * P_t
        add("optimizer", 8 * P_t, f"AdamW moments fp32: 8·P_trainable{per}")
    else:
        frozen = counts.frozen / S if fsdp else counts.frozen - counts.experts_frozen + counts.experts_frozen / ep
        stored = f"{b}·P" if not frozen.stored else f"fp8 base: 1 byte per weight + fp32 scales, the rest {b}·P"
        w = add("weights", frozen_bytes(frozen, b), f"frozen base: {stored}{per}")
        add("LoRA", 4 * P_lora, f"fp32 adapter weights: 4·P_lora{per}")
        # set to None after each update (zero_grad): none at the start of a step's backward unless micro-batches
        # accumulate; expert LoRA of full-size Air: 4.4 GiB counted at the start of backward until 2026-12
        grads = 0 if offload else 4 * P_lora
        add("optimizer", 8 * P_lora, f"AdamW moments fp32: 8·P_lora{per}")
        notes.append(f"the bad-step rollback copies the LoRA state to host memory, twice: "
                     f"~{24 * P_lora / GIB:.1f} GiB per rank (train/bad_steps.py)")
    if layout.fp8_copies:
        add("fp8 transposed copies", counts.fp8_copy_bytes - counts.fp8_copy_expert_bytes
            + counts.fp8_copy_expert_bytes / ep, f"the row-scaled fp8 weights once more, transposed{per}")
    static = sum(r[1] for r in rows) * GIB
    host = 0.0
    if offload:
        static = 0
        rows = [(name, gib, how + " — in host memory (cpu_offload), not on the GPU") for name, gib, how in rows]
        exact, host = host_bytes(counts, layout, b)
        as_stored = ", fp8 as stored" if counts.frozen.stored else ""
        notes.append(f"parallel.cpu_offload: weights, gradients and optimizer state live in host memory, "
                     f"{exact / GIB:.1f} GiB per rank ({S} shards{as_stored}); "
                     f"pinned by FSDP2, whose allocator rounds each shard up to a power of two: "
                     f"~{host / GIB:.1f} GiB per rank allocated, × the ranks on a node")
        notes.append(f"parallel.cpu_offload: each micro-batch every rank copies its shards to the GPU twice (forward, "
                     f"backward: {2 * w / GIB:.1f} GiB over PCIe) and its gradients back "
                     f"({(grads if full else 4 * P_lora) / GIB:.2f} GiB{'' if full else ', once per step'})")
    gathered = 0
    if fsdp:
        # Experts shard over dp_shard only under EP (ep already split them), else with the rest over S. On a group of
        # one FSDP2 copies a unit into its unsharded buffer when the unit runs, so nothing prefetched is in flight;
        # the EP experts on a dp_shard of 1 are measured not to be copied at all. Gathered in the compute dtype (the
        # frozen base as stored); full mode adds each unit's unsharded fp32 gradient and its compute-dtype copy.
        def unit_bytes(numel, frozen_part):
            return frozen_bytes(frozen_part, b) + b * (numel - frozen_part.numel) + (
                (b + 4) * numel if full else 0)

        in_flight = 2 if S > 1 else 1
        expert_copies = 0 if ep > 1 and dp_shard == 1 else (2 if dp_shard > 1 else 1) / ep
        if offload and ep > 1 and dp_shard == 1:  # offloaded, they are copied in like any unit (not measured)
            expert_copies = in_flight / ep
        expert_unit = unit_bytes(counts.max_expert_unit, counts.expert_unit_frozen)
        rest_unit = unit_bytes(counts.max_layer_rest, counts.layer_rest_frozen)
        units = max(expert_copies * expert_unit, in_flight * rest_unit)
        root = frozen_bytes(counts.root_frozen, b) + b * (counts.root - counts.root_frozen.numel)
        how = "root unit (embeddings, lm_head) + the layer units in flight, unsharded"
        if offload and S > 1:
            # the all-gather's input is the host shard copied to the GPU first, as stored (an fp8 base's weights
            # 1 byte, what trains fp32), alive until it is copied into the gather's buffer: 1/S of the largest unit
            # (not measured; on a group of one the single unit above was measured, copy included)
            def stored(numel, frozen_part):
                return frozen_bytes(frozen_part, b) + 4 * (numel - frozen_part.numel)

            units += max(stored(counts.max_expert_unit, counts.expert_unit_frozen) if expert_copies else 0,
                         stored(counts.max_layer_rest, counts.layer_rest_frozen)) / S
            how += " + the shard copied in from the host for the gather"
        gathered = add("FSDP gathered", root + units, how)
    if full:
        add("gradients", grads, "full mode: present at the end of backward")
    elif grads:
        add("gradients", grads, f"LoRA, fp32: 4·P_lora{per}, from backward on (with grad_accum > 1 the forward too)")

    # ---- activations of one micro-batch
    mode = "compiled" if cfg.train.compile else "eager"
    seq, L, rank = cfg.data.seq_len, m.num_hidden_layers, cfg.lora.rank
    modes = layout.recompute  # each layer's activation checkpointing
    split = ep > 1  # recompute.split_modes: under EP a MoE layer recomputes its attention and expert work apart
    n_moe = sum(m.is_moe_layer(i) for i in range(L))
    # the local path's experts keep the tokens for their LoRA (under EP they keep the rows received either way)
    token_rows = not split and gathers_expert_inputs(cfg, counts)

    def layer_bytes(i):
        ac = modes[i]
        moe, first, topk_in = m.is_moe_layer(i), i == 0, receives_topk(m, i, seq) and ac != "none"
        if moe and split:
            return ep_layer_bytes_per_token(m, mode, ac, b, lora, full, ep, first, rank, seq, topk_in)
        return activation_bytes_per_token(m, moe, "selective" if ac == "selective" else mode, b, lora, full, first,
                                          rank, seq, ac, topk_in, token_rows)

    def recomputed(i):  # what one layer's recompute holds at once in backward
        ac, moe, first = modes[i], m.is_moe_layer(i), i == 0
        attn, mlp = layer_halves(m, moe, mode, b, lora, full, first, rank, seq, token_rows)
        if ac == "attention":
            return attn
        if ac != "full":
            return 0
        if not (moe and split):
            return attn + mlp
        experts = full or "experts" in lora  # frozen experts are not recomputed
        return max(attn, skew * expert_row_bytes_per_token(m, "eager", b, lora, full, rank) if experts else 0)

    per_layer = [layer_bytes(i) for i in range(L)]
    saved = T * (sum(per_layer) + max(recomputed(i) for i in range(L)))
    ac = layout.activation_checkpointing
    if not isinstance(ac, str):
        how = f"per layer ({describe(ac)}): {sum(per_layer) / L / (b * H):.1f}·{b}H per token·layer on average, " \
              "+ one layer's recompute"
    elif ac == "full":
        how = f"full checkpointing: layer inputs {b}·H·T·L + one layer recomputed"
    elif ac == "attention":
        how = f"attention checkpointing: layer inputs + the MLP/MoE halves ({mode}), " \
              f"{sum(per_layer) / L / (b * H):.1f}·{b}H per token·layer, + one attention block recomputed"
    elif ac == "selective":
        how = f"selective checkpointing: GEMM/attention outputs, {sum(per_layer) / L / (b * H):.1f}·{b}H per token·layer"
    else:
        how = f"{mode}: {sum(per_layer) / L / (b * H):.1f}·{b}H bytes per token·layer × T={T:,}"
    # final norm (+ its weight's input in full mode), the loss's input gradient, RoPE's cos/sin (shared by the layers)
    saved += T * (4 * H + (b * H if full else 0) + b * H + 2 * b * m.rotary_dim)
    if sparse_attention(m, seq):
        saved += T * seq  # the document-causal boolean mask every DSA layer selects within (one for all layers)
    if split and n_moe:
        how += f"; ep {ep}: expert rows × {skew:.2f} (routing skew margin)"
    add("activations", saved, how)
    k, Im = m.num_experts_per_tok, m.moe_intermediate_size
    layer_ws = T * (2 * b * k * H + 10 * k * Im) if m.n_routed_experts else T * 4 * b * m.intermediate_size
    ws_how = "one MoE layer's backward: 2b·k·H + 10·k·Im per token"
    if ep > 1 and n_moe:
        layer_ws = skew * (layer_ws + T * b * H * ranks_per_token(m, ep))
        ws_how += f", + the rows received (b·H per token and rank it reaches), × {skew:.2f} (skew)"
    if counts.frozen.stored and m.n_routed_experts:
        # the input gradient through an fp8 expert stack (model/quant/matmul.py): the stack transposed (fp8; unless
        # the layout keeps the copies) and the gradient rows with the weight's row scales folded in (fp32), for
        # gate_up, the larger of the two
        stack = 0 if layout.fp8_copies else 2 * Im * H * m.n_routed_experts / ep
        layer_ws += stack + T * k * 2 * Im * 4
        ws_how += ("; fp8 base: + the folded gradient rows (4·k·2Im per token)" if layout.fp8_copies else
                   "; fp8 base: + the gate_up stack transposed (1 byte) + the folded gradient rows (4·k·2Im per token)")
    if full and counts.lm_head_trains:  # the forward's chunks and the backward's cast do not coexist: the larger
        logits = max(2 * b * c * V + 4 * V * H, 10 * V * H)
        how = f"lm_head trains: max(a chunk's logits + their gradient 2·{b}·c·V + fp32 gradient 4VH, backward 10VH)"
    else:
        logits = 2 * b * c * V
        how = f"a {c}-token chunk of logits + their gradient: 2·{b}·c·V"
    add("logits / loss", logits, how)
    add("backward working set", layer_ws, ws_how)
    # The loss's chunks are freed when its forward returns, before backward starts: the larger of the two
    transient = max(logits, layer_ws)
    if sparse_attention(m, seq):
        # DSA in the forward (the loss and backward buffers do not exist yet): a chunk of the indexer's fp32
        # scores, its top-k indices (int64), the selection and the selected mask (bool), the mask as float bias
        mb = cfg.train.micro_batch_size
        indexer = 4 * INDEXER_CHUNK_SCORES + mb * seq * (8 * min(m.index_topk, seq) + (2 + b) * seq)
        add("DSA indexer (forward)", indexer, "fp32 score chunk + top-k indices + masks, while the forward runs: "
            "the larger of this and the two rows above counts")
        transient = max(transient, indexer)

    forward = static + gathered + saved + transient + (grads if cfg.train.grad_accum > 1 else 0)
    end = static + gathered + grads
    total, phase = (forward, "start of backward") if forward >= end else (end, "end of backward (gradients)")
    return Estimate(rows, total / GIB, phase, notes, host / GIB)


def format_estimate(e: Estimate) -> str:
    lines = [f"  {'component':<22}{'GiB':>9}  how"]
    lines += [f"  {name:<22}{gib:>9.2f}  {how}" for name, gib, how in e.rows]
    lines.append(f"  {'peak (estimate)':<22}{e.total_gib:>9.2f}  at the {e.phase}; as torch.cuda.max_memory_allocated: "
                 "without the CUDA context (~0.5-1 GiB) and allocator fragmentation")
    if abs(sum(r[1] for r in e.rows) - e.total_gib) > 0.01:
        lines.append("  (not the sum of the components: gradients and activations are not held at the same time)")
    fits = ", ".join(f"{name} ({cap} GiB): {'fits' if e.total_gib <= FIT_FRACTION * cap else 'does NOT fit'}"
                     for name, cap in COMMON_GPUS.items())
    lines.append(f"  {fits} (under {FIT_FRACTION:.0%} of the memory)")
    lines += [f"  note: {n}" for n in e.notes]
    return "\n".join(lines)
