"""HF checkpoints <-> our model: names, layouts, sharded reading, random initialisation.

Our parameter names are transformers v5's, so only the routed experts need conversion: the hub stores them
one by one (`mlp.experts.E.{gate,up,down}_proj.weight`), transformers v5 fuses them (`mlp.experts.gate_up_proj`
[E, 2I, H], gate rows first, and `mlp.experts.down_proj` [E, H, I]). Both load.

Reading is by slices: for a parameter that FSDP/EP has sharded, a rank reads from the safetensors files only
the rows it owns (safetensors' lazy `get_slice`), assembling its part of a stacked expert tensor directly
from the per-expert tensors. Host memory stays near one shard plus one tensor.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open

from moetune.model.build import build_model
from moetune.model.config import ModelConfig
from moetune.model.glm4_moe import Glm4MoeForCausalLM
from moetune.errors import CheckpointError  # noqa: F401  (re-exported)
from moetune.model.quant.checkpoint import checkpoint_scheme, prepare_fp8_base
from moetune.model.quant.modules import fp8_parameters, scale_name, stacked_parts
from moetune.names import FUSED_EXPERT_PART_RE, layer_index
from moetune.tensors import local_index, local_tensor

log = logging.getLogger("moetune")


# ---------------------------------------------------------------------------------------------- building
def cast_model(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast the base weights; the router's correction bias stays fp32 (as transformers keeps it), an fp8 base's
    weights and scales stay as they are."""
    fp8 = fp8_parameters(model)
    params = dict(model.named_parameters())
    kept = [(p, p.data) for w, (scale, _) in fp8.items() for p in (params[w], scale)]
    model.to(dtype)
    for p, data in kept:
        p.data = data
    for moe in model.moe_layers():
        moe.gate.e_score_correction_bias.data = moe.gate.e_score_correction_bias.data.float()
    return model


def _param_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_weights(model: Glm4MoeForCausalLM, std: float = 0.02, seed: int = 0) -> None:
    """Random init that does not depend on sharding: each parameter is drawn whole from its own seeded
    generator (on its device) and each rank keeps its slice. Norms 1, biases and the correction bias 0. An fp8
    weight is the same draw quantised: an fp8 base is the quantised base of the same seed."""
    fp8 = fp8_parameters(model)
    scales = {id(s) for s, _ in fp8.values()}
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if ".lora" in name or id(p) in scales:
            continue  # LoRA keeps its own init (B = 0); an fp8 scale is made with its weight
        if name in fp8:
            scale_p, scheme = fp8[name]
            normal = lambda t, g: t.normal_(0.0, std, generator=g)  # noqa: E731
            if scheme.block is not None and p.dim() == 2:
                # a linear's block rows and the shards of its weight and scale need not line up (96 rows over 4
                # ranks: 24 each; its 6 block rows of 16: 2, 2, 2, 0): quantise it whole, keep each slice
                q, scale = scheme.quantize(seeded_draw(p, name, seed, normal))
                local_tensor(p).copy_(q[local_index(p)[0]])
                local_tensor(scale_p).copy_(scale[local_index(scale_p)[0]])
                continue
            # per row, or an expert stack's experts: the weight's shard and its scale's cut the same leading rows
            q, scale = scheme.quantize(seeded_slice(p, name, seed, normal), stacked_parts(name))
            local_tensor(p).copy_(q)
            local_tensor(scale_p).copy_(scale)
            continue
        local = local_tensor(p)
        if name.endswith("norm.weight"):
            local.fill_(1.0)
        elif name.endswith(".bias") or name.endswith("e_score_correction_bias"):
            local.zero_()
        else:
            fill_seeded(p, name, seed, lambda t, g: t.normal_(0.0, std, generator=g))


@torch.no_grad()
def fill_seeded(p: torch.Tensor, name: str, seed: int, draw) -> None:
    """Draw the whole tensor `name` from a generator seeded by (seed, name) on its device, keep this rank's
    slice: the same values at any world size or sharding. `draw(tensor, generator)` fills in place."""
    local_tensor(p).copy_(seeded_slice(p, name, seed, draw))


def seeded_slice(p: torch.Tensor, name: str, seed: int, draw) -> torch.Tensor:
    """This rank's slice (fp32) of the whole tensor `name` drawn as fill_seeded draws it."""
    return seeded_draw(p, name, seed, draw)[local_index(p)[0]]


def seeded_draw(p: torch.Tensor, name: str, seed: int, draw) -> torch.Tensor:
    """The whole tensor `name` (fp32, on this rank's device) drawn from its own seeded generator."""
    device = local_tensor(p).device
    g = torch.Generator(device=device).manual_seed(_param_seed(seed, name))
    return draw(torch.empty(p.shape, dtype=torch.float32, device=device), g)


