"""moetune's native adapter directory: `adapter_config.json` + `adapter_model.safetensors` of LoRA tensors
under our (= transformers v5) module names. `moetune export adapter` converts it for PEFT and vLLM."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from moetune.model.lora import apply_lora

ADAPTER_FORMAT = "moetune-lora-v1"


def gather_lora_state(model) -> dict[str, torch.Tensor]:
    """Full (unsharded) LoRA tensors on CPU. Collective under FSDP: every rank must call it."""
    out = {}
    for name, p in model.named_parameters():
        if ".lora" not in name:
            continue
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().to("cpu", torch.float32).contiguous()
    return out


def save_adapter(state: dict[str, torch.Tensor], out_dir: str, lora_cfg: dict, base_model: str | None = None) -> None:
    os.makedirs(out_dir, exist_ok=True)
    meta = {"format": ADAPTER_FORMAT, "base_model": base_model, **lora_cfg}
    tmp = os.path.join(out_dir, ".adapter_model.safetensors.tmp")
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(meta, f, indent=2)


def read_adapter_config(adapter_dir: str) -> dict:
    path = os.path.join(adapter_dir, "adapter_config.json")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != ADAPTER_FORMAT:
        raise ValueError(f"{path}: not a moetune adapter (format {meta.get('format')!r}); "
                         "PEFT adapters load with peft.PeftModel on transformers")
    return meta


@torch.no_grad()
def load_adapter(model, adapter_dir: str) -> None:
    meta = read_adapter_config(adapter_dir)
    apply_lora(model, meta["targets"], meta["rank"], meta["alpha"], 0.0, meta.get("rslora", False))
    state = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    missing = [k for k in params if ".lora" in k and k not in state]
    unexpected = [k for k in state if k not in params]
    if missing or unexpected:
        raise ValueError(f"{adapter_dir}: adapter does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for k, v in state.items():
        p = params[k]
        if p.shape != v.shape:
            raise ValueError(f"{adapter_dir}: {k} has shape {list(v.shape)}, model expects {list(p.shape)}")
        p.copy_(v.to(device=p.device, dtype=p.dtype))
