"""Expert parallelism on 2 gloo processes, model level: every execution path of the EP layer computes what the
plain single-process model computes — torch.compile (dynamo traces the layer; the exchange is a graph break) in
training and in evaluation (no_grad), activation checkpointing that keeps the dispatched rows, with and without
the pipelined (overlapped) exchange — for LoRA (attention + shared + routed experts; attention only, where the
exchange frees the rows it received) and full fine-tuning."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import free_port

WORLD = 2
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, partial_rotary_factor=0.5, attention_bias=True)


def _model(full, rank=4):
    """full: False (LoRA of `rank` on attention, shared and routed experts), True (full fine-tuning) or "attention"
    (LoRA on attention only: the experts are frozen and the received rows need not be kept)."""
    from moetune.model.config import ModelConfig
    from moetune.model.hf_io import build_model, init_weights
    from moetune.model.lora import apply_lora
    from moetune.train.setup import init_lora

    torch.manual_seed(0)  # the same LoRA B on every rank and for every variant
    model = build_model(ModelConfig.from_hf_dict(TINY), "cpu")
    init_weights(model, 0.1, seed=0)
    if full is not True:
        targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
        targets += [] if full == "attention" else ["shared_experts", "experts"]
        apply_lora(model, targets, rank, 2 * rank)
        init_lora(model, seed=0)
        with torch.no_grad():  # B != 0, so expert LoRA changes the output and its A gets gradients
            for name, p in model.named_parameters():
                if name.endswith("_B") or name.endswith("lora_B"):
                    p.normal_(0, 0.1)
    else:
        for name, p in model.named_parameters():
            p.requires_grad_(True)
    return model


def _batch(rank):
    g = torch.Generator().manual_seed(10 + rank)
    ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=g)
    return ids, torch.roll(ids, -1, 1)


def _loss_and_grads(model, ids, labels):
    loss = model(ids, labels=labels)
    loss.backward()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = model(ids)  # evaluation: the exchange under no_grad
    return loss.detach(), grads, logits


def _worker(rank, port, full, variants):
    from moetune.parallel.mesh import shutdown_distributed

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    _check(full, variants)
    # as `moetune train` ends: the EP models (their exchanges ran gloo's async all_to_all) freed while the group
    # exists; destroyed with them still alive, a worker aborted at exit in about 1 run of 40
    shutdown_distributed(finished=True)


def _check(full, variants):
    from torch.distributed.device_mesh import init_device_mesh

    from moetune.parallel.apply import apply_ac, apply_compile, apply_ep

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
    ids, labels = _batch(rank)
    ref_loss, ref_grads, ref_logits = _loss_and_grads(_model(full), ids, labels)
    for chunks, ac, compile_backend in variants:
        model = _model(full)
        apply_ep(model, mesh, overlap_chunks=chunks)
        apply_ac(model, ac)
        if compile_backend:
            apply_compile(model, backend=compile_backend)
        loss, grads, logits = _loss_and_grads(model, ids, labels)
        what = f"chunks={chunks} ac={ac} compile={compile_backend}"
        torch.testing.assert_close(loss, ref_loss, msg=what)
        torch.testing.assert_close(logits, ref_logits, msg=what)
        # each rank's gradient is that of its own tokens only: the expert gradients of the EP model are the sum
        # over both ranks' tokens, the rest this rank's; compare the sum over ranks on both sides
        for name in ref_grads:
            mine, ref = grads[name].clone(), ref_grads[name].clone()
            dist.all_reduce(ref)
            if ".experts." not in name:
                dist.all_reduce(mine)
            torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-6, msg=f"{what}: {name}")
        assert grads.keys() == ref_grads.keys(), what


PLAIN = [(1, "none", None), (2, "none", None), (2, "full", None), (3, "selective", None)]
# "aot_eager" traces forward and backward as Inductor would (without its code generation, minutes on 2 CPU
# cores); "eager" stops after dynamo, where the DTensor-into-grouped_mm crash of d05efb6 happened
COMPILED = [(2, "none", "aot_eager"), (2, "full", "eager")]


@pytest.mark.parametrize("full,variants", [(False, PLAIN + COMPILED), (True, PLAIN + COMPILED[1:]),
                                           ("attention", PLAIN[:3])], ids=["lora", "full_ft", "lora_attention"])
def test_ep_paths_equal_plain_model(full, variants):
    mp.spawn(_worker, args=(free_port(), full, variants), nprocs=WORLD)


def _fp8_model(mesh, copies, targets):
    """TINY in bf16 with an fp8 base (row scales) and LoRA on `targets`; under expert parallelism (mesh) each rank
    holds its experts' fp8 stacks, and (copies) their kept transposed copies."""
    from moetune.model.config import ModelConfig
    from moetune.model.hf_io import build_model, cast_model, init_weights
    from moetune.model.lora import apply_lora
    from moetune.model.quant.fp8 import ROWWISE
    from moetune.model.quant.modules import keep_transposed_copies, quantize_model
    from moetune.parallel.apply import apply_ep
    from moetune.train.setup import init_lora

    model = build_model(ModelConfig.from_hf_dict(TINY), "meta")
    cast_model(model, torch.bfloat16)
    quantize_model(model, ROWWISE)
    apply_lora(model, targets, 4, 8)
    if mesh is not None:
        apply_ep(model, mesh)
    model.to_empty(device="cpu")
    init_weights(model, 0.1, seed=0)
    init_lora(model, seed=0)
    with torch.no_grad():  # B != 0 (by name, the same on every rank and for both models)
        for name, p in model.named_parameters():
            if name.endswith("_B") or name.endswith("lora_B"):
                full = torch.empty(p.shape, dtype=p.dtype).normal_(0, 0.1, generator=torch.Generator().manual_seed(
                    len(name)))
                p.copy_(full if not hasattr(p, "device_mesh") else
                        torch.distributed.tensor.distribute_tensor(full, p.device_mesh, p.placements))
    if copies:
        assert keep_transposed_copies(model) > 0
    return model


