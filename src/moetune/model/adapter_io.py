"""moetune's native adapter directory: `adapter_config.json` + `adapter_model.safetensors` of LoRA tensors
under our (= transformers v5) module names. `moetune export adapter` converts it for PEFT and vLLM."""

from __future__ import annotations

import json
import math
import os

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from moetune.errors import CheckpointError, NumericalFault, OutputError
from moetune.model.build import build_model
from moetune.model.lora import apply_lora
from moetune.names import LORA_TARGETS
from moetune.output_dir import atomic_output_dir
from moetune.tensors import full_tensor

ADAPTER_FORMAT = "moetune-lora-v1"
# what an adapter folder holds (ours, and the PEFT/vLLM exports with PEFT's README): a folder holding only these
# is an earlier adapter, which a new one may replace
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json", "README.md")


def gather_lora_state(model) -> dict[str, torch.Tensor]:
    """Full (unsharded) LoRA tensors on CPU. Collective under FSDP: every rank must call it."""
    out = {}
    for name, p in model.named_parameters():
        if ".lora" not in name:
            continue
        t = full_tensor(p)
        out[name] = t.detach().to("cpu", torch.float32).contiguous()
    return out


def write_adapter_files(folder: str, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """adapter_model.safetensors and adapter_config.json into `folder` (ours, PEFT's and vLLM's layout alike).
    A failed write raises OSError or, from safetensors, SafetensorError."""
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
    # safetensors creates its file 0600; an adapter is read by other users and servers too
    os.chmod(os.path.join(folder, "adapter_model.safetensors"), 0o644)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def save_adapter(state: dict[str, torch.Tensor], out_dir: str, lora_cfg: dict, base_model: str | None = None) -> None:
    """Write a native adapter; refuses (NumericalFault) a tensor that is not finite, so no adapter ever holds one.
    Each file is written under a temporary name and renamed; a failed write (disk full) raises OutputError."""
    for name, t in state.items():
        if not bool(torch.isfinite(t).all()):
            raise NumericalFault(f"not writing the adapter to {out_dir}: tensor {name} holds non-finite values")
    meta = {"format": ADAPTER_FORMAT, "base_model": base_model, **lora_cfg}
    try:  # the folder appears complete or not at all, and replaces only an earlier adapter (moetune/output_dir.py)
        with atomic_output_dir(out_dir, ADAPTER_FILES, label=f"adapter {out_dir}") as tmp:
            write_adapter_files(tmp, state, meta)
    except (OSError, SafetensorError) as e:  # safetensors reports a failed write (disk full) as its own error
        raise OutputError(f"could not write the adapter to {out_dir}: {e}") from None


def read_adapter_config(adapter_dir: str) -> dict:
    """The adapter's meta (format, base_model, rank, alpha, dropout, rslora, targets; base_quantize when the base was
    stored in fp8 at load, so that generation rebuilds the base it was trained on), checked."""
    path = os.path.join(adapter_dir, "adapter_config.json")
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{adapter_dir}: no adapter_config.json (not an adapter directory)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read it ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != ADAPTER_FORMAT:
        fmt = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"{path}: not a moetune adapter (format {fmt!r}); "
                              "PEFT adapters load with peft.PeftModel on transformers")
    rank, alpha, targets = meta.get("rank"), meta.get("alpha"), meta.get("targets")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise CheckpointError(f"{path}: rank must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise CheckpointError(f"{path}: alpha must be a finite positive number, got {alpha!r}")
    if not isinstance(targets, list) or not targets or not set(targets) <= set(LORA_TARGETS):
        raise CheckpointError(f"{path}: targets must be a non-empty list of {list(LORA_TARGETS)}, got {targets!r}")
    if meta.get("base_quantize") not in (None, "fp8", "fp8_block"):
        raise CheckpointError(f"{path}: base_quantize must be fp8 or fp8_block (the frozen base it was trained on), "
                              f"got {meta['base_quantize']!r}")
    return meta


def read_adapter(adapter_dir: str, model_config=None) -> tuple[dict[str, torch.Tensor], dict]:
    """(LoRA tensors, meta) of a native adapter directory, validated: every tensor finite, A/B pairs complete with
    the rank of the meta, and, given the base's ModelConfig, exactly the tensors and shapes that base needs."""
    meta = read_adapter_config(adapter_dir)
    path = os.path.join(adapter_dir, "adapter_model.safetensors")
    try:
        state = load_file(path)
    except FileNotFoundError:
        raise CheckpointError(f"{adapter_dir}: adapter_model.safetensors is missing") from None
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    check_adapter_tensors(state, meta, path, model_config)
    return state, meta


def check_adapter_tensors(state: dict, meta: dict, where: str, model_config=None) -> None:
    """Raise CheckpointError naming the first tensor that is non-finite, unpaired, of the wrong rank or (given the
    base's ModelConfig) missing, unexpected or of the wrong shape."""
    for name, t in state.items():
        if not t.is_floating_point():
            raise CheckpointError(f"{where}: tensor {name} is {t.dtype}, not floating point")
        if not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{where}: tensor {name} holds non-finite values (NaN or inf)")
    if model_config is not None:
        want = expected_adapter_shapes(model_config, meta)
        missing = sorted(set(want) - set(state))
        unexpected = sorted(set(state) - set(want))
        if missing:
            raise CheckpointError(f"{where}: tensor {missing[0]} is missing ({len(missing)} missing in all) for "
                                  f"targets {meta['targets']} at rank {meta['rank']}")
        if unexpected:
            raise CheckpointError(f"{where}: unexpected tensor {unexpected[0]} ({len(unexpected)} in all) for "
                                  f"targets {meta['targets']}")
        for name, shape in want.items():
            if tuple(state[name].shape) != shape:
                raise CheckpointError(f"{where}: tensor {name} has shape {list(state[name].shape)}, the base model "
                                      f"with rank {meta['rank']} needs {list(shape)}")
        return
    r = meta["rank"]
    for name, t in state.items():
        kind = _RANK_DIM.get(name.rsplit(".", 1)[-1])
        if kind is None:
            raise CheckpointError(f"{where}: tensor {name} is not a LoRA tensor of moetune")
        dim, partner = kind
        if t.dim() not in (2, 3) or t.shape[dim] != r:
            raise CheckpointError(f"{where}: tensor {name} has shape {list(t.shape)}, not rank {r} (adapter_config.json)")
        other = name.rsplit(".", 1)[0] + "." + partner
        if other not in state:
            raise CheckpointError(f"{where}: tensor {other} is missing (the pair of {name})")


# LoRA tensor leaf name -> (the dimension that is the rank, the name of its pair)
_RANK_DIM = {"lora_A": (0, "lora_B"), "lora_B": (-1, "lora_A"), "gate_up_A": (-2, "gate_up_B"),
             "gate_up_B": (-1, "gate_up_A"), "down_A": (-2, "down_B"), "down_B": (-1, "down_A")}


def expected_adapter_shapes(model_config, meta: dict) -> dict[str, tuple]:
    """{name: shape} of the LoRA tensors an adapter of `meta` has on a model of `model_config` (built on meta)."""
    model = build_model(model_config, "meta")  # the class of its model_type: MLA models have other projections
    try:
        apply_lora(model, meta["targets"], meta["rank"], meta["alpha"], 0.0, meta.get("rslora", False))
    except ValueError as e:
        raise CheckpointError(f"the adapter does not fit the base model: {e}") from None
    return {n: tuple(p.shape) for n, p in model.named_parameters() if ".lora" in n}


@torch.no_grad()
def load_adapter(model, adapter_dir: str) -> None:
    meta = read_adapter_config(adapter_dir)
    apply_lora(model, meta["targets"], meta["rank"], meta["alpha"], 0.0, meta.get("rslora", False))
    params = dict(model.named_parameters())
    state, _ = read_adapter(adapter_dir)
    missing = [k for k in params if ".lora" in k and k not in state]
    unexpected = [k for k in state if k not in params]
    if missing or unexpected:
        raise CheckpointError(f"{adapter_dir}: adapter does not fit the model: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    for k, v in state.items():
        p = params[k]
        if p.shape != v.shape:
            raise CheckpointError(f"{adapter_dir}: {k} has shape {list(v.shape)}, model expects {list(p.shape)}")
        p.copy_(v.to(device=p.device, dtype=p.dtype))
