"""Weight sync acceptance on CPU: 2 trainer ranks (FSDP2 over a gloo training group of 2; 4 ranks for FSDP × EP) and
1 receiver process, joined by a separate sync group through its own TCP rendezvous.

The trainer builds a LoRA model and a full fine-tuning model the way train/setup.py does (meta → LoRA → FSDP →
materialise), takes one optimizer step on each (so the sync reads post-training sharded state), then syncs bf16,
fp8 and adapter-only; then one more step and the first sender again (its cached plan, new weights). It gathers its
full state after each round (full_tensor, test-side only) for the reference. The
receiver's weights must equal the trainer's — bf16 bit for bit (LoRA merged in fp32 as export merges it), fp8
equal to the reference quantization and within its documented error bound — and the sending rank's tracked
allocations must stay under 1.25 × the largest layer's wire bytes + one expert's bf16 bytes.
Two more trainer models have an fp8 base, sharded as stored: row scales, synced in format fp8_rows, and 16×32-block
scales, synced in format fp8 (requantised in the wire's 128×128 blocks): what the receiver gets equals, bit for bit,
the same model built in one process, merged and requantised by rows or blocks.
"""

import os
import traceback

import torch
import torch.multiprocessing as mp

from helpers import free_port

SCALING = 2.0  # alpha 8 / rank 4
SYNCS = [("lora", dict(format="bf16")), ("lora", dict(format="fp8")), ("lora", dict(lora="adapter")),
         ("full", dict(format="bf16")), ("full", dict(format="fp8")), ("lora_fp8", dict(format="fp8_rows")),
         ("lora_fp8_block", dict(format="fp8"))]
FP8_BASES = {"lora_fp8": "rows", "lora_fp8_block": (16, 32)}  # the trainer models on an fp8 base: their scales
MLA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "shared_experts", "experts"]
TARGETS = {"glm4_moe": ["q_proj", "v_proj", "o_proj", "shared_experts", "experts"],
           "glm4_moe_lite": MLA_TARGETS, "glm_moe_dsa": MLA_TARGETS}
_MLA = dict(vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=4, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=12,
            qk_rope_head_dim=8, v_head_dim=10, first_k_dense_replace=1)
FAMILY = {  # GLM-4.7-Flash; GLM-5 with index_topk 8 < the 16 tokens of a step, so the indexer selects
    "glm4_moe_lite": dict(_MLA, model_type="glm4_moe_lite"),
    "glm_moe_dsa": dict(_MLA, model_type="glm_moe_dsa", index_topk=8, index_head_dim=16, index_n_heads=4,
                        indexer_types=["full", "shared", "full"]),
}


def _config(kind="glm4_moe"):
    from moetune.model.config import TINY, ModelConfig

    base = TINY if kind == "glm4_moe" else FAMILY[kind]
    return ModelConfig.from_hf_dict(dict(base, num_hidden_layers=3, n_routed_experts=6))  # 6 experts: 3 a rank


def _trainer_model(dist, full: bool, ep: int, kind: str, fp8=None):
    """fp8: the base's scales ("rows" or a block), FP8_BASES. dist None: the same model in one process, unsharded
    (fp8 only: the reference of its sync)."""
    from moetune.parallel import apply as parallel
    from moetune.model.hf_io import _param_seed, build_model, cast_model, init_weights
    from moetune.model.quant.fp8 import ROWWISE, Fp8Scheme
    from moetune.model.quant.modules import quantize_model
    from moetune.tensors import local_index, local_tensor
    from moetune.model.lora import apply_lora

    model = build_model(_config(kind), "meta")
    cast_model(model, torch.float32 if full else torch.bfloat16)
    if fp8:
        quantize_model(model, ROWWISE if fp8 == "rows" else Fp8Scheme(fp8))
    if not full:
        apply_lora(model, TARGETS[kind], 4, 8.0)
    if ep > 1:
        parallel.apply_ep(model, dist.mesh["ep"])
    if dist is not None:  # an fp8 base is gathered as stored (setup.py passes no param_dtype for it)
        parallel.apply_fsdp(model, dist.mesh, param_dtype=None if fp8 else torch.bfloat16)
    model.to_empty(device="cpu")
    with torch.no_grad():
        init_weights(model, seed=0)
        for name, p in model.named_parameters():  # LoRA B nonzero, drawn whole and sliced: sharding-independent
            if ".lora" in name:
                idx, shape = local_index(p)
                g = torch.Generator().manual_seed(_param_seed(1, name))
                local_tensor(p).copy_((torch.randn(shape, generator=g) * 0.1)[idx])
    if fp8:
        return model, None  # synced as initialised: its one-process twin is the reference
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    g = torch.Generator().manual_seed(2)

    def step():
        ids = torch.randint(0, 160, (1, 16), generator=g)
        model(ids, labels=torch.roll(ids, -1, 1)).backward()
        opt.step()
        opt.zero_grad()

    step()
    return model, step