def _fp8_worker(rank, port, targets):
    from torch.distributed.device_mesh import init_device_mesh

    from moetune.model import grouped_gemm_tiles as tiles
    from moetune.model import grouped_gemm_tma as tma
    from moetune.model.quant import matmul
    from moetune.model.quant.modules import transposed_copy
    from moetune.parallel.mesh import shutdown_distributed

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    # the fp8 tensor-core path as a GPU takes it: the stacks through the TMA kernel (Triton's interpreter here), the
    # linears through torch._scaled_mm (a CPU kernel)
    matmul._fp8_kernels = lambda x, w8, scheme: x.dtype == torch.bfloat16
    tiles.KERNEL_ON_CPU = True
    launches, fused = [], []
    real = tma.grouped_gemm_tma
    tma.grouped_gemm_tma = lambda *a, **k: launches.append(a[1].shape) or real(*a, **k)
    real_fused = matmul.weighted_swiglu_bwd_fp8
    matmul.weighted_swiglu_bwd_fp8 = lambda *a: fused.append(1) or real_fused(*a)
    ids, labels = _batch(rank)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
    ref_loss, ref_grads, ref_logits = _loss_and_grads(_fp8_model(None, False, targets), ids, labels)
    _, made_each_backward, _ = _loss_and_grads(_fp8_model(mesh, False, targets), ids, labels)
    launches.clear()
    model = _fp8_model(mesh, True, targets)
    loss, grads, logits = _loss_and_grads(model, ids, labels)
    for name, g in made_each_backward.items():  # the same work on the same rows: the copies change nothing
        assert torch.equal(grads[name], g), name
    for w in ("gate_up_proj", "down_proj"):  # and they are what the input gradients read: flipped, the grads change
        for moe in model.moe_layers():
            copy = transposed_copy(moe.experts, w)
            copy.copy_(copy.flip(1))
        _, flipped, _ = _loss_and_grads(model, ids, labels)
        assert any(not torch.equal(flipped[n], grads[n]) for n in grads), w
        for moe in model.moe_layers():
            copy = transposed_copy(moe.experts, w)
            copy.copy_(copy.flip(1))
    E_local = TINY["n_routed_experts"] // WORLD
    copy_shapes = {(E_local, TINY["hidden_size"], 2 * TINY["moe_intermediate_size"]),
                   (E_local, TINY["moe_intermediate_size"], TINY["hidden_size"])}
    assert copy_shapes <= set(launches), launches  # the input gradients ran on this rank's kept copies
    assert bool(fused) == ("experts" not in targets)  # the experts as one fp8 node where they carry no LoRA
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(logits, ref_logits)
    for name in ref_grads:  # bf16 sums in another order (the exchange's rows, the sum over ranks)
        mine, ref = grads[name].float(), ref_grads[name].float()
        dist.all_reduce(ref)
        if ".experts." not in name:
            dist.all_reduce(mine)
        assert torch.isfinite(mine).all() and ((mine - ref).norm() / ref.norm()).item() < 2e-2, name
    assert grads.keys() == ref_grads.keys()
    shutdown_distributed(finished=True)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj", "shared_experts", "experts"], ["q_proj", "v_proj"]])
