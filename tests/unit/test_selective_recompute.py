"""Selective activation checkpointing recomputes LoRA's B products (model/recompute.selective_checkpoint_context): the
gradients stay those of no recompute bit for bit, with LoRA dropout too, whose recompute must draw the forward's mask
again (the checkpoint restores the RNG state). What it keeps is the census's (test_observability_inspect.py)."""

import functools

import pytest
import torch

from moetune.model import recompute
from moetune.model.config import ModelConfig
from moetune.model.hf_io import build_model, cast_model, init_weights
from moetune.model.lora import apply_lora
from moetune.parallel.apply import apply_ac

from test_observability_inspect import MLA_ATTN, MLA_TINY, TINY_GQA

MLA_LITE = dict(MLA_TINY, model_type="glm4_moe_lite")
CASES = {
    "gqa-attention": (TINY_GQA, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mla-attention": (MLA_LITE, MLA_ATTN),
    "dense-and-shared-experts": (TINY_GQA, ["dense_mlp", "shared_experts"]),
    "routed-experts": (TINY_GQA, ["experts"]),
    "mla-experts": (MLA_LITE, ["o_proj", "shared_experts", "experts"]),
}


def _grads(config, targets, ac, dtype, dropout):
    m = ModelConfig.from_hf_dict(config)
    model = build_model(m, "cpu")
    cast_model(model, dtype)
    init_weights(model, 0.1, seed=0)
    torch.manual_seed(0)  # LoRA's A
    apply_lora(model, targets, 4, 8, dropout=dropout)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_B"):  # B = 0 would make every A's gradient zero
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    apply_ac(model, ac)
    ids = torch.randint(0, m.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)  # the dropout masks
    model(ids, None, labels=torch.roll(ids, -1, 1)).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


# 64: the policy's bound, under which the tiny models' base GEMMs (K 16 to 96) are recomputed too; 8: the bound scaled
# to them as the census scales it (rank 4 under it, every base GEMM over it), as a real model runs
@pytest.mark.parametrize("bound", [64, 8])
@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_selective_gives_the_gradients_of_no_recompute_bit_for_bit(case, dtype, dropout, bound, monkeypatch):
    monkeypatch.setattr(recompute, "SELECTIVE_RECOMPUTE_MAX_K", bound)
    config, targets = CASES[case]
    want = _grads(config, targets, "none", dtype, dropout)
    assert want and all(g is not None and g.abs().sum() > 0 for g in want.values())
    got = _grads(config, targets, "selective", dtype, dropout)
    differ = [n for n, g in want.items() if not torch.equal(got[n], g)]
    assert not differ, differ


@pytest.mark.parametrize("case", ["gqa-attention", "routed-experts"])
def test_dropout_gradients_need_the_restored_rng_state(case, monkeypatch):
    """The test above can see a mask drawn again differently: dropout changes the gradients, and a checkpoint that does
    not restore the RNG state before its recompute gives other gradients than no recompute."""
    config, targets = CASES[case]
    want = _grads(config, targets, "none", torch.float32, 0.2)
    plain = _grads(config, targets, "none", torch.float32, 0.0)
    assert any(not torch.equal(want[n], g) for n, g in plain.items())
    monkeypatch.setattr(recompute, "checkpoint", functools.partial(recompute.checkpoint, preserve_rng_state=False))
    got = _grads(config, targets, "selective", torch.float32, 0.2)
    assert any(not torch.equal(got[n], g) for n, g in want.items())


@pytest.mark.parametrize("form", ["addmm", "op"])
@pytest.mark.parametrize("rank, b_kept", [(64, False), (65, True)])
def test_the_bound_is_the_reduction_dimension_of_each_product(rank, b_kept, form, monkeypatch):
    """A LoRA linear (bias: addmm) at the production bound: x·Wᵀ + b and x·Aᵀ reduce over the input's width and are
    kept, the base output + (x·Aᵀ)·Bᵀ (an addmm: lora.ADD_IN_GEMM) reduces over the rank and is kept only above 64."""
    from torch.utils.checkpoint import CheckpointPolicy

    from moetune.model import lora
    from moetune.model.lora import LoRALinear

    kept = []
    contexts = recompute.create_selective_checkpoint_contexts

    def recording(policy_fn):
        def policy(ctx, op, *args, **kwargs):
            decision = policy_fn(ctx, op, *args, **kwargs)
            if decision == CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
                out = ctx.op_output
                shapes = tuple(t.shape for t in out) if isinstance(out, (tuple, list)) else tuple(out.shape)
                kept.append((op.__name__, shapes))
            return decision
        return contexts(policy)

    monkeypatch.setattr(recompute, "create_selective_checkpoint_contexts", recording)
    monkeypatch.setattr(lora, "LORA_LINEAR", form)
    linear = LoRALinear(torch.nn.Linear(128, 256), rank, 2 * rank, 0.0, False)
    torch.nn.init.normal_(linear.lora_B)
    x = torch.randn(32, 128, requires_grad=True)
    recompute.recompute(linear, "selective", x).square().sum().backward()
    want = [("addmm.default", (32, 256)), ("mm.default", (32, rank))]
    want += [("addmm.default", (32, 256))] if b_kept else []
    if form == "op":
        want = [("lora_linear.default", ((32, 256), (32, rank)))]
    assert kept == want