def _guard(fn, out_dir, role, *args):
    try:
        torch.set_num_threads(1)
        fn(out_dir, *args)
    except BaseException:
        with open(os.path.join(out_dir, f"error_{role}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _trainer(out_dir, rank, world, train_port, sync_addr, ep, kind):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(train_port))
    from moetune.parallel.layout import make_layout
    from moetune.parallel.mesh import init_distributed
    from moetune.sync import WeightSender, connect

    dist = init_distributed(make_layout(world, ep, n_layers=3, n_experts=6), device="cpu")
    (lora, lora_step), (full, _) = _trainer_model(dist, False, ep, kind), _trainer_model(dist, True, ep, kind)
    models = {"lora": lora, "full": full,
              **{which: _trainer_model(dist, False, ep, kind, fp8=base)[0] for which, base in FP8_BASES.items()}}
    group = connect(sync_addr, 0, 2, "cpu", timeout_s=120) if rank == 0 else None
    senders = [WeightSender(models[which], group, **kw) for which, kw in SYNCS]
    stats = [s.sync() for s in senders]

    def snapshot(m):  # test-side reference only: every rank materialises everything
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in list(m.named_parameters()) + list(m.named_buffers())}

    full = {which: snapshot(m) for which, m in models.items() if which not in FP8_BASES}  # fp8: its one-process twin
    lora_step()  # train on, and sync again with the first sender: its cached plan, the new weights
    stats.append(senders[0].sync())
    full["lora_again"] = snapshot(lora)
    experts = models["lora"].model.layers[1].mlp.experts.gate_up_proj
    if rank == 0:  # how many of the 6 experts rank 0 holds itself: proof that the sync had to gather
        torch.save({"stats": stats, "state": full, "placements": str(experts.placements),
                    "local_experts": experts.to_local().shape[0]}, os.path.join(out_dir, "trainer.pt"))
        group.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _receiver(out_dir, sync_addr, kind):
    from moetune.model.hf_io import build_model, cast_model
    from moetune.model.lora import apply_lora
    from moetune.sync import connect, receive_into

    plain = build_model(_config(kind), "cpu")
    cast_model(plain, torch.bfloat16)
    with_lora = build_model(_config(kind), "cpu")
    apply_lora(with_lora, TARGETS[kind], 4, 8.0)
    group = connect(sync_addr, 1, 2, "cpu", timeout_s=120)
    got = []
    for _, kw in SYNCS + SYNCS[:1]:
        model = with_lora if kw.get("lora") == "adapter" else plain
        stats = receive_into(group, model)
        got.append({"stats": stats, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}})
    torch.save(got, os.path.join(out_dir, "receiver.pt"))
    group.close()


def _run(tmp_path, trainers=2, ep=1, kind="glm4_moe"):
    out = str(tmp_path)
    sync_addr = f"tcp://127.0.0.1:{free_port()}"
    train_port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_guard, args=(_trainer, out, f"trainer{r}", r, trainers, train_port, sync_addr, ep,
                                              kind)) for r in range(trainers)]
    procs.append(ctx.Process(target=_guard, args=(_receiver, out, "receiver", sync_addr, kind)))
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    errors = [open(os.path.join(out, f)).read() for f in sorted(os.listdir(out)) if f.startswith("error_")]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not errors and all(p.exitcode == 0 for p in procs), "\n".join(errors) or [p.exitcode for p in procs]
    return torch.load(os.path.join(out, "trainer.pt")), torch.load(os.path.join(out, "receiver.pt"))


# ------------------------------------------------------------------------------------------------ references
def _merged_fp32(state: dict) -> dict:
    """Base tensors with LoRA merged in fp32 (W + s·B·A, as export/merged.py), expert by expert."""
    out = {}
    for name, W in state.items():
        if ".lora" in name:
            continue
        prefix, leaf = name.rsplit(".", 1)
        if leaf in ("gate_up_proj", "down_proj") and f"{prefix}.lora.gate_up_A" in state:
            which = leaf.removesuffix("_proj")
            A, B = state[f"{prefix}.lora.{which}_A"], state[f"{prefix}.lora.{which}_B"]
            W = torch.stack([W[e].float() + (B[e].float() @ A[e].float()) * SCALING for e in range(W.shape[0])])
        elif leaf == "weight" and f"{prefix}.lora_A" in state:
            W = W.float() + (state[f"{prefix}.lora_B"].float() @ state[f"{prefix}.lora_A"].float()) * SCALING
        out[name] = W.float()
    return out


