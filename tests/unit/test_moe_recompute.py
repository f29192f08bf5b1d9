"""Activation checkpointing of a local (not expert-parallel) MoE layer in every mode and in per-layer splits: routing is
deterministic, so every mode gives the gradients of no recompute bit for bit; `full` recomputes the layer whole
(routing and sort included, model/recompute.split_modes) and keeps its input only."""

import pytest
import torch

from moetune.model import glm4_moe
from moetune.model.config import ModelConfig
from moetune.parallel.apply import apply_ac

from test_observability_inspect import MLA_ATTN, MLA_TINY, TINY_GQA, _census_model, saved_bytes_by_layer

CASES = {
    "gqa-lora-attention": (TINY_GQA, "lora", ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "gqa-lora-experts": (TINY_GQA, "lora", ["q_proj", "experts", "shared_experts"]),
    "gqa-full": (TINY_GQA, "full", []),
    "mla-lora-attention": (dict(MLA_TINY, model_type="glm4_moe_lite"), "lora", MLA_ATTN),
    "mla-lora-experts": (dict(MLA_TINY, model_type="glm4_moe_lite"), "lora", ["o_proj", "experts"]),
    "mla-full": (dict(MLA_TINY, model_type="glm4_moe_lite"), "full", []),
}
MODES = ["attention", "selective", "full", {"full": 1, "none": 1}, {"attention": 1, "full": 1}]


def _grads(config, mode, targets, ac, dtype, compiled=False, rank=4):
    m = ModelConfig.from_hf_dict(config)
    torch.manual_seed(0)  # LoRA's A
    model, _ = _census_model(m, mode, targets, rank)
    model.to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_B"):  # B = 0 would hide the experts' LoRA gradients of A
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    apply_ac(model, ac)
    if compiled:  # each layer one graph (aot_eager: on the CPU the kernels run under Triton's interpreter)
        torch._dynamo.reset()
        for layer in model.model.layers:
            layer.compile(fullgraph=True, backend="aot_eager", dynamic=False)
    ids = torch.randint(0, m.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    model(ids, None, labels=torch.roll(ids, -1, 1)).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_mode_gives_the_gradients_of_no_recompute_bit_for_bit(case, dtype):
    config, mode, targets = CASES[case]
    want = _grads(config, mode, targets, "none", dtype)
    assert want and all(g is not None and g.abs().sum() > 0 for g in want.values())
    for ac in MODES:
        got = _grads(config, mode, targets, ac, dtype)
        differ = [n for n, g in want.items() if not torch.equal(got[n], g)]
        assert not differ, (ac, differ)


@pytest.mark.parametrize("case", ["gqa-lora-attention", "gqa-lora-experts", "gqa-full", "mla-lora-experts"])
def test_full_recompute_of_a_moe_layer_keeps_its_input_only(case, monkeypatch):
    """`full` and `selective` recompute a local MoE layer as one piece, the sort included (it runs again in backward),
    and `full` keeps the layer's input only: a small fraction of what the layer saves without recompute."""
    config, mode, targets = CASES[case]
    m = ModelConfig.from_hf_dict(config)
    calls = []
    permute = glm4_moe.permute
    monkeypatch.setattr(glm4_moe, "permute", lambda *a: calls.append(1) or permute(*a))
    saved = {}
    ids = torch.randint(0, m.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    for ac in ("none", "full", "selective"):
        model, _ = _census_model(m, mode, targets)
        apply_ac(model, ac)
        calls.clear()
        model(ids, None, labels=ids).backward()
        # one MoE layer: sorted in forward, and again in backward where the layer is recomputed
        assert len(calls) == (1 if ac == "none" else 2), ac
        small, big = saved_bytes_by_layer(model, 64), saved_bytes_by_layer(model, 128)
        saved[ac] = (big[1] - small[1]) / 64
    assert m.is_moe_layer(1) and saved["full"] < saved["none"] / 4, saved


@pytest.mark.parametrize("ac", ["none", "attention", "selective", "full"])
@pytest.mark.parametrize("case", ["gqa-lora-experts", "mla-lora-experts"])
def test_a_compiled_moe_layer_is_one_graph_in_every_mode_and_keeps_its_side_outputs(case, ac):
    """A compiled decoder layer (GQA or MLA, LoRA on the experts) is one graph in every recompute mode: a graph break
    runs the rest of the layer eagerly, unfused. Under a whole-layer recompute (full, selective) the checkpoint is
    inside the compiled layer; the MoE's side outputs (expert counts, auxiliary loss, router entropy) leave it as
    outputs: stored on the module inside it, they were a side effect the checkpoint cannot trace, and Dynamo ran the
    recomputed layer eagerly (2.7x slower on full-size Air). fullgraph=True turns any graph break into an error; the
    side outputs equal those of the same model without recompute, eager."""
    config, mode, targets = CASES[case]
    m = ModelConfig.from_hf_dict(config)
    ids = torch.randint(0, m.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    sides = {}
    for name, layer_ac, compiled in (("eager", "none", False), ("compiled", ac, True)):
        torch.manual_seed(0)
        model, _ = _census_model(m, mode, targets)
        moes = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, glm4_moe.MoE)]
        for moe in moes:
            moe.compute_aux_loss = moe.track_router_entropy = True
        apply_ac(model, layer_ac)
        if compiled:
            torch._dynamo.reset()
            for layer in model.model.layers:
                layer.compile(fullgraph=True, backend="aot_eager", dynamic=False)
        model(ids, None, labels=torch.roll(ids, -1, 1)).backward()
        sides[name] = [(moe.last_counts, moe.last_aux_loss, moe.last_router_entropy) for moe in moes]
        assert all(aux.grad_fn is not None for _, aux, _ in sides[name])  # the aux loss can still be trained on
    assert sides["eager"]
    for (c0, a0, e0), (c1, a1, e1) in zip(sides["eager"], sides["compiled"]):
        assert torch.equal(c0, c1) and c0.sum() == ids.numel() * m.num_experts_per_tok
        torch.testing.assert_close(a1, a0)
        torch.testing.assert_close(e1, e0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's twin of a GPU path")
@pytest.mark.parametrize("case", ["gqa-lora-attention", "gqa-lora-experts"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gathers_inside_the_gemms_give_the_gradients_of_the_gathers_written_out(compiled, case, monkeypatch):
    """experts.GATHER_IN_GEMM through the tiny model (bf16, frozen stacks through the TMA kernel under Triton's
    interpreter; LoRA of rank 16, on the experts too in its epilogue), each layer eager or compiled as one graph,
    without recompute and recomputed whole or selectively: the LoRA gradients of the gathers written out without
    recompute (eager or compiled alike), bit for bit, and the gathered products ran."""
    from moetune.model import experts
    from moetune.model import grouped_gemm_tiles as tiles
    from moetune.model import grouped_gemm_tma as tma

    monkeypatch.setattr(tiles, "KERNEL_ON_CPU", True)
    monkeypatch.setattr(tma, "TMA_CONFIG", dict(tma.TMA_CONFIG, BK=tiles._INTERPRETER_CONFIG["BK"]))
    gathered = []
    real = tma.grouped_gemm_tma
    monkeypatch.setattr(tma, "grouped_gemm_tma",
                        lambda *a, **k: gathered.append(k.get("a_rows") is not None) or real(*a, **k))
    config, mode, targets = CASES[case]
    monkeypatch.setattr(experts, "GATHER_IN_GEMM", False)
    want = _grads(config, mode, targets, "none", torch.bfloat16, compiled, rank=16)
    assert gathered and not any(gathered)
    monkeypatch.setattr(experts, "GATHER_IN_GEMM", True)
    for ac in ["none", "selective", "full"]:
        gathered.clear()
        got = _grads(config, mode, targets, ac, torch.bfloat16, compiled, rank=16)
        assert gathered.count(True) >= 2, ac  # gate_up's forward and down's input gradient, each MoE layer
        differ = [n for n, g in want.items() if not torch.equal(got[n], g)]
        assert not differ, (ac, differ)

