"""What a sync sends and in which buckets, from the model's names and shapes alone: every rank of the training group
derives the same plan, hence takes part in the same gathers in the same order.

Groups: the non-layer weights (embeddings, final norm, lm_head) first, then each decoder layer. A group is cut into
buckets of at most `bucket` bytes (a tensor larger than that gets a bucket of its own); buckets never span groups.
Units are whole tensors, or runs of `experts_per_unit` routed experts of one layer, so that a bucket's experts are
consecutive and form one fused section (wire.py).

Memory, by construction (the sender's allocations during a sync; L = wire bytes of the largest group, e = one
expert's bf16 bytes, 3·I·H·2): a ring of two bucket buffers, the header, and the staging of one unit at a time (its
gathered rows and, on the torch path, its fp32 merge/quantize scratch; the CUDA kernels need none). A bucket holds
up to max(min(bucket_bytes, L/4), the largest tensor): the slots must hold the largest tensor anyway, so buckets fill
them (fewer, larger broadcasts). For GLM shapes the largest tensor (lm_head) is ≤ L/2, so the ring is ≤ L (AIR,
bf16: 2 × 1.16 GiB against L = 4.7 GiB). The staging budget is what remains of 1.25·L + e; it decides how many
experts a unit holds and how many rows of a plain tensor are staged at once. So the total stays under 1.25·L + e
whenever one expert's staging (≤ 18·I·H bytes: its rows gathered — fp32, or an fp8 base's fp8 rows and their fp32
dequantisation — + fp32 scratch) fits that remainder, as it does for any GLM-4.5, GLM-4.7-Flash or GLM-5 shape, in
every format (tested; the plan reports its bound and the sender its tracked peak). A weight requantised per 128×128
block is staged 128 rows at a time at least; where that exceeds the remainder (tiny test models only: never at GLM
widths, tested) the bound grows by the difference (`block_shortfall`).
The architecture does not enter: MLA projections and the DSA indexer's weights are plain tensors like any other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moetune.model.quant.fp8 import ROWWISE, Fp8Scheme
from moetune.model.quant.modules import fp8_weights, scale_name
from moetune.names import FUSED_EXPERT_RE as _EXPERTS_RE, INDEXER_FP8_RE, LAYER_RE as _LAYER_RE
from moetune.sync.fp8 import BLOCK, scale_shape
from moetune.sync.wire import VERSION, dtype_name, expert_nbytes, layout_bucket, nbytes

DEFAULT_BUCKET_BYTES = 512 << 20  # full link speed, fine pipelining (raised to the largest tensor, see above)
MAX_EXPERTS_PER_UNIT = 32
FORMATS = ("bf16", "fp8", "fp32", "fp8_rows")
WIRE_SCHEMES = {"row": ROWWISE, "block": Fp8Scheme((BLOCK, BLOCK))}  # an fp8 tensor's scales on the wire, by kind
_KEEP_FP32 = ("e_score_correction_bias",)  # as the hub checkpoints store it


@dataclass
class TensorUnit:
    name: str  # on the wire: the HF checkpoint name (format "adapter": the LoRA parameter's name)
    src: str  # the parameter (or buffer) it is read from
    shape: tuple
    dtype: str  # wire dtype
    lora: tuple | None = None  # (A name, B name, scaling): sent as W + scaling·B·A
    scales: str | None = None  # fp8 on the wire, its scale sent right after it: "row" or "block" (WIRE_SCHEMES)

    @property
    def scale(self) -> str | None:
        """The scale's wire name: `X.weight_scale` [rows, 1] (row) or `X.weight_scale_inv` [⌈rows/128⌉, ⌈cols/128⌉]
        (block), as the checkpoints of each kind name it."""
        return scale_name(self.name, WIRE_SCHEMES[self.scales]) if self.scales else None

    @property
    def scale_shape(self) -> tuple:
        return (self.shape[0], 1) if self.scales == "row" else scale_shape(*self.shape)

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype) + (nbytes(self.scale_shape, "float32") if self.scales else 0)


@dataclass
class ExpertUnit:
    prefix: str  # model.layers.N.mlp.experts
    first: int
    count: int
    I: int
    H: int
    dtype: str  # wire dtype of the weights: bfloat16 or float8_e4m3fn
    lora: dict | None = None  # {"gate_up": (A, B), "down": (A, B), "scaling": s}
    scales: str | None = None  # fp8: "block" (128×128, format fp8) or "row" (format fp8_rows)

    @property
    def nbytes(self) -> int:
        return expert_nbytes(self.count, self.I, self.H, self.dtype, self.scales)

    @property
    def fp8(self) -> bool:
        return self.dtype == "float8_e4m3fn"


@dataclass
class PlannedBucket:
    meta: dict
    units: list


@dataclass
class Plan:
    header: dict
    buckets: list[PlannedBucket]
    largest_group: int  # L
    expert_bf16: int  # e
    bucket: int
    staging_budget: int
    experts_per_unit: int
    block_shortfall: int = 0  # what 128 rows of a block-fp8 weight's staging need beyond the budget (0 at GLM widths)

    @property
    def bound(self) -> int:
        """The sender's allocation bound for this plan: 1.25·L + e (+ the block shortfall, tiny models only)."""
        return int(1.25 * self.largest_group) + self.expert_bf16 + self.block_shortfall

    @property
    def wire_bytes(self) -> int:
        return sum(b.meta["nbytes"] for b in self.buckets)


