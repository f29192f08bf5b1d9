"""moetune: fine-tune GLM-4.5-family mixture-of-experts models with LoRA or fully, on 1 to N processes."""

from moetune.version import __version__


def load_model(path, device="cpu", dtype=None, adapter=None):
    """Load an HF-format GLM-4.5 checkpoint directory (optionally with a moetune adapter)."""
    from moetune.inference import pick_device
    from moetune.model.hf_io import load_model as _load

    return _load(path, device=pick_device(device), dtype=dtype, adapter=adapter)


def load_for_generation(source, base=None, adapter=None, device=None, dtype=None):
    """(model, tokenizer) of a run directory (base + its adapter) or an HF checkpoint directory."""
    from moetune.inference import load_for_generation as _load

    return _load(source, base=base, adapter=adapter, device=device, dtype=dtype)


def generate(model, prompt, tokenizer=None, max_new_tokens=64, temperature=0.0, top_p=1.0, seed=None, chat=True,
             stop_ids=None):
    """Generate with a KV cache on a model from `load_model` / `load_for_generation`: token ids [B, S] in, ids out;
    or a text / a list of chat messages with `tokenizer`, the reply's text out. Greedy unless temperature > 0."""
    from moetune.inference import generate as _generate

    return _generate(model, prompt, tokenizer, max_new_tokens, temperature, top_p, seed, chat, stop_ids)


def __getattr__(name):
    # the step API without importing the trainer (torch.distributed, the data stack) into `import moetune`
    if name in ("Trainer", "load_config"):
        from moetune.config import load_config
        from moetune.train.trainer import Trainer

        return {"Trainer": Trainer, "load_config": load_config}[name]
    raise AttributeError(f"module 'moetune' has no attribute {name!r}")


__all__ = ["load_model", "load_for_generation", "generate", "Trainer", "load_config", "__version__"]
