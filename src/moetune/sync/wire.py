"""The wire format of a weight sync, shared by the sender (which lays buckets out) and the receivers (which cut them up).

A sync is, on the sync group, a series of broadcasts from rank 0:
    1. the header's length (one int64), 2. the header (uint8 UTF-8 JSON), 3. each bucket's bytes (one flat uint8
    buffer per bucket, in the header's order).
The header describes the whole sync up front, so a receiver allocates its buffers once and posts the next bucket's
receive while it loads the last one; nothing but bucket bytes flows after it.

    {"version": 1, "format": "bf16" | "fp8" | "fp8_rows" | "fp32" | "adapter", "buckets": [
        {"layer": null | N, "nbytes": int,
         "tensors": [[name, dtype, shape, offset], ...],
         "experts": null | {"prefix": "model.layers.N.mlp.experts", "first": a, "count": n, "I": I, "H": H,
                            "dtype": ..., "scales": null | "block" | "row",
                            "w13": offset, "w2": offset, "w13_scale": offset | null, "w2_scale": ...}}]}

`tensors` are whole tensors under HF checkpoint names (format "adapter": moetune's LoRA parameter names, fp32).
A bucket belongs to one layer (null: embeddings, final norm, lm_head — sent first) and holds at most one `experts`
section: routed experts a..a+n-1 in the fused layout of inference MoE kernels,
    w13 [n, 2I, H] (each expert's gate rows, then its up rows), w2 [n, H, I],
and for fp8 their block scales (format fp8: fp32 `weight_scale_inv`, see fp8.py), gate and up blocked separately so
that each keeps the scale grid of its own HF tensor:
    w13_scale [n, 2⌈I/128⌉, ⌈H/128⌉], w2_scale [n, ⌈H/128⌉, ⌈I/128⌉],
or their row scales (format fp8_rows, the compressed-tensors layout: fp32 `weight_scale`, one per output row):
    w13_scale [n, 2I, 1], w2_scale [n, H, 1].
Format fp8_rows sends a plain fp8 weight `X.weight` with its row scale `X.weight_scale` [rows, 1] right after it,
format fp8 (from a block-scaled base) with its block scales `X.weight_scale_inv` [⌈rows/128⌉, ⌈cols/128⌉].
The HF per-expert tensors are views of the section: experts.{e}.gate_proj.weight = w13[e-a, :I], up_proj = w13[e-a,
I:], down_proj = w2[e-a], and their `.weight_scale_inv` likewise — what vLLM's load_weights expects of bf16 and
block-fp8 GLM-4.5 checkpoints. MLA models (GLM-4.7-Flash, GLM-5) send their checkpoint names too (q_a_proj,
kv_a_proj_with_mqa, indexer.wk, ...): vLLM's load_weights packs them (fused_qkv_a_proj, wk_weights_proj) itself.
"""

from __future__ import annotations

import json
import math

import torch

from moetune.sync.fp8 import FP8, scale_shape

