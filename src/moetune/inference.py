"""Try a trained model from Python (and behind `moetune generate` and `moetune chat`).

    model, tokenizer = moetune.load_for_generation("runs/demo")             # a run dir: base + its adapter
    moetune.generate(model, "upper: abc", tokenizer=tokenizer, max_new_tokens=8)   # -> "ABC"
    moetune.generate(model, input_ids, max_new_tokens=8)                     # ids in, ids out (greedy)

What is loaded: a run directory (or its adapter/, or a training checkpoint) is its base plus the adapter — the base
it trained on (model.path, or a random-init base rebuilt bit for bit into RUN/base/), or --base; any other directory
is an HF checkpoint. Prompts go through the tokenizer's chat template unless --raw. Decoding (model/generation.py)
keeps a KV cache; greedy by default, --temperature/--top-p sample. CPU for the demo; --device cuda for larger
models (the whole model on one GPU).
"""

from __future__ import annotations

import json
import os

import torch

from moetune.errors import CheckpointError, DeviceError, RunContentsError
from moetune.model.generation import generate as generate_ids
from moetune.text import check_text

# Where GLM's chat format ends an assistant turn: the next role tag, or the end of text.
_STOP_TOKENS = ("<|user|>", "<|observation|>", "<|endoftext|>")


def _is_moetune_source(path: str) -> bool:
    """A run dir (adapter/, checkpoints/, or only its config.yaml so far), an adapter dir or a training checkpoint
    (as opposed to an HF model directory, which has a config.json)."""
    p = os.fspath(path)
    has = lambda name: os.path.exists(os.path.join(p, name))  # noqa: E731
    return (any(has(f) for f in ("adapter", "adapter_config.json", ".metadata", "checkpoints"))
            or (has("config.yaml") and not has("config.json")))


def _adapter_of(source: str) -> str:
    """The adapter a run (or adapter dir, or checkpoint) holds; a run that has none yet says so."""
    from pathlib import Path

    from moetune.export.adapter import resolve_adapter_dir
    from moetune.run_dir import latest_checkpoint

    is_run = not any(os.path.exists(os.path.join(source, f)) for f in ("adapter", "adapter_config.json", ".metadata"))
    if is_run and latest_checkpoint(Path(source) / "checkpoints") is None:
        raise RunContentsError(f"{source}: a run with no adapter and no complete checkpoint yet (the adapter is "
                               "written when training ends; checkpoint.every N writes checkpoints while it runs)")
    return resolve_adapter_dir(source)


def pick_device(device: str | None, label: str = "device") -> str:
    """The device to load on: None/"auto" is cuda when present, else cpu. One this machine does not have is a
    DeviceError naming `label` (the flag or argument it came from), before torch's AssertionError."""
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise DeviceError(f"{label} {device}: not a device (auto, cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda" and not (torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()):
        raise DeviceError(f"{label} {device}: this machine has {torch.cuda.device_count()} usable CUDA GPUs "
                          "(cpu, or auto)")
    return str(device)


def load_for_generation(source: str, base: str | None = None, adapter: str | None = None, device: str | None = None,
                        dtype: str | None = None):
    """(model, tokenizer) for a run directory / adapter / checkpoint, or an HF checkpoint directory (optionally with
    a moetune `adapter`). dtype default: bfloat16 on a GPU, float32 on the CPU."""
    from moetune.export.adapter import resolve_adapter_dir
    from moetune.model.hf_io import load_model
    from moetune.export.run_base import resolve_base
    from moetune.model.adapter_io import read_adapter_config

    if not os.path.isdir(source):
        raise CheckpointError(f"{source}: no such run directory or model directory" if not os.path.exists(source)
                              else f"{source}: not a directory (a run directory or an HF checkpoint directory)")
    adapter = resolve_adapter_dir(adapter) if adapter is not None else None  # given: it wins over the run's own
    if _is_moetune_source(source):
        if adapter is None or base is None:
            own = _adapter_of(source)
            base = resolve_base(own, read_adapter_config(own), base)
            if not base:
                raise CheckpointError(f"{own}: the adapter names no base model: pass --base")
            adapter = adapter or own
    else:
        if not os.listdir(source):
            raise CheckpointError(f"{source}: an empty directory: neither a moetune run (config.yaml, adapter/, "
                                  "checkpoints/) nor an HF checkpoint (config.json)")
        base = base or source
    if not os.path.isfile(os.path.join(base, "config.json")):
        raise CheckpointError(f"{base}: neither a moetune run (config.yaml, adapter/, checkpoints/) nor an HF "
                              "checkpoint directory (no config.json)")
    device = pick_device(device)
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    # a base trained in fp8 (model.quantize) is rebuilt in fp8; an FP8 checkpoint is read as stored anyway
    quantize = read_adapter_config(adapter).get("base_quantize") if adapter is not None else None
    model = load_model(base, device=device, dtype=dtype, adapter=adapter, quantize=quantize)
    return model, load_tokenizer_for(base)


def load_tokenizer_for(model_dir: str):
    from moetune.data import load_tokenizer

    has_tok = any(os.path.exists(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    return load_tokenizer(model_dir if has_tok else None)


def default_stop_ids(tokenizer, model_dir: str | None = None) -> list[int]:
    """eos, the chat format's turn ends, and generation_config.json's eos_token_id(s)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in _STOP_TOKENS if t in vocab)
    gen = os.path.join(model_dir, "generation_config.json") if model_dir else None
    if gen and os.path.isfile(gen):
        with open(gen) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return sorted(ids)


def encode_prompt(tokenizer, messages_or_text, chat: bool = True) -> torch.Tensor:
    """Token ids [1, S] of a prompt: messages (or a text as one user message) through the chat template, ready for
    the assistant's reply; with chat=False the text as is."""
    if isinstance(messages_or_text, str):
        check_text(messages_or_text, "the prompt")
    else:
        for i, m in enumerate(messages_or_text):
            check_text(m["content"], f"message {i + 1} ({m.get('role', 'user')})")
    if chat and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "user", "content": messages_or_text}] if isinstance(messages_or_text, str)
                    else messages_or_text)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = messages_or_text if isinstance(messages_or_text, str) else "\n".join(m["content"] for m in messages_or_text)
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]], dtype=torch.long)


def generate(model, prompt, tokenizer=None, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
             seed: int | None = None, chat: bool = True, stop_ids=None):
    """Generate from `prompt`: a tensor of token ids [B, S] (returns ids [B, S + n]), or a text / a list of
    messages with `tokenizer` (returns the reply as text, stop tokens removed)."""
    if isinstance(prompt, torch.Tensor):
        stops = stop_ids if stop_ids is not None else (default_stop_ids(tokenizer) if tokenizer else [])
        return generate_ids(model, prompt, max_new_tokens, temperature, top_p, stops, seed)
    if tokenizer is None:
        raise ValueError("a text prompt needs the tokenizer (load_for_generation returns it)")
    ids = encode_prompt(tokenizer, prompt, chat)
    stops = stop_ids if stop_ids is not None else default_stop_ids(tokenizer)
    out = generate_ids(model, ids, max_new_tokens, temperature, top_p, stops, seed)
    return _decode(tokenizer, out[0, ids.shape[1]:].tolist(), stops)


def _decode(tokenizer, ids: list[int], stops) -> str:
    stops = set(stops)
    cut = next((i for i, t in enumerate(ids) if t in stops), len(ids))
    return tokenizer.decode(ids[:cut], skip_special_tokens=True)
