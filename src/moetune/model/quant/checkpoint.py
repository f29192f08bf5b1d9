"""Which FP8 layout a checkpoint directory holds, and preparing a (meta) model to receive it.

The hub's FP8 GLM releases declare themselves in config.json's `quantization_config`:
- compressed-tensors (`quant_method: compressed-tensors`, `format: float-quantized`): `config_groups.*.weights` with
  `type: float`, `num_bits: 8` and `strategy: channel` (a `weight_scale [out, 1]` per weight) or `strategy: block`
  with `block_structure` (a `weight_scale` per block); activations `dynamic: true` (per token, computed at run time,
  as our kernels do); `ignore` lists what stays in bf16.
- DeepSeek-style (`quant_method: fp8`, `fmt: e4m3`, `weight_block_size: [128, 128]`, `activation_scheme: dynamic`):
  `weight_scale_inv` per 128×128 block.
Which modules are fp8 is read from the safetensors headers (a weight stored as F8_E4M3 is one), so an ignore list
written as names or as regular expressions needs no interpretation here.
"""

from __future__ import annotations

import json
import os
import re

from moetune.errors import CheckpointError
from moetune.model.quant.fp8 import Fp8Scheme, ROWWISE, scheme_named
from moetune.model.quant.modules import quantize_model

FP8_DTYPES = ("F8_E4M3",)


def checkpoint_scheme(path: str) -> Fp8Scheme | None:
    """The FP8 scheme config.json's `quantization_config` declares, None for an unquantised checkpoint."""
    cfg_file = os.path.join(path, "config.json")
    try:
        with open(cfg_file) as f:
            qc = json.load(f).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None  # ModelConfig.from_json reports an unreadable config.json with its own message
    if not qc:
        return None
    _expect_object(qc, "quantization_config", cfg_file)
    method = qc.get("quant_method")
    if method == "fp8":
        fmt, act = qc.get("fmt", "e4m3"), qc.get("activation_scheme", "dynamic")
        if fmt != "e4m3" or act != "dynamic":
            raise CheckpointError(f"{cfg_file}: quantization_config fmt {fmt!r} / activation_scheme {act!r} is not "
                                  "supported (fp8 e4m3 with dynamic activations is)")
        block = qc.get("weight_block_size")
        return ROWWISE if block is None else Fp8Scheme(_block(block, "quantization_config.weight_block_size", cfg_file))
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        _expect_object(groups, "quantization_config.config_groups", cfg_file)
        for name, g in groups.items():
            _expect_object(g, f"quantization_config.config_groups.{name}", cfg_file)
            _expect_object(g.get("weights") or {}, f"quantization_config.config_groups.{name}.weights", cfg_file)
        weights = [g.get("weights") or {} for g in groups.values()]
        if not weights or any(w.get("type") != "float" or w.get("num_bits") != 8 for w in weights):
            raise CheckpointError(f"{cfg_file}: compressed-tensors quantization other than 8-bit float weights "
                                  f"(format {qc.get('format')!r}) is not supported")
        strategies = {w.get("strategy") for w in weights}
        if strategies == {"channel"}:
            return ROWWISE
        if strategies == {"block"}:
            blocks = {_block(w.get("block_structure"), "quantization_config.config_groups.*.weights.block_structure",
                             cfg_file) for w in weights}
            if len(blocks) == 1:
                return Fp8Scheme(next(iter(blocks)))
        raise CheckpointError(f"{cfg_file}: compressed-tensors weight strategy {sorted(map(str, strategies))} is not "
                              "supported (channel, or block with one block_structure)")
    raise CheckpointError(f"{cfg_file}: quantization_config.quant_method {method!r} is not supported "
                          "(compressed-tensors fp8 and fp8 are)")


def _expect_object(value, key: str, cfg_file: str) -> None:
    if not isinstance(value, dict):
        raise CheckpointError(f"{cfg_file}: {key} must be an object, not {type(value).__name__} ({str(value)[:60]})")


