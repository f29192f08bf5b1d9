"""Expert parallelism on 2 and 4 gloo processes (CPU): the same numbers as EP=1.

- dispatch/combine alone: outputs and gradients (tokens, routing weights, base and LoRA experts) equal the
  non-EP path, with skewed routing, including a rank that receives no rows at all;
- whole runs: parallel.ep 2 on 2 processes (micro-batch 1 each) equals 1 process (micro-batch 2): per-step
  losses, eval losses and the trained adapter (LoRA on attention + experts) or weights (full fine-tuning).
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from helpers import eval_losses, free_port, read_metrics, run_inprocess, run_torchrun, small_run_args, step_losses

E, H, I, K, WORLD = 8, 16, 8, 2, 2


def _experts(seed=0):
    from moetune.model.config import ModelConfig
    from moetune.model.glm4_moe import Experts
    from moetune.model.lora import ExpertLoRA

    cfg = ModelConfig(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K)
    g = torch.Generator().manual_seed(seed)
    ex = Experts(cfg)
    ex.lora = ExpertLoRA(E, H, I, rank=4, alpha=8.0, dropout=0.0, rslora=False)
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)  # B != 0, so the LoRA path matters
    return ex


def _inputs(rank, experts_allowed):
    """Rank `rank`'s tokens (a different count per rank), routed to distinct experts among `experts_allowed`."""
    g = torch.Generator().manual_seed(100 + rank)
    T = 11 + 4 * rank
    x = torch.randn(T, H, generator=g)
    allowed = torch.tensor(experts_allowed)
    idx = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:K]] for _ in range(T)])
    if len(experts_allowed) == E:
        idx[0] = torch.tensor([0, 1])  # two experts of one rank (for up to 4 ranks): a token sends one row, not two
    w = torch.rand(T, K, generator=g)
    return x, idx, w, torch.randn(T, H, generator=g)