# ---------------------------------------------------------------------------------------------- reading
def shard_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint directory: those its index names, else every *.safetensors."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files and no model.safetensors.index.json")
    return files


def checkpoint_reader(path: str) -> "_Reader":
    """The index of a checkpoint directory's tensors (no data read)."""
    return _Reader(path)


@dataclass
class _Stored:
    file: str
    key: str
    shape: tuple
    dtype: str


class _Reader:
    """Index of the tensors in a checkpoint directory; reads slices lazily, one open handle per file."""

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        files = shard_files(path)
        self._handles = {}
        self.tensors: dict[str, _Stored] = {}
        for fname in files:
            full = os.path.join(path, fname)
            if not os.path.exists(full):
                raise CheckpointError(f"{index}: names shard file {fname}, which does not exist")
            h = self._handle(fname)
            for key in h.keys():
                sl = h.get_slice(key)
                self.tensors[key] = _Stored(fname, key, tuple(sl.get_shape()), sl.get_dtype())

    @functools.cached_property
    def fp8_scheme(self):
        """The FP8 scheme config.json declares (None: unquantised), read once."""
        return checkpoint_scheme(self.path)

    def dtype(self, key: str) -> str:
        """safetensors' name of a stored tensor's dtype (BF16, F32, F8_E4M3, ...)."""
        return self.tensors[key].dtype

    def _handle(self, fname):
        if fname not in self._handles:
            full = os.path.join(self.path, fname)
            try:
                self._handles[fname] = safe_open(full, framework="pt", device="cpu")
            except (SafetensorError, OSError) as e:  # a truncated or corrupt header
                raise CheckpointError(f"{full}: not a readable safetensors file ({e}); re-download or re-save it")
        return self._handles[fname]

    def read(self, key: str, idx: tuple[slice, ...]) -> torch.Tensor:
        s = self.tensors[key]
        try:
            sl = self._handle(s.file).get_slice(key)
            return sl[idx] if idx else sl[:]
        except (SafetensorError, OSError, RuntimeError) as e:  # data cut short after an intact header
            raise CheckpointError(f"{os.path.join(self.path, s.file)}: cannot read tensor {key} ({e}); the file "
                                  "is damaged or truncated: re-download or re-save it") from None


def _expected_shape_error(name, stored: _Stored, want):
    return CheckpointError(f"tensor {stored.key} in {stored.file} has shape {list(stored.shape)}, "
                           f"expected {list(want)} for {name}")