def test_ep_on_an_fp8_base_with_kept_copies_equals_the_plain_model(targets):
    """Expert parallelism over an fp8 base on the fp8 tensor-core path, each rank keeping the transposed copies of its
    own experts (handed through the exchange to the local expert work): the gradients of the same EP model making a
    copy per backward, bitwise, and the loss, logits and LoRA gradients of the plain single-process fp8 model within
    bf16's rounding (its sums run in another order). With LoRA on the routed experts they run GEMM by GEMM; without,
    as one fp8 node (quant.matmul.fp8_expert_mlp), on each rank's received rows."""
    mp.spawn(_fp8_worker, args=(free_port(), targets), nprocs=WORLD)


def _gather_worker(rank, port):
    from torch.distributed.device_mesh import init_device_mesh

    from moetune.model import experts
    from moetune.model import grouped_gemm_tiles as tiles
    from moetune.model import grouped_gemm_tma as tma
    from moetune.parallel.apply import apply_ac, apply_ep
    from moetune.parallel.mesh import shutdown_distributed

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    # frozen bf16 stacks through the TMA kernel, as a GPU runs them (Triton's interpreter here, its K tiles)
    tiles.KERNEL_ON_CPU = True
    tma.TMA_CONFIG = dict(tma.TMA_CONFIG, BK=tiles._INTERPRETER_CONFIG["BK"])
    gathered = []
    real = tma.grouped_gemm_tma
    tma.grouped_gemm_tma = lambda *a, **k: gathered.append(k.get("a_rows") is not None) or real(*a, **k)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
    ids, labels = _batch(rank)

    def run(on, lora, chunks, ac):
        experts.GATHER_IN_GEMM = on
        gathered.clear()
        model = _model(lora, rank=16).to(torch.bfloat16)
        apply_ep(model, mesh, overlap_chunks=chunks)
        apply_ac(model, ac)
        loss, grads, logits = _loss_and_grads(model, ids, labels)
        return (loss, logits, *grads.values()), gathered.count(True)

    for lora, chunks, ac in [("attention", 1, "none"), ("attention", 2, "full"), (False, 1, "none"),
                             (False, 2, "none"), (False, 2, "full")]:
        want, none = run(False, lora, chunks, ac)
        got, some = run(True, lora, chunks, ac)
        assert none == 0 and some >= 4, (lora, chunks, ac, some)  # 2 MoE layers, 2 products each
        assert all(torch.isfinite(a).all() and torch.equal(a, b) for a, b in zip(got, want)), (lora, chunks, ac)
    shutdown_distributed(finished=True)


def test_ep_with_the_permutation_gathers_inside_the_gemms_equals_the_gathers_written_out():
    """experts.GATHER_IN_GEMM under expert parallelism (2 gloo processes): the rows a rank received are expanded to
    their (row, expert) pairs inside the frozen bf16 stacks' GEMMs, and down's input gradient reads the rows'
    gradient there too; with LoRA on the experts (its weight gradients kept by Rebuilt without recompute) its thin
    products and A's gradient as well. Loss, evaluation logits and LoRA gradients equal those of the expansion written
    out, bit for bit, with the plain and the pipelined exchange and with the layer recomputed."""
    mp.spawn(_gather_worker, args=(free_port(),), nprocs=WORLD)
