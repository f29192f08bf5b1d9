"""Memory-bounded loading of HF checkpoints: a rank reads only the slices it owns.

A subprocess plays rank 3 of 16 (a fake process group: no other process, no communication) and loads a
synthetic 286 MiB checkpoint, in the hub's per-expert layout, into an FSDP2-sharded model. The growth of its
peak RSS during the load must stay within a bound derived from its shard (1/16 of the model: 17.9 MiB),
far below the size of the checkpoint. Measured here: 39-47 MiB, about 1x the shard itself + ~22 MiB of file
pages (safetensors reads through mmap, and the pages of the slices read stay mapped until the reader closes
at the end of the load) + the stacking of per-expert slices. A reader that copied each whole tensor before
slicing grows by ~235 MiB and fails (tried by hand); the 64 MiB embedding alone would break the bound."""

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import save_file

from moetune.model.config import TINY, ModelConfig
from moetune.model.hf_io import build_model

WORLD, RANK = 16, 3
BIG = dict(TINY, vocab_size=65536, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512,
           num_hidden_layers=4, n_routed_experts=32, num_attention_heads=8, num_key_value_heads=4, head_dim=64)

LOAD_AS_ONE_RANK = r"""
import json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from moetune.model import hf_io
from moetune.tensors import local_index, local_tensor
from moetune.model.config import ModelConfig
from moetune.parallel.apply import apply_fsdp

def status():  # bytes
    with open("/proc/self/status") as f:
        rows = (line.partition(":") for line in f)
        return {k: int(v.split()[0]) * 1024 for k, _, v in rows if k in ("VmRSS", "VmHWM", "RssFile")}

world, rank, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
model = hf_io.build_model(ModelConfig.from_json(path), "meta")
hf_io.cast_model(model, torch.bfloat16)
apply_fsdp(model, init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",)), param_dtype=torch.bfloat16)
model.to_empty(device="cpu")
# warm up first-use imports and caches on one small tensor, so that the measure is about the data
norm, reader = model.model.norm.weight, hf_io._Reader(path)
with torch.no_grad():
    local_tensor(norm).copy_(reader.read("model.norm.weight", local_index(norm)[0]))
del reader
# Drop the files from the page cache, so that the file pages the reads map are faulted in at the size they ask
# for (file pages mapped count in RSS), whatever the writer left behind.
for name in os.listdir(path):
    fd = os.open(os.path.join(path, name), os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
# For information: the file pages mapped, seen after each read (the reader keeps them until it closes).
file_pages, read = [0], hf_io._Reader.read
def read_and_look(self, key, idx):
    out = read(self, key, idx)
    file_pages.append(status()["RssFile"])
    return out
hf_io._Reader.read = read_and_look
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak RSS to the current RSS: measure the load, not the set-up (ru_maxrss cannot)
before = status()
hf_io.load_hf_weights(model, path)  # strict: every rank checks all experts' presence from the index
peak = status()["VmHWM"] - before["VmRSS"]
shard = sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in model.state_dict().values())
print(json.dumps({"shard": shard, "peak_rss_growth": peak, "file_pages": max(file_pages) - before["RssFile"]}))
"""


def write_synthetic_checkpoint(path) -> int:
    """BIG's weights in the hub layout (experts one by one), bf16, in ~40 MB files; returns the bytes. The
    values do not matter here: zeros."""
    cfg = ModelConfig.from_hf_dict(BIG)
    os.makedirs(path)
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    model = build_model(cfg, "meta")
    tensors = {}
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        prefix, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj":
            for e in range(p.shape[0]):
                tensors[f"{prefix}.{e}.gate_proj.weight"] = (p.shape[1] // 2, p.shape[2])
                tensors[f"{prefix}.{e}.up_proj.weight"] = (p.shape[1] // 2, p.shape[2])
        elif leaf == "down_proj" and prefix.endswith("mlp.experts"):
            for e in range(p.shape[0]):
                tensors[f"{prefix}.{e}.down_proj.weight"] = tuple(p.shape[1:])
        else:
            tensors[name] = tuple(p.shape)
    shard, weight_map, total = {}, {}, 0
    for i, (key, shape) in enumerate(tensors.items()):
        shard[key] = torch.zeros(shape, dtype=torch.float32 if key.endswith("correction_bias") else torch.bfloat16)
        total += shard[key].nbytes
        if sum(t.nbytes for t in shard.values()) > 40e6 or i == len(tensors) - 1:
            fname = f"model-{len(set(weight_map.values())):05d}.safetensors"
            save_file(shard, str(path / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
            shard = {}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return total


def test_a_rank_reads_only_its_slices(tmp_path):
    total = write_synthetic_checkpoint(tmp_path / "hf")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", LOAD_AS_ONE_RANK, str(WORLD), str(RANK), str(tmp_path / "hf")],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    shard, peak = got["shard"], got["peak_rss_growth"]
    assert total > 15 * shard  # the checkpoint really is many shards large
    bound = 3 * shard + 16 * 2**20
    assert peak < bound, (f"peak RSS grew {peak / 2**20:.1f} MiB for a {shard / 2**20:.1f} MiB shard "
                          f"({got['file_pages'] / 2**20:.1f} MiB of file pages)")
    assert bound < total / 3  # reading even a third of the checkpoint would break the bound