def lora_sources(model) -> tuple[dict, dict]:
    """({linear weight name: (A, B, scaling)}, {experts prefix: {"gate_up": (A, B), "down": (A, B), "scaling"}})."""
    from moetune.model.glm4_moe import Experts
    from moetune.model.lora import LoRALinear

    linear, experts = {}, {}
    for mname, m in model.named_modules():
        if isinstance(m, LoRALinear):
            linear[f"{mname}.weight"] = (f"{mname}.lora_A", f"{mname}.lora_B", m.scaling)
        elif isinstance(m, Experts) and m.lora is not None:
            p = f"{mname}.lora"
            experts[mname] = {"gate_up": (f"{p}.gate_up_A", f"{p}.gate_up_B"), "down": (f"{p}.down_A", f"{p}.down_B"),
                              "scaling": m.lora.scaling}
    return linear, experts


def _group_key(name: str):
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def build_plan(model, tensors: dict[str, torch.Tensor], fmt: str, lora: str, bucket_bytes: int | None = None,
               max_experts_per_unit: int = MAX_EXPERTS_PER_UNIT) -> Plan:
    """fmt: "bf16" | "fp8" (routed experts, and whatever a block-scaled FP8 base stores in fp8, in 128×128-block
    fp8 with `weight_scale_inv`, requantised after the merge; the rest bf16: an engine serving a block-FP8 release,
    GLM-5's) | "fp32" (everything fp32: an fp32 engine, tests) | "fp8_rows" (what an FP8 base stores in fp8 — row-wise,
    as the compressed-tensors releases — in fp8 with a per-row `weight_scale`, requantised after the merge; the rest
    bf16: an engine serving that release); lora: "merge" | "adapter" | "base"."""
    if fmt not in FORMATS:
        raise ValueError(f"weight sync format {fmt!r}: choose {', '.join(FORMATS)}")
    if lora not in ("merge", "adapter", "base"):
        raise ValueError(f"lora {lora!r}: choose merge (send W + s·B·A), adapter (only the LoRA tensors) or base")
    wire_fp8 = _wire_fp8(model, fmt) if lora != "adapter" else {}
    linear_lora, expert_lora = lora_sources(model)
    if lora == "adapter" and not (linear_lora or expert_lora):
        raise ValueError("lora='adapter' but the model carries no LoRA")
    merge = lora == "merge"
    float_dtype = "float32" if fmt == "fp32" else "bfloat16"

    # pass 1: tensors by group, experts as (prefix, E, I, H) until the unit size is known
    groups: dict = {}
    for name, t in tensors.items():
        is_lora = ".lora" in name
        if is_lora != (lora == "adapter"):
            continue
        items = groups.setdefault(_group_key(name), [])
        m = _EXPERTS_RE.match(name)
        if m and not is_lora:
            if m.group(2) == "gate_up_proj":
                E, twoI, H = t.shape
                items.append((m.group(1), E, twoI // 2, H))
            continue
        keep = name.endswith(_KEEP_FP32) or not t.is_floating_point() or is_lora
        dtype = dtype_name(t.dtype) if keep else float_dtype
        scales = wire_fp8.get(name)
        if scales:
            dtype = "float8_e4m3fn"
        items.append(TensorUnit(name, name, tuple(t.shape), dtype, linear_lora.get(name) if merge else None, scales))

    def expert_format(prefix) -> tuple[str, str | None]:  # (wire dtype, scales) of a layer's routed experts
        if fmt == "fp8":
            return "float8_e4m3fn", "block"
        if f"{prefix}.gate_up_proj" in wire_fp8:
            return "float8_e4m3fn", "row"
        return float_dtype, None

    def size(item):
        if isinstance(item, TensorUnit):
            return item.nbytes
        return expert_nbytes(item[1], item[2], item[3], *expert_format(item[0]))

    sizes = {k: sum(size(i) for i in items) for k, items in groups.items()}
    L = max(sizes.values(), default=0)
    expert_items = [i for items in groups.values() for i in items if isinstance(i, tuple)]
    e = max((3 * I * H * 2 for _, _, I, H in expert_items), default=0)
    largest_tensor = max((i.nbytes for items in groups.values() for i in items if isinstance(i, TensorUnit)), default=0)
    bucket = max(min(bucket_bytes or DEFAULT_BUCKET_BYTES, L // 4), largest_tensor, 1)
    ring = 2 * bucket
    # the header: ~100 JSON bytes a tensor and ~200 a bucket, and there are at most as many buckets as units
    header = 320 * (sum(len(items) for items in groups.values()) + sum(E for _, E, _, _ in expert_items))
    budget = int(1.25 * L) + e - ring - header
    per_expert = max((_expert_staging(tensors, p, I, H, expert_lora.get(p) if merge else None)
                      for p, _, I, H in expert_items), default=1)
    per_expert_wire = max((expert_nbytes(1, I, H, *expert_format(p)) for p, _, I, H in expert_items), default=1)
    c = max(1, min(max_experts_per_unit, budget // per_expert, bucket // per_expert_wire))
    # a weight requantised per 128×128 block is staged whole blocks of rows at a time, never fewer than 128 rows
    block_staging = max((min(u.shape[0], BLOCK) * row_staging(tensors, u) for items in groups.values()
                         for u in items if isinstance(u, TensorUnit) and u.scales == "block"), default=0)

    # pass 2: units, then buckets
    buckets = []
    for key in sorted(groups, key=lambda k: -1 if k is None else k):
        units = [i for i in groups[key] if isinstance(i, TensorUnit)]
        for prefix, E, I, H in (i for i in groups[key] if isinstance(i, tuple)):
            el = expert_lora.get(prefix) if merge else None
            dtype, scales = expert_format(prefix)
            units += [ExpertUnit(prefix, a, min(c, E - a), I, H, dtype, el, scales) for a in range(0, E, c)]
        buckets += _bucketize(key, units, bucket)
    header = {"version": VERSION, "format": "adapter" if lora == "adapter" else fmt,
              "buckets": [b.meta for b in buckets]}
    return Plan(header, buckets, L, e, bucket, budget, c, max(0, block_staging - budget))


def plan_tensors(model, tensors: dict) -> dict:
    """`tensors` (the model's parameters and buffers) less an fp8 base's scales: those travel beside their weights
    (fp8_rows) or not at all (dequantised on the way), never as tensors of their own."""
    scales = {scale_name(w, q) for w, q in fp8_weights(model)}
    return {n: t for n, t in tensors.items() if n not in scales}


def _wire_fp8(model, fmt: str) -> dict[str, str]:
    """{weight: scale kind} of the base weights a format sends in fp8 besides format fp8's routed experts: fp8_rows
    those the base stores in fp8 with one scale per row (it needs such a base), fp8 those it stores block-scaled and,
    then, the DSA indexer's query projection, which the model keeps in bf16 but the block-FP8 releases store (and vLLM
    loads) in fp8."""
    stored = fp8_weights(model)
    if fmt == "fp8":
        out = {name: "block" for name, q in stored if q.block is not None and not _EXPERTS_RE.match(name)}
        if out:
            out.update((name, "block") for name, _ in model.named_parameters() if INDEXER_FP8_RE.search(name))
        return out
    if fmt != "fp8_rows":
        return {}
    if not stored:
        raise ValueError("weight sync format fp8_rows sends the weights an FP8 base stores in fp8, with their per-row "
                         "scales: this model's base is not fp8 (train on the FP8 checkpoint, or model.quantize: fp8)")
    if any(q.block is not None for _, q in stored):
        raise ValueError("weight sync format fp8_rows needs a base stored in fp8 with one scale per row (the "
                         "compressed-tensors releases); this base is block-scaled: sync format fp8 or bf16")
    return {name: "row" for name, _ in stored}


def _expert_staging(tensors, prefix, I, H, lora) -> int:
    """Staging bytes per expert (gate_up, the larger projection): gathered rows in their own dtype + fp32 scratch
    + the LoRA factors in fp32."""
    W = tensors[f"{prefix}.gate_up_proj"]
    r = tensors[lora["gate_up"][0]].shape[1] if lora else 0
    gathered = 1 + 4 if W.element_size() == 1 else W.element_size()  # an fp8 stack: its rows, then dequantised
    return 2 * I * H * (gathered + 4) + 2 * 4 * r * (2 * I + H)


def _bucketize(layer, units, limit) -> list[PlannedBucket]:
    out, current = [], []
    for u in units:
        if current and _layout(layer, current + [u])["nbytes"] > limit:
            out.append(PlannedBucket(_layout(layer, current), current))
            current = []
        current.append(u)
    if current:
        out.append(PlannedBucket(_layout(layer, current), current))
    return out


def _layout(layer, units) -> dict:
    plain = []
    for u in units:
        if isinstance(u, TensorUnit):
            plain.append((u.name, u.dtype, u.shape))
            if u.scales:
                plain.append((u.scale, "float32", u.scale_shape))
    ex = [u for u in units if isinstance(u, ExpertUnit)]
    section = None
    if ex:
        assert all(u.prefix == ex[0].prefix for u in ex)  # one layer's experts, consecutive
        assert ex[-1].first + ex[-1].count - ex[0].first == sum(u.count for u in ex)
        section = {"prefix": ex[0].prefix, "first": ex[0].first, "count": sum(u.count for u in ex),
                   "I": ex[0].I, "H": ex[0].H, "dtype": ex[0].dtype, "scales": ex[0].scales}
    return layout_bucket(layer, plain, section)


def staging_rows(budget: int, tensors, u: TensorUnit) -> int:
    """Rows of a plain unit merged (or requantised) at once within the staging budget."""
    return max(1, budget // row_staging(tensors, u))


def row_staging(tensors, u: TensorUnit) -> int:
    """Staging bytes of one row of a plain unit: its gathered row (an fp8 weight's twice: its fp8 row, then
    dequantised in fp32) + fp32 scratch + B's row in fp32."""
    W = tensors[u.src]
    itemsize = 1 + 4 if W.element_size() == 1 else W.element_size()
    rank = tensors[u.lora[0]].shape[0] if u.lora else 0
    return max(1, math.prod(u.shape[1:]) * (itemsize + 4) + 4 * rank)


__all__ = ["Plan", "PlannedBucket", "TensorUnit", "ExpertUnit", "build_plan", "lora_sources", "plan_tensors",
           "staging_rows",
           "DEFAULT_BUCKET_BYTES"]