def _read_param(reader: _Reader, name: str, idx: tuple[slice, ...], shape, consumed: set) -> torch.Tensor:
    """Read the slice `idx` of our parameter `name` (global `shape`) from whichever layout the checkpoint has."""
    if name in reader.tensors:
        st = reader.tensors[name]
        if len(shape) == 4 and tuple(st.shape) == (shape[0], shape[1] * shape[2], shape[3]):
            # a fused gate_up's block scales stored as one stack, the parts' grids one after the other: a view of ours
            consumed.add(name)
            return reader.read(name, idx[:1]).view(-1, *shape[1:])[(slice(None), *idx[1:])]
        if tuple(st.shape) != tuple(shape):
            raise _expected_shape_error(name, st, shape)
        consumed.add(name)
        return reader.read(name, idx)
    alias = _scale_alias(name)
    if alias in reader.tensors:  # compressed-tensors names block scales `weight_scale`, DeepSeek `weight_scale_inv`
        return _read_param(reader, alias, idx, shape, consumed)
    m = FUSED_EXPERT_PART_RE.match(name)
    if not m:
        raise CheckpointError(f"tensor {name} is missing from the checkpoint at {reader.path}")
    prefix, which, scale = m.groups()
    suffix = _expert_suffix(reader, prefix, scale)
    E = shape[0]
    e_slice, rest = idx[0], idx[1:]
    # Every expert of the stack must be present with the right shape, whichever this rank reads: checked from
    # the index alone (no data read), so the strict check agrees on every rank of a sharded load.
    projs = ("down_proj",) if which == "down_proj" else ("gate_proj", "up_proj")
    # gate_up's block scales keep gate's and up's grids apart ([E, 2, rows, cols]: quant/fp8.py); its weight and row
    # scales stack gate's rows on up's ([E, 2I, ...])
    grids = which == "gate_up_proj" and len(shape) == 4
    want = tuple(shape[1:]) if which == "down_proj" else tuple(shape[2:]) if grids else (shape[1] // 2, shape[2])
    for e in range(E):
        for proj in projs:
            key = f"{prefix}.{e}.{proj}.{suffix}"
            st = reader.tensors.get(key)
            if st is None:
                raise CheckpointError(f"tensor {key} (part of {name}) is missing from the checkpoint at {reader.path}")
            if tuple(st.shape) != want:
                raise _expected_shape_error(name, st, want)
            consumed.add(key)
    parts = []
    for e in range(e_slice.start, e_slice.stop):
        if which == "down_proj":
            parts.append(reader.read(f"{prefix}.{e}.down_proj.{suffix}", rest))
            continue
        if grids:  # rest: which of gate and up, their block rows, their block columns
            part, rows = rest[0], rest[1:]
            parts.append(torch.stack([reader.read(f"{prefix}.{e}.{proj}.{suffix}", rows)
                                       for proj in projs[part.start:part.stop]], 0))
            continue
        I = shape[1] // 2
        row, col = rest
        pieces = []
        if row.start < I:  # gate rows
            pieces.append(reader.read(f"{prefix}.{e}.gate_proj.{suffix}", (slice(row.start, min(row.stop, I)), col)))
        if row.stop > I:  # up rows
            pieces.append(reader.read(f"{prefix}.{e}.up_proj.{suffix}", (slice(max(row.start, I) - I, row.stop - I), col)))
        parts.append(torch.cat(pieces, 0))
    if E and not parts:
        return torch.empty(0, *[s.stop - s.start for s in rest])
    return torch.stack(parts, 0)


def _dequantize_stored(reader: _Reader, name: str, t: torch.Tensor, idx, consumed: set) -> torch.Tensor:
    """An fp8 tensor the checkpoint stores for a module this model keeps in the compute dtype (e.g. DSA's indexer),
    dequantised with its stored scale."""
    scheme = reader.fp8_scheme
    key = next((k for k in (scale_name(name, scheme), _scale_alias(scale_name(name, scheme))) if k in reader.tensors),
               None) if scheme is not None else None
    if key is None:
        raise CheckpointError(f"tensor {name} is stored in fp8 at {reader.path} without a scale this model can read")
    consumed.add(key)
    scale = reader.read(key, ())
    _check_scale_dtype(scale, key, reader.path)
    full = scheme.dequantize(reader.read(name, ()), scale)
    return full[idx] if idx else full


def _check_scale_dtype(scale: torch.Tensor, name: str, path: str) -> None:
    if not scale.is_floating_point() or scale.element_size() < 2:
        raise CheckpointError(f"tensor {name} of the checkpoint at {path} is stored as {scale.dtype}; an fp8 weight's "
                              f"scale is a float32, bfloat16 or float16 tensor")


def _scale_alias(name: str) -> str | None:
    """The other name a block scale may have in a checkpoint (weight_scale_inv <-> weight_scale)."""
    if name.endswith(".weight_scale_inv"):
        return name[: -len("_inv")]
    return None


def _expert_suffix(reader: _Reader, prefix: str, scale: str | None) -> str:
    """The per-expert tensor name a fused stack's part reads: `weight`, or its scale under the checkpoint's name."""
    if scale is None:
        return "weight"
    if scale == "_scale_inv" and f"{prefix}.0.down_proj.weight_scale_inv" not in reader.tensors:
        return "weight_scale"
    return "weight" + scale


class _Progress:
    """A log line each tenth of the bytes this process loads: loading a large checkpoint takes minutes."""

    def __init__(self, path: str, total: int):
        self.path, self.total, self.done, self.next = path, max(total, 1), 0, 0.1
        self.t0 = time.perf_counter()

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        frac = self.done / self.total
        if frac + 1e-9 >= self.next:
            log.info("loading weights from %s: %d%% (%.2f of %.2f GB, %.0f s)", self.path, int(frac * 100 + 1e-6),
                     self.done / 1e9, self.total / 1e9, time.perf_counter() - self.t0)
            while self.next <= frac + 1e-9:
                self.next += 0.1


def _ignored(key: str, cfg: ModelConfig) -> bool:
    """MTP layers (model.layers.{num_hidden_layers}.*) and layers past a proxy's truncation are not ours."""
    layer = layer_index(key)
    return layer is not None and layer >= cfg.num_hidden_layers


@torch.no_grad()
def load_hf_weights(model: Glm4MoeForCausalLM, path: str, strict: bool = True, reader: "_Reader | None" = None) -> None:
    """Fill the base weights of `model` (plain or sharded, already materialised) from an HF checkpoint dir (`reader`:
    its index, when the caller already read it)."""
    reader = reader or _Reader(path)
    consumed: set[str] = set()
    tensors = [(n, p) for n, p in list(model.named_parameters()) + list(model.named_buffers()) if ".lora" not in n]
    progress = _Progress(path, sum(local_tensor(p).numel() * local_tensor(p).element_size() for _, p in tensors))
    fp8 = fp8_parameters(model)
    scales = {id(s) for s, _ in fp8.values()}
    flags = []  # (name, 0-dim bool on the tensor's device: non-finite values), read once at the end: one sync
    for name, p in tensors:
        if id(p) in scales:
            continue  # read or made with its fp8 weight
        idx, shape = local_index(p)  # LoRALinear keeps its base layer's names: nothing to rename
        t = _read_param(reader, name, idx, shape, consumed)
        if name in fp8:
            _store_fp8(reader, name, p, t, *fp8[name], consumed)
            scale_p = fp8[name][0]
            flags.append((scale_name(name, fp8[name][1]), _nonfinite(local_tensor(scale_p))))
        elif t.dtype == torch.float8_e4m3fn:  # stored in fp8 where this model keeps the compute dtype
            local_tensor(p).copy_(_dequantize_stored(reader, name, t, idx, consumed).to(local_tensor(p).dtype))
        else:
            local_tensor(p).copy_(t.to(local_tensor(p).dtype))
        flags.append((name, _nonfinite(local_tensor(p))))
        progress.add(local_tensor(p).numel() * local_tensor(p).element_size())
    by_device: dict = {}
    for _, f in flags:
        by_device.setdefault(f.device, []).append(f)
    if any(bool(torch.stack(fs).any()) for fs in by_device.values()):
        bad = next(n for n, f in flags if bool(f))
        raise CheckpointError(f"tensor {bad} of the checkpoint at {path} holds non-finite values (NaN or infinity)")
    if strict:
        unexpected = [k for k in reader.tensors if k not in consumed and not _ignored(k, model.config)]
        if unexpected:
            k = unexpected[0]
            raise CheckpointError(f"unexpected tensor {k} in {reader.tensors[k].file} "
                                  f"({len(unexpected)} unexpected in all) at {path}")


def _nonfinite(t: torch.Tensor) -> torch.Tensor:
    """Does t hold a NaN or an infinity (fp8 e4m3fn, which has no infinity: its NaN code)? A 0-dim bool on t's
    device, so that checking costs no synchronisation until the loader reads all of them, and no temporary of t's
    size (an expert stack is a gigabyte): a float tensor's fp32 sum is finite exactly when its values are (short of
    values near fp32's largest), an fp8 one is read in row blocks of ~64 MB."""
    if t.numel() == 0:  # an empty shard (more ranks than rows)
        return torch.zeros((), dtype=torch.bool, device=t.device)
    if t.dtype == torch.float8_e4m3fn:
        rows = t.view(torch.uint8).reshape(t.shape[0] if t.dim() else 1, -1)
        step = max(1, (1 << 26) // max(1, rows.shape[1]))
        return torch.stack([(rows[i : i + step] & 0x7F).eq(0x7F).any() for i in range(0, rows.shape[0], step)]).any()
    if not t.is_floating_point():
        return torch.zeros((), dtype=torch.bool, device=t.device)
    return ~torch.isfinite(torch.sum(t, dtype=torch.float32))


def _store_fp8(reader: _Reader, name: str, target, t: torch.Tensor, scale_p, scheme, consumed: set) -> None:
    """Fill an fp8 weight and its scale: read as stored when the checkpoint is fp8, else quantised here from the
    slice just read (this rank's rows: row and 128-row-block scales need no other rank's data)."""
    if t.dtype == torch.float8_e4m3fn:
        sidx, sshape = local_index(scale_p)
        s = _read_param(reader, scale_name(name, scheme), sidx, sshape, consumed)
        _check_scale_dtype(s, scale_name(name, scheme), reader.path)
        local_tensor(target).copy_(t)
        local_tensor(scale_p).copy_(s.to(torch.float32))
        return
    q, s = scheme.quantize(t.to(local_tensor(target).device), stacked_parts(name))
    local_tensor(target).copy_(q)
    local_tensor(scale_p).copy_(s)


# ---------------------------------------------------------------------------------------------- public
_DTYPES = {None: None, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16}


def as_dtype(dtype) -> torch.dtype | None:
    return dtype if isinstance(dtype, torch.dtype) or dtype is None else _DTYPES[dtype]


def load_model(path: str, device="cpu", dtype=None, adapter: str | None = None,
               quantize: str | None = None) -> Glm4MoeForCausalLM:
    """Load an HF-format checkpoint directory (GLM-4.5 family, GLM-4.7-Flash, GLM-5; and optionally a moetune
    adapter) for inference. An FP8 checkpoint stays fp8 (its frozen weights and scales as stored); `quantize`
    ("fp8" | "fp8_block") stores an unquantised one in fp8."""
    cfg = ModelConfig.from_json(path)
    model = build_model(cfg, "meta")
    dtype = as_dtype(dtype) or torch.float32
    cast_model(model, dtype)
    reader = _Reader(path)
    prepare_fp8_base(model, reader, quantize)
    model.to_empty(device=device)
    load_hf_weights(model, path, reader=reader)
    if adapter is not None:
        from moetune.model.adapter_io import load_adapter

        load_adapter(model, adapter)
    return model.eval()