def _fp8_reference(kind, which) -> dict:
    """What a receiver of an fp8 base's sync holds (bf16): the trainer's fp8 model built in one process, each fp8
    weight dequantised, LoRA merged in fp32, requantised (fp8_rows: a row at a time; fp8: per 128×128 block, the
    routed experts too, gate and up apart), dequantised again."""
    from moetune.model.quant.fp8 import quantize_rows
    from moetune.model.quant.modules import fp8_weights, scale_name
    from moetune.names import INDEXER_FP8_RE
    from moetune.sync.fp8 import dequantize, quantize

    model, _ = _trainer_model(None, False, 1, kind, fp8=FP8_BASES[which])
    state = {n: t.detach() for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    fp8 = {w: (scale_name(w, q), q) for w, q in fp8_weights(model)}
    assert fp8 and all(n in state for n, _ in fp8.values())
    for w, (s, q) in fp8.items():
        state[w] = q.dequantize(state[w], state.pop(s))
    out = {}
    for name, w in _merged_fp32(state).items():
        if FP8_BASES[which] == "rows" and name in fp8:
            q, s = quantize_rows(w)
            w = q.float() * s
        elif FP8_BASES[which] != "rows" and (name in fp8 or name.endswith(("experts.gate_up_proj", "down_proj"))
                                             or INDEXER_FP8_RE.search(name)):  # as block-FP8 releases store it
            parts = w.chunk(2 if name.endswith("gate_up_proj") else 1, dim=-2)  # gate and up blocked apart
            w = torch.cat([dequantize(*quantize(part)) for part in parts], dim=-2)
        out[name] = w if name.endswith("e_score_correction_bias") else w.to(torch.bfloat16)
    return out


def _check(trainer, receiver, kind="glm4_moe"):
    from moetune.sync.fp8 import dequantize, error_bound, quantize

    I = _config(kind).moe_intermediate_size
    syncs = SYNCS + [("lora_again", SYNCS[0][1])]  # the last: after another step, on the first sender's cached plan
    assert len(receiver) == len(trainer["stats"]) == len(syncs)
    first, again = receiver[0]["state"], receiver[-1]["state"]
    assert any(not torch.equal(first[n], again[n]) for n in first)  # the second sync carried the new weights
    for k, ((which, kw), got) in enumerate(zip(syncs, receiver)):
        sent = trainer["stats"][k]
        assert sent["bytes"] == got["stats"]["bytes"] > 0 and sent["buckets"] == got["stats"]["buckets"]
        assert sent["peak_alloc"] <= sent["bound"], (which, kw, sent)
        if which in FP8_BASES:
            want = _fp8_reference(kind, which)
            assert want.keys() == {n for n in got["state"] if ".lora" not in n}
            for name, w in want.items():
                assert torch.equal(got["state"][name], w), name
            continue
        state = trainer["state"][which]
        if kw.get("lora") == "adapter":
            lora = {n: t for n, t in state.items() if ".lora" in n}
            for n, t in lora.items():
                assert torch.equal(got["state"][n], t), n
            continue
        for name, w in _merged_fp32(state).items():
            recv = got["state"][name]
            if name.endswith("e_score_correction_bias"):
                assert torch.equal(recv, w), name
            elif kw["format"] == "fp8" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                halves = [slice(0, I), slice(I, 2 * I)] if name.endswith("gate_up_proj") else [slice(None)]
                for rows in halves:
                    q, s = quantize(w[:, rows])
                    assert torch.equal(recv[:, rows], dequantize(q, s).to(torch.bfloat16)), name
                    bound = error_bound(w[:, rows], s) + w[:, rows].abs() * 2.0**-8  # + the receiver's bf16 rounding
                    assert ((recv[:, rows].float() - w[:, rows]).abs() <= bound).all(), name
            else:
                assert torch.equal(recv, w.to(torch.bfloat16)), (which, kw, name)


def test_fsdp_trainer_to_receiver(tmp_path):
    trainer, receiver = _run(tmp_path)
    assert trainer["local_experts"] == 3, trainer["placements"]
    _check(trainer, receiver)


def test_fsdp_and_ep_trainer_to_receiver(tmp_path):
    """4 trainer ranks, dp_shard 2 × ep 2: each rank holds part of one ep rank's experts (3 of 6, split 2 + 1
    by FSDP), the rest of the model FSDP-sharded over all 4."""
    trainer, receiver = _run(tmp_path, trainers=4, ep=2)
    assert trainer["local_experts"] == 2, trainer["placements"]
    _check(trainer, receiver)


def test_mla_fsdp_trainer_to_receiver(tmp_path):
    """GLM-4.7-Flash: LoRA on every MLA projection, FSDP over 2 ranks."""
    trainer, receiver = _run(tmp_path, kind="glm4_moe_lite")
    assert trainer["local_experts"] == 3, trainer["placements"]
    assert any(".kv_a_proj_with_mqa." in n for n in receiver[0]["state"])
    _check(trainer, receiver, "glm4_moe_lite")


def test_dsa_ep_trainer_to_receiver(tmp_path):
    """GLM-5 (MLA + indexer, which trains no weights but is streamed) on 2 ranks, ep 2: each rank holds 3 experts."""
    trainer, receiver = _run(tmp_path, ep=2, kind="glm_moe_dsa")
    assert trainer["local_experts"] == 3, trainer["placements"]
    assert any(".indexer.weights_proj." in n for n in receiver[0]["state"])
    _check(trainer, receiver, "glm_moe_dsa")
