"""Loading a sync's buckets into a vLLM model, shared by the "moetune" weight-transfer backend (vllm_engine.py) and
the worker extension (vllm.py). Nothing here imports vLLM: a fake model with `load_weights` is enough to test it."""

from __future__ import annotations

from moetune.sync.wire import Bucket


def load_weights_consumer(model, copy: bool = False):
    """consume(bucket) that hands the bucket's (HF name, tensor) pairs to model.load_weights. copy: hand over copies,
    for a loader that keeps tensors past the call (the bucket's memory is reused for a later bucket)."""

    def consume(bucket: Bucket) -> None:
        if bucket.format == "adapter":
            raise ValueError("an adapter sync carries LoRA tensors, which vLLM's load_weights does not take: sync "
                             "merged weights (lora='merge') or serve the adapter "
                             "(`moetune export adapter --format vllm`)")
        tensors = bucket.tensors()
        model.load_weights(weights=[(n, t.clone()) for n, t in tensors] if copy else tensors)

    return consume


def repack_cpu_experts(model) -> None:
    """vLLM's CPU MoE backend packs the expert weights into its grouped-GEMM layout once, when the model loads; a
    weight update skips that step (vLLM 0.32, UnquantizedFusedMoEMethod._setup_kernel runs the experts' own
    process_weights_after_loading on the first call only), which leaves plain weights where the kernel reads packed
    ones. Pack them again. GPU backends read the weights as loaded: nothing to do there."""
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__name__.startswith("CPU"):
            experts.process_weights_after_loading(module)