VERSION = 1
ALIGN = 64  # every tensor and section starts on a 64-byte boundary: any dtype view is aligned, copies vectorise
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float8_e4m3fn": FP8}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def nbytes(shape, dtype) -> int:
    return math.prod(shape) * (DTYPES[dtype] if isinstance(dtype, str) else dtype).itemsize


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# ------------------------------------------------------------------------------------------------ header
def encode_header(header: dict, device) -> torch.Tensor:
    data = json.dumps(header, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def decode_header(t: torch.Tensor) -> dict:
    header = json.loads(bytes(t.cpu().numpy()).decode())
    if header.get("version") != VERSION:
        raise ValueError(f"weight sync header version {header.get('version')}, this receiver reads {VERSION}: "
                         "update moetune on one side")
    return header


# ------------------------------------------------------------------------------------------------ layout
def section_scales(sec: dict) -> str | None:
    """An expert section's scale kind: None (bf16/fp32), "block" or "row" (headers without the key: block fp8)."""
    if sec["dtype"] != "float8_e4m3fn":
        return None
    return sec.get("scales") or "block"


def expert_shapes(count: int, I: int, H: int, scales: str | None) -> dict:
    """Section part -> shape, in layout order."""
    shapes = {"w13": (count, 2 * I, H), "w2": (count, H, I)}
    if scales == "block":
        nI, nH = scale_shape(I, H)
        shapes["w13_scale"] = (count, 2 * nI, nH)
        shapes["w2_scale"] = (count, *scale_shape(H, I))
    elif scales == "row":
        shapes["w13_scale"] = (count, 2 * I, 1)
        shapes["w2_scale"] = (count, H, 1)
    return shapes


def expert_nbytes(count: int, I: int, H: int, dtype: str, scales: str | None) -> int:
    shapes = expert_shapes(count, I, H, scales)
    return sum(nbytes(s, "float32" if part.endswith("_scale") else dtype) for part, s in shapes.items())


def layout_bucket(layer, tensors, experts: dict | None) -> dict:
    """Bucket metadata for `tensors` [(name, dtype, shape)] and an optional expert section
    {prefix, first, count, I, H, dtype}: offsets assigned in order, plain tensors first."""
    off, placed = 0, []
    for name, dtype, shape in tensors:
        placed.append([name, dtype, list(shape), off])
        off = align(off + nbytes(shape, dtype))
    section = None
    if experts is not None:
        section = dict(experts, w13_scale=None, w2_scale=None)
        for part, shape in expert_shapes(experts["count"], experts["I"], experts["H"], section_scales(experts)).items():
            section[part] = off
            off = align(off + nbytes(shape, "float32" if part.endswith("_scale") else experts["dtype"]))
    return {"layer": layer, "nbytes": off, "tensors": placed, "experts": section}


def _view(buf: torch.Tensor, offset: int, dtype: str, shape) -> torch.Tensor:
    return buf[offset: offset + nbytes(shape, dtype)].view(DTYPES[dtype]).view(shape)


class ExpertSlabs:
    """The expert section of one bucket as tensors (views of the bucket's buffer)."""

    def __init__(self, sec: dict, buf: torch.Tensor):
        self.prefix, self.first, self.count, self.I, self.H = sec["prefix"], sec["first"], sec["count"], sec["I"], sec["H"]
        self.scales = section_scales(sec)
        self.fp8 = self.scales is not None
        shapes = expert_shapes(self.count, self.I, self.H, self.scales)
        part = {p: _view(buf, sec[p], "float32" if p.endswith("_scale") else sec["dtype"], s) for p, s in shapes.items()}
        self.w13, self.w2 = part["w13"], part["w2"]
        self.w13_scale, self.w2_scale = part.get("w13_scale"), part.get("w2_scale")

    @property
    def experts(self) -> range:
        return range(self.first, self.first + self.count)

    def hf_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(HF checkpoint name, view) per expert and projection (and scale, for fp8)."""
        out, I = [], self.I
        nI = self.w13_scale.shape[1] // 2 if self.fp8 else 0  # row scales: nI == I
        suffix = "weight_scale_inv" if self.scales == "block" else "weight_scale"
        for i, e in enumerate(self.experts):
            p = f"{self.prefix}.{e}"
            out += [(f"{p}.gate_proj.weight", self.w13[i, :I]), (f"{p}.up_proj.weight", self.w13[i, I:]),
                    (f"{p}.down_proj.weight", self.w2[i])]
            if self.fp8:
                out += [(f"{p}.gate_proj.{suffix}", self.w13_scale[i, :nI]),
                        (f"{p}.up_proj.{suffix}", self.w13_scale[i, nI:]),
                        (f"{p}.down_proj.{suffix}", self.w2_scale[i])]
        return out


def manifest(header: dict) -> dict[str, tuple]:
    """{HF name: (shape, wire dtype)} of every tensor a sync carries, in the order `Bucket.tensors` yields them
    (experts one by one), read from the header alone: what a receiver checks before any weight moves."""
    out = {}
    for meta in header["buckets"]:
        for name, dtype, shape, _ in meta["tensors"]:
            out[name] = (tuple(shape), dtype)
        sec = meta["experts"]
        if sec:
            I, H, dtype, scales = sec["I"], sec["H"], sec["dtype"], section_scales(sec)
            projections = (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I)))
            for e in range(sec["first"], sec["first"] + sec["count"]):
                p = f"{sec['prefix']}.{e}"
                for proj, shape in projections:
                    out[f"{p}.{proj}.weight"] = (shape, dtype)
                for proj, shape in projections if scales else ():
                    if scales == "block":
                        out[f"{p}.{proj}.weight_scale_inv"] = (scale_shape(*shape), "float32")
                    else:
                        out[f"{p}.{proj}.weight_scale"] = ((shape[0], 1), "float32")
    return out


def compare_manifests(sent: dict, expected: dict, limit: int = 3) -> str | None:
    """None when `sent` names exactly the tensors of `expected` with the same shapes (manifests: dtypes may differ,
    the receiver casts), else what differs (the first `limit` of each kind)."""
    def first(items):
        items = sorted(items)
        return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")

    problems = []
    if unknown := [n for n in sent if n not in expected]:
        problems.append(f"{len(unknown)} tensors it does not have ({first(unknown)})")
    if shapes := [f"{n} {list(sent[n][0])} (its own {list(expected[n][0])})" for n in sent
                  if n in expected and tuple(sent[n][0]) != tuple(expected[n][0])]:
        problems.append(f"{len(shapes)} of other shapes ({first(shapes)})")
    if missing := [n for n in expected if n not in sent]:
        problems.append(f"{len(missing)} of its tensors not in the sync ({first(missing)})")
    return "the sync's model differs from this one: " + "; ".join(problems) if problems else None


class Bucket:
    """One bucket's buffer seen through its metadata: the sender writes into these views, receivers read them."""

    def __init__(self, meta: dict, buf: torch.Tensor, fmt: str):
        self.meta, self.buf, self.format, self.layer = meta, buf, fmt, meta["layer"]
        self._plain = {name: _view(buf, off, dtype, shape) for name, dtype, shape, off in meta["tensors"]}
        self.experts = ExpertSlabs(meta["experts"], buf) if meta["experts"] else None

    def plain(self) -> list[tuple[str, torch.Tensor]]:
        return list(self._plain.items())

    def tensor(self, name: str) -> torch.Tensor:
        return self._plain[name]

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor under its checkpoint name, experts one by one: what a `load_weights(weights)` takes."""
        return self.plain() + (self.experts.hf_tensors() if self.experts else [])
