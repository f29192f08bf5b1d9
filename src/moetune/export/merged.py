"""Merge a moetune adapter into its base and write an HF checkpoint, streaming tensor by tensor.

Every output tensor is read from the base (plain file reads of its bytes, or of one expert's rows of a fused
tensor), merged in fp32 as W + scaling·B·A when LoRA touches it, cast, written straight into its planned shard,
and freed. Peak memory is one tensor plus its LoRA factors (one layer at most), whatever the model's size.

Output: the hub's layout (experts one by one, `mlp.experts.E.{gate,up,down}_proj.weight`, which transformers v5
fuses on load and vLLM/SGLang read as is), sharded `model-XXXXX-of-YYYYY.safetensors` of at most
max_shard_bytes + model.safetensors.index.json, config.json (dtype updated), and the base's generation config and
tokenizer files. The router's e_score_correction_bias stays fp32, as the hub checkpoints store it.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil

import torch

from moetune.export.adapter import ExportError, check_out_dir, output_errors, resolve_adapter_dir
from moetune.export.safetensors_io import Reader, ShardedWriter
from moetune.model.adapter_io import read_adapter
from moetune.model.config import GLM4_MOE, GLM4_MOE_LITE, GLM_MOE_DSA, read_json_object
from moetune.model.hf_io import as_dtype
from moetune.model.lora import lora_scaling
from moetune.model.quant.checkpoint import checkpoint_scheme, declare_unquantised, fp8_config
from moetune.model.quant.fp8 import FP8, scheme_named
from moetune.names import (FP8_WEIGHT_RE, FUSED_EXPERT_RE as _FUSED_RE, HF_EXPERT_RE as _EXPERT_RE,
                           ROUTER_WEIGHT_SUFFIX)
from moetune.output_dir import atomic_output_dir

COPIED_FILES = ("generation_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab*",
                "merges.txt", "chat_template*", "*.tiktoken", "preprocessor_config.json")
_KEEP_DTYPE = ("e_score_correction_bias",)


def _natural_key(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _order_key(name: str):
    # embeddings, then the layers in numeric order, then the final norm and lm_head (as HF writes them)
    group = 0 if name.startswith("model.embed_tokens") else 1 if name.startswith("model.layers.") else 2
    return group, _natural_key(name)


def lora_delta(A: torch.Tensor, B: torch.Tensor, scaling: float) -> torch.Tensor:
    """scaling·B·A in fp32: what LoRA adds to W [out, in] (A [r, in], B [out, r]). Shared with merged_sources."""
    return (B.float() @ A.float()) * scaling


class _Merger:
    """Produces each output tensor; knows which LoRA factors touch which base weight.

    An FP8 base (`stored`: its scheme) is dequantised with its scales before the merge; a bf16 base that was
    trained stored in fp8 (`trained`: the adapter's base_quantize) is quantised and dequantised first, so the merge
    is the model that was trained. `requantise`: the merged weights are written in fp8 again (the base's scheme, or
    the trained one), each with its new scale, produced right after its weight: those an FP8 base stores in fp8 (a
    module its quantization_config ignores, e.g. routed experts kept in bf16, stays unquantised), every fp8-trained
    weight of a bf16 base."""

    def __init__(self, base: Reader, lora: Reader, scaling: float, dtype: torch.dtype, stored=None, trained=None,
                 requantise=None):
        self.base, self.lora, self.scaling, self.dtype = base, lora, scaling, dtype
        self.stored, self.trained, self.requantise = stored, trained, requantise
        self.unused_lora = set(lora.entries)
        self._row_cache = (None, None)
        self._scale = {}
        self.fp8_out: set[str] = set()  # output weights written in fp8 (planned by _plan)

    def requantised(self, out: str, source: str) -> bool:
        """Is the output weight `out` (read from the base tensor `source`) written in fp8?"""
        if self.requantise is None:
            return False
        if self.stored is not None:  # what an FP8 base stores in fp8 (its quantization_config says which) stays so
            return self.base.entries[source].dtype == FP8
        return _fp8_in_training(out)

    def out_dtype(self, name: str, stored: torch.dtype) -> torch.dtype:
        if not stored.is_floating_point or name.endswith(_KEEP_DTYPE):
            return stored
        return self.dtype

    def weight(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """A base weight as the model saw it in training (fp32 when dequantised)."""
        W = self.base.read(name, rows)
        if W.dtype == FP8:
            key = next(k for k in (name + "_scale", name + "_scale_inv") if k in self.base)
            return self.stored.dequantize(W, self.base.read(key, rows))
        if self.trained is not None and _fp8_in_training(name):
            return self.trained.dequantize(*self.trained.quantize(W))
        return W

    def finish(self, name: str, W: torch.Tensor) -> torch.Tensor:
        """The merged weight in the output's dtype; with `requantise`, its fp8 values (its scale kept for the tensor
        planned next)."""
        if name not in self.fp8_out:
            return W
        q, scale = self.requantise.quantize(W)
        self._scale[name] = scale
        return q

    def scale(self, weight_name: str) -> torch.Tensor:
        return self._scale.pop(weight_name)

    def _delta(self, A: torch.Tensor, B: torch.Tensor, W: torch.Tensor, what: str) -> torch.Tensor:
        if A.shape[1] != W.shape[1] or B.shape[0] != W.shape[0] or A.shape[0] != B.shape[1]:
            raise ExportError(f"LoRA for {what}: A {list(A.shape)}, B {list(B.shape)} do not fit the base weight "
                              f"{list(W.shape)}; is this adapter for this base model?")
        return lora_delta(A, B, self.scaling)

    def linear(self, name: str) -> torch.Tensor:
        W = self.weight(name)
        module = name[: -len(".weight")]
        a, b = f"{module}.lora_A", f"{module}.lora_B"
        if a in self.lora:
            self.unused_lora -= {a, b}
            W = W.float() + self._delta(self.lora.read(a), self.lora.read(b), W, module)
        return self.finish(name, W)

    def _fused_row(self, fused_name: str, e: int) -> torch.Tensor:
        # gate and up of one expert come from the same row of a fused gate_up_proj: read it once
        if self._row_cache[0] != (fused_name, e):
            self._row_cache = ((fused_name, e), self.weight(fused_name, slice(e, e + 1))[0])
        return self._row_cache[1]

    def expert(self, prefix: str, e: int, proj: str, source: str | None) -> torch.Tensor:
        """Expert e's `proj` weight, read from per-expert tensors (source None) or the fused tensor `source`."""
        out = f"{prefix}.{e}.{proj}.weight"
        if source is None:
            W = self.weight(out)
        elif proj == "down_proj":
            W = self.weight(source, slice(e, e + 1))[0]
        else:
            row = self._fused_row(source, e)
            I = row.shape[0] // 2
            W = row[:I] if proj == "gate_proj" else row[I:]
        which = "down" if proj == "down_proj" else "gate_up"
        a, b = f"{prefix}.lora.{which}_A", f"{prefix}.lora.{which}_B"
        if a not in self.lora:
            return self.finish(out, W)
        self.unused_lora -= {a, b}
        A, B = self.lora.read(a, slice(e, e + 1))[0], self.lora.read(b, slice(e, e + 1))[0]
        if which == "gate_up":
            I = B.shape[0] // 2
            B = B[:I] if proj == "gate_proj" else B[I:]
        return self.finish(out, W.float() + self._delta(A, B, W, f"{prefix}.{e}.{proj}"))