def _ep_mesh(rank, port, world):
    """This process's gloo group of `world` and the 1-D "ep" mesh over it."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))


def _dispatch_combine_worker(rank, port, world):
    from moetune.parallel.mesh import shutdown_distributed

    _dispatch_combine_checks(rank, _ep_mesh(rank, port, world), world)
    # the EP modules are gone with the checks' frame: destroyed with them alive, gloo can abort at exit
    shutdown_distributed(finished=True)


def _dispatch_combine_checks(rank, mesh, world):
    from moetune.parallel.apply import shard_experts

    # skewed: rank 0 routes anywhere, the others only to rank 0's experts; then everything to rank 0 (the others
    # receive no rows: their grouped GEMMs run on zero rows, they still join every collective)
    first = list(range(E // world))
    cases = [(routes, chunks) for routes in ([list(range(E))] + [first] * (world - 1), [first] * world)
             for chunks in (1, 2, 3)]  # 1: no overlap; 2, 3: pipelined exchange (a chunk may hold no token)
    for routes, chunks in cases:
        ref, ep = _experts(), _experts()
        shard_experts(ep, mesh, overlap_chunks=chunks)
        inputs = [_inputs(r, routes[r]) for r in range(world)]
        # reference: every rank's tokens through the whole experts, one loss summed over ranks
        ref_x = [(x.clone().requires_grad_(), idx, w.clone().requires_grad_(), g) for x, idx, w, g in inputs]
        ref_y = [ref(x, idx, w)[0] for x, idx, w, _ in ref_x]
        sum((y * g).sum() for y, (*_, g) in zip(ref_y, ref_x)).backward()
        # expert parallel: this rank's tokens only
        x, idx, w, g = inputs[rank]
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        rows_sent = []  # hidden-width rows each all-to-all takes from this rank
        send = dist.all_to_all_single

        def spy(out, inp, *a, **kw):
            if inp.dim() == 2 and inp.shape[1] == H:
                rows_sent.append(inp.shape[0])
            return send(out, inp, *a, **kw)

        dist.all_to_all_single = spy
        try:
            y, counts, _ = ep(x, idx, w)
            (y * g).sum().backward()
        finally:
            dist.all_to_all_single = send
        # each token travels once to each rank holding any of its experts (not once per expert), forward and back
        per_rank = E // world
        distinct = sum(len({e // per_rank for e in row}) for row in idx.tolist())
        # order of the hidden-width exchanges: dispatch, results back (forward); output grads, row grads (backward)
        assert len(rows_sent) == 4 * chunks
        assert sum(rows_sent[:chunks]) == sum(rows_sent[2 * chunks:3 * chunks]) == distinct, (rows_sent, distinct)
        if routes[rank] == list(range(E)):
            assert distinct < idx.numel()  # some tokens have both experts on one rank: fewer rows than pairs

        torch.testing.assert_close(y, ref_y[rank])
        torch.testing.assert_close(counts, torch.bincount(idx.reshape(-1), minlength=E))
        torch.testing.assert_close(x.grad, ref_x[rank][0].grad)
        torch.testing.assert_close(w.grad, ref_x[rank][2].grad)
        mine = slice(rank * E // world, (rank + 1) * E // world)
        ref_params = dict(ref.named_parameters())
        for name, p in ep.named_parameters():
            assert p.placements[0].is_shard(0), name
            torch.testing.assert_close(p.grad.to_local(), ref_params[name].grad[mine], msg=name)


@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_combine_equals_non_ep(world):
    mp.spawn(_dispatch_combine_worker, args=(free_port(), world), nprocs=world)


def _compiled_worker(rank, port):
    from moetune.parallel.mesh import shutdown_distributed

    _compiled_checks(rank, _ep_mesh(rank, port, WORLD))
    shutdown_distributed(finished=True)


def _compiled_checks(rank, mesh):
    from torch._dynamo.testing import CompileCounterWithBackend

    import moetune.model.expert_parallel as ep_module
    from moetune.parallel.apply import shard_experts

    torch._dynamo.reset()
    shared = torch.nn.Linear(H, H).to(torch.bfloat16)
    # frozen experts (their local work compiled whole), expert LoRA recomputed in full (compiled inside the
    # checkpoint); bf16, as on a GPU (torch's grouped GEMM traces in bf16 only)
    for lora, recompute in ((False, "none"), (True, "full")):
        results = []
        for compiled in (False, True):
            counter = CompileCounterWithBackend("aot_eager")  # traced as Inductor would, without its code generation
            ep_module.BACKEND = counter
            try:
                ex = _experts()
                with torch.no_grad():
                    for name in ("gate_up_proj", "down_proj"):
                        getattr(ex, name).data = getattr(ex, name).data.to(torch.bfloat16)
                        getattr(ex, name).requires_grad_(False)
                if not lora:
                    ex.lora = None
                shard_experts(ex, mesh, overlap_chunks=2, compiled=compiled)
                x, idx, w, g = _inputs(rank, list(range(E)))
                x, w = x.to(torch.bfloat16).requires_grad_(), w.requires_grad_()
                y, counts, side = ex(x, idx, w, side_work=lambda: shared(x), recompute=recompute)
                ((y + side).float() * g).sum().backward()
            finally:
                ep_module.BACKEND = "inductor"
            grads = {n: p.grad.to_local() for n, p in ex.named_parameters() if p.grad is not None}
            results.append((y, side, counts, x.grad, w.grad, grads, counter.frame_count))
        (y0, s0, c0, xg0, wg0, g0, frames0), (y1, s1, c1, xg1, wg1, g1, frames1) = results
        # eager compiles nothing; compiled: the send plan, the receive plan, the local experts, the shared expert
        assert frames0 == 0 and frames1 >= 4, (frames0, frames1)
        what = f"lora={lora} recompute={recompute}"
        torch.testing.assert_close(y1, y0, msg=what)
        torch.testing.assert_close(s1, s0, msg=what)
        torch.testing.assert_close(c1, c0, msg=what)
        torch.testing.assert_close(xg1, xg0, msg=what)
        torch.testing.assert_close(wg1, wg0, msg=what)
        assert g1.keys() == g0.keys() and (len(g0) == 4 if lora else not g0), what
        for name in g0:
            torch.testing.assert_close(g1[name], g0[name], msg=f"{what}: {name}")

    from moetune.model.config import BUILTIN, ModelConfig
    from moetune.model.hf_io import build_model
    from moetune.parallel.apply import parallelize
    from moetune.parallel.layout import make_layout

    for compile in (False, True):
        model = build_model(ModelConfig.from_hf_dict(dict(BUILTIN["tiny"], num_hidden_layers=2)), "meta")
        parallelize(model, make_layout(WORLD, ep=WORLD, n_layers=2), {"ep": mesh}, compile=compile,
                    param_dtype=torch.bfloat16)
        moes = list(model.moe_layers())
        assert moes and all(moe.experts.dispatcher.compiled == compile for moe in moes), compile


def test_the_exchange_compiled_equals_eager():
    """What runs between the exchange's collectives, compiled on its own (the dispatcher's `compiled`: the plans, the
    local expert work, the shared expert), computes what the eager exchange computes, forward and backward; and it is
    compiled exactly where the layers are (parallelize's `compile`)."""
    mp.spawn(_compiled_worker, args=(free_port(),), nprocs=WORLD)


def _buffers_worker(rank, port):
    from moetune.parallel.mesh import shutdown_distributed

    _buffers_checks(rank, port)
    shutdown_distributed(finished=True)  # after the EP module's frame is gone


def _buffers_checks(rank, port):
    import gc
    import weakref

    import moetune.model.expert_parallel as ep_module
    import moetune.model.experts as moe_module
    from moetune.parallel.apply import shard_experts

    mesh = _ep_mesh(rank, port, WORLD)
    ex = _experts()
    shard_experts(ex, mesh)
    # weak references to what each step allocated: the exchange's output, the routing it received, and the expert
    # activations saved for backward (gate_up's output h and the SwiGLU output) or the recipes that rebuild them
    kept = []
    exchange, plan, swiglu = ep_module._ExchangeAndCompute.apply, ep_module._plan_received, moe_module.weighted_swiglu
    rebuilt = ep_module.Rebuilt

    def exchange_spy(*a):
        out = exchange(*a)
        kept.append(weakref.ref(out))
        return out

    def plan_spy(routing, *a):
        kept.append(weakref.ref(routing))
        return plan(routing, *a)

    def swiglu_spy(h, w):
        a = swiglu(h, w)
        kept.extend([weakref.ref(h), weakref.ref(a)])
        return a

    class RebuiltSpy(rebuilt):
        def __init__(self):
            super().__init__()
            kept.append(weakref.ref(self))

    ep_module._ExchangeAndCompute.apply, ep_module._plan_received = exchange_spy, plan_spy
    moe_module.weighted_swiglu, ep_module.Rebuilt = swiglu_spy, RebuiltSpy

    def step(recompute):
        x, idx, w, g = _inputs(rank, list(range(E)))
        x, w = x.requires_grad_(), w.requires_grad_()
        y, _, _ = ex(x, idx, w, recompute=recompute)
        (y * g).sum().backward()

    # Python's collector stays off: a reference cycle would keep a step's tensors until it happens to run, which on
    # a GPU is out of memory at full size (the saved-tensor hooks' recipes did, through a bound method)
    gc.collect()
    gc.disable()
    try:
        for recompute in ("none", "full"):
            for _ in range(3):
                step(recompute)
        # per step: output, routing, h, a, and without recompute the hooks holding the recipes (full: h and a again)
        assert len(kept) == 3 * 5 + 3 * 6
        assert [r() for r in kept if r() is not None] == []  # nothing of a finished step stays allocated
    finally:
        gc.enable()
        ep_module._ExchangeAndCompute.apply, ep_module._plan_received = exchange, plan
        moe_module.weighted_swiglu, ep_module.Rebuilt = swiglu, rebuilt


def test_a_finished_step_leaves_no_exchange_buffer_allocated():
    """The exchange's buffers and the experts' saved activations are freed when backward ends, step after step,
    without Python's collector. They used to stay: the autograd node kept the all-to-all's work object, which
    holds a view of the node's own output — a cycle through C++ that Python's collector cannot break — so a
    full-size run grew by one [2T, H] buffer per layer and step until out of memory."""
    mp.spawn(_buffers_worker, args=(free_port(),), nprocs=WORLD)


# ------------------------------------------------------------------------------------------- whole runs
def _assert_same_run(one, ep):
    la, lb = step_losses(one), step_losses(ep)
    assert len(la) == len(lb) == 5
    assert la == pytest.approx(lb, rel=1e-4, abs=1e-5)
    assert la[-1] < la[0]  # it trained
    # Adam hides a constant factor on a gradient from the losses; the norm does not (experts' divide factor)
    norms = [[r["grad_norm"] for r in read_metrics(run) if "grad_norm" in r] for run in (one, ep)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-4, abs=1e-6)
    assert eval_losses(one) == pytest.approx(eval_losses(ep), rel=1e-4, abs=1e-5)


def _assert_close_tensors(a, b, atol=1e-5, rtol=1e-3):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def _runs(tmp_path, **over):
    over = {"eval.every": 2, **over}  # evaluation runs the all-to-all under no_grad
    one = run_inprocess(small_run_args(tmp_path, "one", **over, **{"train.micro_batch_size": 2}))
    run_torchrun(small_run_args(tmp_path, "ep", **over, **{"parallel.ep": 2, "train.micro_batch_size": 1}))
    return one, tmp_path / "runs" / "ep"


def test_lora_attention_and_experts_ep2_equals_one_process(tmp_path):
    one, ep = _runs(tmp_path)  # small_run_args targets attention, shared experts and routed experts
    _assert_same_run(one, ep)
    adapter = lambda run: load_file(os.path.join(run, "adapter", "adapter_model.safetensors"))  # noqa: E731
    a, b = adapter(one), adapter(ep)
    assert any(".experts." in k for k in a)
    _assert_close_tensors(a, b)


def test_per_layer_recompute_ep2_equals_one_process_and_no_recompute(tmp_path):
    """{full: 2, attention: 1} on 3 layers (0 dense): MoE layer 1 recomputes its attention and its local expert
    work apart from the exchange, layer 2 only its attention while its trainable experts save their pair rows and
    SwiGLU output as recipes (recompute.Rebuilt). Losses, eval losses and gradient norms equal 1 process, and the
    adapter equals EP without recompute: recompute changes no number. (Its adapter against 1 process's is left to
    the 2-layer test: over 3 layers the two summation orders leave a few near-zero gradients that Adam's
    normalisation turns into visible differences, 8.8e-4 on 2 of 16,384 elements, with or without recompute.)"""
    split = {"model.num_hidden_layers": 3, "train.activation_checkpointing": "{full: 2, attention: 1}"}
    one, ep = _runs(tmp_path, **split)
    _assert_same_run(one, ep)
    run_torchrun(small_run_args(tmp_path, "ep_none", **{"eval.every": 2, "model.num_hidden_layers": 3,
                                                        "parallel.ep": 2, "train.micro_batch_size": 1}))
    adapter = lambda run: load_file(os.path.join(run, "adapter", "adapter_model.safetensors"))  # noqa: E731
    _assert_close_tensors(adapter(ep), adapter(tmp_path / "runs" / "ep_none"), atol=0, rtol=0)


def test_full_finetune_ep2_equals_one_process(tmp_path):
    from moetune.run_dir import load_model_state

    # router trained too (its gradient comes back through the all-to-all), and activation checkpointing
    # (the backward recomputes each layer, all-to-alls included)
    one, ep = _runs(tmp_path, **{"finetune.mode": "full", "finetune.train_router": True, "optim.lr": 1e-3,
                                 "train.activation_checkpointing": "full"})
    _assert_same_run(one, ep)
    a, b = (load_model_state(run / "checkpoints" / "step_000005") for run in (one, ep))
    assert "model.layers.1.mlp.experts.gate_up_proj" in a
    _assert_close_tensors(a, b)


@pytest.mark.parametrize("ep, dp_shard", [(4, 1), (2, 2)])
def test_four_processes_equal_one_process(tmp_path, ep, dp_shard):
    """4 gloo processes, micro-batch 1 each, equal 1 process with micro-batch 4: ep 4 with the rest replicated (2 of
    the 8 experts per rank), and ep 2 × dp_shard 2 (the experts split by EP and FSDP-sharded over dp_shard, the rest
    FSDP-sharded over all 4) — losses, eval losses, gradient norms and the trained adapter."""
    over = {"eval.every": 2}
    one = run_inprocess(small_run_args(tmp_path, "one", **over, **{"train.micro_batch_size": 4}))
    run_torchrun(small_run_args(tmp_path, "four", **over, **{"parallel.ep": ep, "parallel.dp_shard": dp_shard,
                                                            "train.micro_batch_size": 1}), nproc=4)
    four = tmp_path / "runs" / "four"
    _assert_same_run(one, four)
    adapter = lambda run: load_file(os.path.join(run, "adapter", "adapter_model.safetensors"))  # noqa: E731
    # 4 partial gradient sums are added in another order than 1 process's one sum; AdamW's m/√v turns that rounding
    # into ~1e-5 on weights whose gradient is itself rounding-sized (a missed or doubled reduction moves every
    # weight by ~lr = 1e-2)
    _assert_close_tensors(adapter(one), adapter(four), atol=1e-4)


def test_ep_under_the_trainers_cuda_graph_handling_trains_as_without(tmp_path, monkeypatch):
    """train.cuda_graphs under expert parallelism (allowed without FSDP): the trainer keeps each LoRA gradient in a
    buffer made before the first backward and zeroed in place, which the exchange's backward (the expert LoRA's
    gradients) and the replicated gradients' all-reduce accumulate into. 2 gloo processes, 2 micro-batches a step:
    losses, gradient norms and the adapter bit for bit those of the same run without. (The graphs need a GPU: a
    start-up hook lets the option pass its check on the CPU, uncompiled; benchmarks measure the graphs, the
    `_dispatch_cg` rows.)"""
    over = {"parallel.ep": 2, "train.micro_batch_size": 1, "train.grad_accum": 2, "parallel.layout": "manual"}
    run_torchrun(small_run_args(tmp_path, "plain", **over))
    hook = os.path.join(os.path.dirname(__file__), "graphs_hook")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([hook, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("MOETUNE_TEST_GRAPHS_ON_CPU", "1")
    run_torchrun(small_run_args(tmp_path, "graphs", **over, **{"train.cuda_graphs": True}))
    plain, graphs = tmp_path / "runs" / "plain", tmp_path / "runs" / "graphs"
    assert step_losses(graphs) == step_losses(plain) and step_losses(plain)[-1] < step_losses(plain)[0]
    norms = [[r["grad_norm"] for r in read_metrics(run) if "grad_norm" in r] for run in (plain, graphs)]
    assert norms[0] == norms[1] and all(n > 0 for n in norms[0])
    adapter = lambda run: load_file(os.path.join(run, "adapter", "adapter_model.safetensors"))  # noqa: E731
    a, b = adapter(plain), adapter(graphs)
    assert any(".experts." in k for k in a)
    _assert_close_tensors(a, b, atol=0, rtol=0)