def _block(value, key: str, cfg_file: str) -> tuple[int, int]:
    """A block shape: two positive integers."""
    if not (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in value)):
        raise CheckpointError(f"{cfg_file}: {key} must be two positive integers (rows, columns), not {value!r}")
    return tuple(value)


def fp8_config(scheme: Fp8Scheme) -> dict:
    """The quantization_config an export in `scheme` carries, in the layout whose scale names it writes (row-wise:
    compressed-tensors, `weight_scale`; blocks: DeepSeek-style fp8, `weight_scale_inv`), with what stays unquantised
    listed as the releases list it."""
    if scheme.block is not None:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(scheme.block),
                "modules_to_not_convert": ["lm_head", "mlp.gate", "indexer"]}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head", "re:.*mlp\\.gate$", "re:.*indexer.*"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                      "dynamic": True}}}}


def declare_unquantised(qc: dict, modules: list[str]) -> dict:
    """`qc` with each of `modules` (written unquantised) excluded from quantisation as loaders read the config:
    compressed-tensors' `ignore` ("re:" entries matched from the name's start, others exact names; as
    compressed_tensors.utils.match_name), fp8's `modules_to_not_convert` (a prefix, a regular expression from the
    start, or a suffix, as transformers' should_convert_module).
    Those not yet excluded are added by exact name: an export's config then says what its files hold, also where
    the base's config did not (a loader following it would read a bf16 weight as fp8 without a scale)."""
    key = "ignore" if qc.get("quant_method") == "compressed-tensors" else "modules_to_not_convert"
    have = qc.get(key) or []
    have = list(have) if isinstance(have, list) else [have]
    missing = [m for m in modules if not not_quantised(qc, m)]
    return dict(qc, **{key: have + missing}) if missing else qc


def not_quantised(qc: dict, name: str) -> bool:
    """Does `qc` exclude the module `name` from quantisation, as loaders read it (see declare_unquantised)? An entry
    that is no valid regular expression excludes nothing we can rely on."""
    compressed = qc.get("quant_method") == "compressed-tensors"
    have = qc.get("ignore" if compressed else "modules_to_not_convert") or []
    for entry in have if isinstance(have, list) else [have]:
        if not isinstance(entry, str):
            continue
        try:
            if compressed:
                hit = re.match(entry[3:], name) is not None if entry.startswith("re:") else entry == name
            else:
                hit = re.match(entry, name) is not None or name.endswith(entry)
        except re.error:
            hit = False
        if hit:
            return True
    return False


def stored_fp8_modules(reader) -> set[str]:
    """Qualified module names whose weight the checkpoint stores in fp8 (`X` for `X.weight`; `...mlp.experts` when
    its experts' weights are)."""
    out = set()
    for key in reader.tensors:
        if not key.endswith(".weight") or reader.dtype(key) not in FP8_DTYPES:
            continue
        module = key[: -len(".weight")]
        parts = module.split(".")
        if len(parts) >= 3 and parts[-3] == "experts" and parts[-2].isdigit():  # ...experts.E.gate_proj
            module = ".".join(parts[:-2])
        out.add(module)
    return out


def prepare_fp8_base(model, reader=None, quantize: str | None = None, block=(128, 128)) -> Fp8Scheme | None:
    """Turn the model's frozen weights into fp8 ones as the checkpoint stores them (an FP8 checkpoint needs no
    setting), or all of them with `quantize` ("fp8" | "fp8_block") for a bf16 checkpoint or a random base."""
    scheme = reader.fp8_scheme if reader is not None else None
    if scheme is not None:
        stored = stored_fp8_modules(reader)
        quantize_model(model, scheme, keep=lambda name: name in stored)
        return scheme
    scheme = scheme_named(quantize, block)
    if scheme is not None:
        quantize_model(model, scheme)
    return scheme