def _is_scale(name: str) -> bool:
    return name.endswith(".weight_scale") or name.endswith(".weight_scale_inv")


def _fp8_in_training(name: str) -> bool:
    """The weights an fp8 base stores in fp8 (model/quant/modules.py, hub names): attention projections, dense MLPs,
    shared and routed experts; not the router (mlp.gate), DSA's indexer, norms, embeddings or lm_head."""
    return bool(FP8_WEIGHT_RE.match(name))


def _plan_weight(plan: list, merger: _Merger, out: str, source: str, shape, dtype, producer) -> None:
    """Plan the output weight `out` (from the base tensor `source`); a requantised one in fp8, its scale right
    after it."""
    if not merger.requantised(out, source):
        plan.append((out, shape, dtype, producer))
        return
    merger.fp8_out.add(out)
    scheme = merger.requantise
    plan.append((out, shape, FP8, producer))
    plan.append((out[: -len("weight")] + scheme.scale_suffix, scheme.scale_shape(shape), torch.float32,
                 lambda n=out: merger.scale(n)))


def _plan(base: Reader, merger: _Merger):
    """[(out name, shape, dtype, producer)] in writing order; fused experts are split into the hub's names."""
    plan = []
    for name in sorted(base.entries, key=_order_key):
        ent = base.entries[name]
        if _is_scale(name):
            continue  # an FP8 base's scales: dequantised into the merge (new ones follow a requantised weight)
        fused = _FUSED_RE.match(name)
        if fused:
            prefix, which = fused.groups()
            E = ent.shape[0]
            projs = ("gate_proj", "up_proj") if which == "gate_up_proj" else ("down_proj",)
            for e in range(E):
                for proj in projs:
                    shape = (ent.shape[1] // 2, ent.shape[2]) if which == "gate_up_proj" else tuple(ent.shape[1:])
                    out = f"{prefix}.{e}.{proj}.weight"
                    _plan_weight(plan, merger, out, name, shape, merger.out_dtype(out, ent.dtype),
                                 lambda p=prefix, e=e, j=proj, s=name: merger.expert(p, e, j, s))
            continue
        m = _EXPERT_RE.match(name)
        if m:
            prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
            producer = lambda p=prefix, e=e, j=proj: merger.expert(p, e, j, None)  # noqa: E731
        elif name.endswith(".weight"):
            producer = lambda n=name: merger.linear(n)  # noqa: E731
        else:
            producer = lambda n=name: base.read(n)  # noqa: E731
        _plan_weight(plan, merger, name, name, tuple(ent.shape), merger.out_dtype(name, ent.dtype), producer)
    return plan


def _check_lora_fits(base: Reader, lora: Reader, adapter_dir: str, base_path: str) -> None:
    """Every LoRA tensor must land on a base weight; checked before a byte is written."""
    modules = set()
    for name in base.entries:
        m = _FUSED_RE.match(name) or _EXPERT_RE.match(name)
        if m:
            modules.add(f"{m.group(1)}.lora.")
        elif name.endswith(".weight"):
            modules.add(name[: -len("weight")])
    stray = [k for k in lora.entries if k.rsplit(".", 1)[0] + "." not in modules]
    if stray:
        raise ExportError(f"{adapter_dir}: {len(stray)} LoRA tensors match no weight of {base_path} "
                          f"(e.g. {sorted(stray)[0]}); is this adapter for this base model?")


def _write_config(base_path: str, out_dir: str, dtype: torch.dtype, requantise=None, stored_scheme=None,
                  unquantised: list[str] = ()) -> None:
    """The base's config.json with the written dtype; an FP8 base's quantization_config is kept when the merge is
    requantised into the same scheme, replaced by ours for a scheme the base did not have, dropped otherwise; either
    excludes the `unquantised` modules from quantisation (model/quant/checkpoint.declare_unquantised)."""
    with open(os.path.join(base_path, "config.json")) as f:
        cfg = json.load(f)
    stored = cfg.pop("quantization_config", None)
    if requantise is not None:
        # the base's own config only where its scale names are the ones written (weight_scale row-wise,
        # weight_scale_inv per block; a compressed-tensors block checkpoint names its block scales weight_scale)
        same = stored and stored_scheme == requantise and \
            (stored.get("quant_method") == "fp8") == (requantise.block is not None)
        cfg["quantization_config"] = declare_unquantised(stored if same else fp8_config(requantise), unquantised)
    write_config_dict(cfg, out_dir, dtype)


def write_config_dict(cfg: dict, out_dir: str, dtype: torch.dtype) -> None:
    """config.json of `cfg` with its dtype set to what the export writes."""
    cfg = dict(cfg)
    types = cfg.get("mlp_layer_types")
    if cfg.get("model_type") in (GLM4_MOE_LITE, GLM_MOE_DSA) and "first_k_dense_replace" not in cfg and types:
        # transformers 5 writes mlp_layer_types only; vLLM (0.32: glm4_moe_lite.py, deepseek_v2.py) reads
        # first_k_dense_replace, as the hub configs carry it
        cfg["first_k_dense_replace"] = next((i for i, t in enumerate(types) if t != "dense"), len(types))
    name = str(dtype).removeprefix("torch.")
    keys = [k for k in ("dtype", "torch_dtype") if k in cfg] or ["torch_dtype"]
    for k in keys:
        cfg[k] = name
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def check_base_dir(base_path: str, flag: str = "base") -> None:
    """The base must be an HF checkpoint directory of a model moetune knows, said with the flag that names it: the
    merge reads tensors by name and copies config.json, so another model's base would make a broken export."""
    if not os.path.isdir(base_path):
        raise ExportError(f"{flag} {base_path}: no such directory (the base HF checkpoint the adapter was trained on)")
    path = os.path.join(base_path, "config.json")
    if not os.path.isfile(path):
        raise ExportError(f"{flag} {base_path}: has no config.json (expected an HF checkpoint directory)")
    try:
        cfg = read_json_object(path)
    except ValueError as e:
        raise ExportError(f"{flag} {base_path}: {e}") from None
    kinds = (GLM4_MOE, GLM4_MOE_LITE, GLM_MOE_DSA)
    if cfg.get("model_type") not in kinds:
        raise ExportError(f"{flag} {base_path}: {path} is of model_type {cfg.get('model_type')!r}; moetune merges "
                          f"into {', '.join(kinds)}")


def _copy_side_files(base_path: str, out_dir: str) -> list[str]:
    copied = []
    for fname in sorted(os.listdir(base_path)):
        src = os.path.join(base_path, fname)
        if os.path.isfile(src) and any(fnmatch.fnmatch(fname, pat) for pat in COPIED_FILES):
            shutil.copy2(src, os.path.join(out_dir, fname))
            copied.append(fname)
    return copied


def export_merged(base_path: str, adapter_dir: str, out_dir: str, dtype="bfloat16", max_shard_bytes: float = 5e9,
                  verify: bool = False) -> dict:
    """Merge the moetune adapter at `adapter_dir` (or a run dir holding adapter/) into the HF checkpoint at
    `base_path` and write the result to `out_dir`. Returns {"out_dir", "shards", "tensors", "bytes", "verify"}."""
    base_path, out_dir = os.fspath(base_path), os.fspath(out_dir)
    adapter_dir = resolve_adapter_dir(adapter_dir)
    _, meta = read_adapter(adapter_dir)  # finite, paired, of its rank: before anything is written
    check_base_dir(base_path)  # before its quantization_config is read
    stored = checkpoint_scheme(base_path)
    trained = scheme_named(meta.get("base_quantize")) if stored is None else None
    requantise = None
    if dtype == "fp8":  # the checkpoint's own FP8 format (or, for a bf16 base, the scheme training stored it in)
        requantise = stored or trained
        if requantise is None:
            raise ExportError(f"dtype fp8: {base_path} is not an FP8 checkpoint and the adapter was not trained on an "
                              "fp8 base (model.quantize): nothing says which fp8 format to write")
        dtype = "bfloat16"  # what stays unquantised (embeddings, norms, router, lm_head)
    torch_dtype = as_dtype(dtype)
    if torch_dtype is None or not torch_dtype.is_floating_point:
        raise ExportError(f"dtype {dtype!r}: choose float32, bfloat16, float16 or fp8")
    if os.path.abspath(out_dir) == os.path.abspath(base_path):
        raise ExportError("out_dir must differ from base_path (the base is read while the merge is written)")
    check_out_dir(out_dir)  # before the work; checked again under the writer's lock
    with output_errors(out_dir), atomic_output_dir(out_dir, label=f"--out {out_dir}") as tmp:
        base, lora = Reader(base_path), Reader(adapter_dir)
        merger = _Merger(base, lora, lora_scaling(meta["rank"], meta["alpha"], meta.get("rslora", False)), torch_dtype,
                         stored, trained, requantise)
        plan = _plan(base, merger)
        _check_lora_fits(base, lora, adapter_dir, base_path)
        # the decoder layers' linear weights written unquantised (a matrix, not fp8); not the router, which no
        # loader quantises (transformers' TopkRouter is no Linear, vLLM builds it unquantised)
        unquantised = [n[: -len(".weight")] for n, shape, d, _ in plan if n.startswith("model.layers.")
                       and n.endswith(".weight") and not n.endswith(ROUTER_WEIGHT_SUFFIX) and len(shape) == 2
                       and d != FP8]
        _write_config(base_path, tmp, torch_dtype, requantise, stored, unquantised)
        writer = ShardedWriter(tmp, [(n, s, d) for n, s, d, _ in plan], max_shard_bytes)
        for name, _, out_dtype, produce in plan:
            t = produce()
            writer.write(name, t.to(out_dtype))
            del t
        assert not merger.unused_lora, sorted(merger.unused_lora)[:3]  # _check_lora_fits saw to it
        writer.finish()
        copied = _copy_side_files(base_path, tmp)
        report = {"out_dir": out_dir, "shards": len(writer.shards), "tensors": len(plan), "bytes": writer.total,
                  "copied": copied, "verify": None}
        if verify:  # before the export is put in place: one that fails is never seen at out_dir
            from moetune.export.verify import verify_merged

            report["verify"] = verify_merged(base_path, adapter_dir, tmp)
    return report
