"""moetune: fine-tune GLM-4.5-family mixture-of-experts models with LoRA or fully, on 1 to N processes."""

__version__ = "0.1.0"


def load_model(path, device="cpu", dtype=None, adapter=None):
    """Load an HF-format GLM-4.5 checkpoint directory (optionally with a moetune adapter)."""
    from moetune.model.hf_io import load_model as _load

    return _load(path, device=device, dtype=dtype, adapter=adapter)


__all__ = ["load_model", "__version__"]
