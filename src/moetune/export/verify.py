"""`--verify`: reload an export with transformers/PEFT and compare its logits to moetune's model with the native
adapter. Whole models are loaded in fp32 on the CPU (three for a merged export), so this is meant for proxies
and small models; the numbers it returns are relative errors ‖a−b‖/‖b‖ over a few random sequences."""

from __future__ import annotations

import json
import logging
import os
import warnings

import torch

from moetune.errors import VerificationError
from moetune.model.adapter_io import read_adapter, read_adapter_config
from moetune.model.hf_io import as_dtype, load_model
from moetune.model.quant.checkpoint import checkpoint_scheme
from moetune.model.quant.modules import dequantize_model, fp8_weights, stacked_parts
from moetune.names import ATTENTION_TARGETS, MLA_ATTENTION_TARGETS

ATTENTION = ATTENTION_TARGETS + MLA_ATTENTION_TARGETS  # LoRA Linear in PEFT (unlike the MLPs, see verify_vllm_adapter)

TOLERANCE = 1e-4  # relative logit error ‖a−b‖/‖b‖ an export must stay within


log = logging.getLogger("moetune")

def _sample_ids(vocab: int, n: int = 3, seq: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _check(errors: dict, tol: float, what: str) -> dict:
    bad = {k: v for k, v in errors.items() if not v <= tol}  # NaN is never within tolerance
    if bad:
        raise VerificationError(f"verify {what}: logits differ beyond {tol:g} (relative): {bad}")
    return errors


@torch.no_grad()
def verify_peft_adapter(native_dir: str, peft_dir: str, base_path: str, tol: float = TOLERANCE) -> dict:
    from peft import PeftModel

    log.info("verify: loading the base with the adapter in moetune and in PEFT (transformers)")
    ours = load_model(base_path, dtype="float32", adapter=native_dir)
    ids = _sample_ids(ours.config.vocab_size)
    want = ours(ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = PeftModel.from_pretrained(_hf(base_path), peft_dir).eval()
    errors = {"peft_vs_moetune": _rel(theirs(input_ids=ids).logits, want)}
    with theirs.disable_adapter():
        # an adapter PEFT silently failed to attach would leave the base model: make that visible
        errors["base_vs_moetune_info"] = _rel(theirs(input_ids=ids).logits, want)
    return _check({k: v for k, v in errors.items() if not k.endswith("_info")}, tol, "peft") | errors


@torch.no_grad()
def verify_vllm_adapter(native_dir: str, vllm_dir: str, base_path: str, tol: float = TOLERANCE) -> dict:
    """vLLM is not imported here (it needs a GPU). Checks: (1) the per-expert tensors stack back exactly into the
    native adapter; (2) where PEFT can read this layout (it is the transformers-v4 MoE layout, which PEFT converts
    for v5 models: attention and routed experts, without rsLoRA, whose alpha PEFT's conversion doubles), the
    logits PEFT gets from it equal moetune's."""
    from safetensors.torch import load_file

    from moetune.export.vllm_layout import from_vllm_state_dict

    native, meta = read_adapter(native_dir)
    back = from_vllm_state_dict(load_file(os.path.join(vllm_dir, "adapter_model.safetensors")))
    if set(back) != set(native) or any(not torch.equal(back[k], native[k]) for k in native):
        diff = sorted(set(back) ^ set(native))[:3] or [k for k in native if not torch.equal(back[k], native[k])][:3]
        raise VerificationError(f"verify vllm: the exported tensors do not map back to the adapter (e.g. {diff})")
    report = {"tensors_round_trip": True}
    if set(meta["targets"]) <= set(ATTENTION) | {"experts"} and not meta.get("rslora"):
        report.update(verify_peft_adapter(native_dir, vllm_dir, base_path, tol))
    return report


def _merge_in_memory(model) -> None:
    """W += scaling·B·A for every LoRA module of our model, then drop the LoRA (an implementation independent of
    the streaming one in merged.py, so the two check each other)."""
    from moetune.model.lora import LoRALinear

    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.weight += (module.lora_B @ module.lora_A) * module.scaling
            module.lora_B.zero_()
        lora = getattr(module, "lora", None)
        if lora is not None and hasattr(module, "gate_up_proj"):
            module.gate_up_proj += torch.bmm(lora.gate_up_B, lora.gate_up_A) * lora.scaling
            module.down_proj += torch.bmm(lora.down_B, lora.down_A) * lora.scaling
            module.lora = None


@torch.no_grad()
def verify_merged(base_path: str, adapter_dir: str, merged_dir: str, tol: float = TOLERANCE) -> dict:
    """(1) transformers and moetune read the merged checkpoint alike; (2) it equals moetune's base+adapter merged
    in memory and rounded to the export dtype; (3, information) how far rounding moved it from base+adapter."""
    with open(os.path.join(merged_dir, "config.json")) as f:
        cfg = json.load(f)
    dtype = as_dtype(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    log.info("verify: loading the merged checkpoint in moetune and transformers, and base + adapter in moetune")
    merged = load_model(merged_dir, dtype="float32")
    ids = _sample_ids(merged.config.vocab_size)
    got = merged(ids)
    requantised = checkpoint_scheme(merged_dir)
    errors = {}
    if requantised is None:  # transformers reads compressed-tensors only with that package: checked without fp8
        errors["transformers_vs_moetune"] = _rel(_hf(merged_dir)(input_ids=ids).logits, got)
    quantize = read_adapter_config(adapter_dir).get("base_quantize")
    ref = load_model(base_path, dtype="float32", adapter=adapter_dir, quantize=quantize)
    unrounded = ref(ids)
    dequantize_model(ref)  # an fp8 base: merged into its dequantised weights, as the export does
    _merge_in_memory(ref)
    fp8_out = {name for name, _ in fp8_weights(merged)}  # what the export wrote in fp8 (not what its config ignores)
    for name, p in ref.named_parameters():
        if name in fp8_out:
            p.copy_(requantised.dequantize(*requantised.quantize(p, stacked_parts(name))))  # as the export: per part
        else:
            p.copy_(p.to(dtype).float())
    errors["merged_vs_reference"] = _rel(got, ref(ids))
    _check(errors, tol, "merged")
    errors["merged_vs_unmerged_info"] = _rel(got, unrounded)
    return errors
