"""Weight streaming from the trainer to inference workers.

Trainer (every rank of the training group; the sending rank also holds the sync group):

    from moetune.sync import WeightSender, connect
    group = connect("tcp://trainer0:29600", rank=0, world_size=1 + n_workers) if train_rank == 0 else None
    sender = WeightSender(model, group, format="bf16")      # "fp8": routed experts in block fp8; lora="adapter"
    sender.sync()

Inference worker (rank 1..n of the sync group):

    group = connect("tcp://trainer0:29600", rank=1, world_size=1 + n_workers)
    receive_into(group, model)                               # moetune's or transformers' model (GLM-4.5, 4.7-Flash, 5)
    receive(group, lambda bucket: engine.load_weights(bucket.tensors()))
    # vLLM: worker_extension_cls="moetune.sync.vllm.WeightSyncExtension"

Modules: wire (format), fp8 (block quantization), group (rendezvous), shards (gathering from FSDP/EP shards),
plan (what goes in which bucket, and the memory bound), sender, receiver, vllm.
"""

from moetune.sync.group import SyncGroup, connect
from moetune.sync.receiver import ModelUpdater, receive, receive_into
from moetune.sync.sender import WeightSender
from moetune.sync.wire import Bucket

__all__ = ["Bucket", "ModelUpdater", "SyncGroup", "WeightSender", "connect", "receive", "receive_into"]
