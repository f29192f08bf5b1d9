"""Weight streaming from the trainer to inference workers.

Trainer (every rank of the training group; the sending rank also holds the sync group):

    from moetune.sync import WeightSender, connect
    group = connect("tcp://trainer0:29600", rank=0, world_size=1 + n_workers) if train_rank == 0 else None
    sender = WeightSender(model, group, format="bf16")      # "fp8": routed experts in block fp8; "fp8_rows": an FP8
                                                            # base's fp8 weights with row scales; lora="adapter"
    sender.sync()

Inference worker (rank 1..n of the sync group):

    group = connect("tcp://trainer0:29600", rank=1, world_size=1 + n_workers)
    receive_into(group, model)                               # moetune's or transformers' model (GLM-4.5, 4.7-Flash, 5)
    receive(group, lambda bucket: engine.load_weights(bucket.tensors()))

vLLM: its own weight-transfer API with the "moetune" backend (vllm_engine.py: MoetuneSource, MoetuneTrainerInitInfo,
LLMClient; `weight_transfer_config={"backend": "moetune"}`), or the older worker extension (vllm.py).

Before any weight moves, receivers check the header against their model (a model that differs refuses: SyncRefused
on every member); every wait is bounded by a deadline that scales with the bytes and names the member that did not
answer (SyncTimeout).

Modules: wire (format), fp8 (block quantization; rows: model/quant/fp8.py), group (rendezvous, deadlines), shards
(gathering from FSDP/EP shards), plan (what goes in which bucket, and the memory bound), sender, receiver, vllm_load
(loading into a vLLM model), vllm_engine (vLLM's weight-transfer API), vllm (worker extension).
"""

from moetune.sync.group import SyncError, SyncGroup, SyncRefused, SyncTimeout, connect, host_store
from moetune.sync.receiver import ModelUpdater, receive, receive_into
from moetune.sync.sender import WeightSender
from moetune.sync.wire import Bucket

__all__ = ["Bucket", "ModelUpdater", "SyncError", "SyncGroup", "SyncRefused", "SyncTimeout", "WeightSender", "connect",
           "host_store", "receive", "receive_into"]
