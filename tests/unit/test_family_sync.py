"""Weight streaming of GLM-4.7-Flash (glm4_moe_lite, MLA) and GLM-5 (glm_moe_dsa, MLA + the DSA indexer) on one
process (sender and receivers as threads, as tests/unit/test_sync.py): bf16 syncs bit-exact to the merged trainer
model (LoRA on every MLA projection, shared and routed experts), fp8 experts equal to the reference quantization in
transformers' own models, the wire's names exactly the checkpoint transformers writes (what vLLM's load_weights
takes: MLA projections, indexer, experts one by one), and the sender's allocations under the plan's bound."""

import pytest
import torch
from safetensors import safe_open

import moetune
from family_models import hf_dsa, hf_lite
from helpers import randomize_lora, save_hf
from moetune.model.config import BUILTIN, ModelConfig
from moetune.model.hf_io import build_model, cast_model, load_model
from moetune.model.lora import apply_lora
from moetune.model.quant.fp8 import scheme_named
from moetune.model.quant.modules import quantize_model
from moetune.sync import receive, receive_into
from moetune.sync.fp8 import FP8, dequantize, error_bound, quantize
from moetune.sync.plan import _expert_staging, build_plan, plan_tensors
from moetune.sync.vllm import load_weights_consumer
from test_sync import NameRecorder, merged_reference, run_sync

MAKE = {"lite": hf_lite, "dsa": hf_dsa}
TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "dense_mlp", "shared_experts",
           "experts"]


def _ours(tmp_path, kind, dtype, lora, seed=1, quantize=None, **over):
    path = save_hf(MAKE[kind](seed=seed, **over), tmp_path / f"{kind}-{seed}")
    model = load_model(path, dtype=dtype, quantize=quantize)
    if lora:
        apply_lora(model, TARGETS, 4, 8.0)
        randomize_lora(model, seed + 1)
    return model


@pytest.mark.parametrize("kind", list(MAKE))
def test_bf16_merged_sync_is_bitwise(tmp_path, kind):
    src = _ours(tmp_path, kind, "bfloat16", lora=True)
    dst = _ours(tmp_path, kind, "bfloat16", lora=False, seed=7)
    stats, (got,) = run_sync(src, [lambda g: receive_into(g, dst)], format="bf16", bucket_bytes=32 << 10,
                             max_experts_per_unit=3)
    assert stats["buckets"] > 8 and got["bytes"] == stats["bytes"]
    want = merged_reference(src)
    assert set(got["updated"]) == set(want)
    assert any(".self_attn.kv_a_proj_with_mqa." in n for n in want)
    if kind == "dsa":
        assert {n.rsplit(".", 2)[-2] for n in want if ".indexer." in n} == {"wq_b", "wk", "k_norm", "weights_proj"}
    state = {**dict(dst.named_parameters()), **dict(dst.named_buffers())}
    for name, w in want.items():
        assert state[name].dtype == w.dtype and torch.equal(state[name], w), name
    assert stats["peak_alloc"] <= stats["bound"]


@pytest.mark.parametrize("kind", list(MAKE))
def test_fp8_sync_into_transformers_model(tmp_path, kind):
    """Full fine-tuning (fp32, no LoRA) into transformers' model: routed experts hold the reference quantization's
    dequantized values, every other tensor (MLA projections and norms, the indexer) its bf16 rounding."""
    shapes = dict(hidden_size=160, moe_intermediate_size=136)  # blocks of 128 and tails
    src = _ours(tmp_path, kind, "float32", lora=False, **shapes)
    dst = MAKE[kind](seed=2, **shapes)
    stats, (got,) = run_sync(src, [lambda g: receive_into(g, dst)], format="fp8")
    assert got["format"] == "fp8" and stats["peak_alloc"] <= stats["bound"]
    mine = {**dict(src.named_parameters()), **dict(src.named_buffers())}
    theirs = {**dict(dst.named_parameters()), **dict(dst.named_buffers())}
    assert set(got["updated"]) == set(mine) == set(dst.state_dict())  # all but transformers' RoPE frequencies
    I = shapes["moe_intermediate_size"]
    for name, w in mine.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            for rows in ([slice(0, I), slice(I, 2 * I)] if name.endswith("gate_up_proj") else [slice(None)]):
                q, s = quantize(w[:, rows])
                assert torch.equal(theirs[name][:, rows].detach(), dequantize(q, s)), name
                assert ((dequantize(q, s) - w[:, rows]).abs() <= error_bound(w[:, rows], s)).all()
        elif name.endswith("e_score_correction_bias"):
            assert torch.equal(theirs[name], w)
        else:
            assert torch.equal(theirs[name].detach(), w.detach().to(torch.bfloat16).float()), name


@pytest.mark.parametrize("kind", list(MAKE))
def test_wire_names_are_the_hf_checkpoints(tmp_path, kind):
    """A load_weights consumer (the vLLM extension) gets the tensors of the checkpoint transformers writes, under
    its names, experts one by one; with fp8, each expert projection's block scale beside it."""
    path = save_hf(MAKE[kind](seed=3), tmp_path / "ckpt")
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        ckpt = {k: f.get_tensor(k) for k in f.keys()}
    assert any(".experts.0.gate_proj.weight" in k for k in ckpt)  # the hub's layout
    src = moetune.load_model(path, dtype="bfloat16")
    bf16, fp8 = NameRecorder(), NameRecorder()
    run_sync(src, [lambda g: receive(g, load_weights_consumer(bf16)), lambda g: receive(g, load_weights_consumer(fp8))],
             format="bf16")
    assert set(bf16.seen) == set(ckpt)
    for k, t in ckpt.items():
        dtype, shape, value = bf16.seen[k]
        assert shape == tuple(t.shape) and torch.equal(value, t.to(dtype)), k
    fp8 = NameRecorder()
    run_sync(src, [lambda g: receive(g, load_weights_consumer(fp8))], format="fp8")
    scales = {k for k in fp8.seen if k.endswith("weight_scale_inv")}
    experts = {k for k in ckpt if ".mlp.experts." in k}
    assert scales == {k.replace(".weight", ".weight_scale_inv") for k in experts}
    assert set(fp8.seen) - scales == set(ckpt)
    assert all(fp8.seen[k][0] == FP8 for k in experts)
    assert all(fp8.seen[k][0] == torch.bfloat16 for k in ckpt if k not in experts and "e_score" not in k)


# (sync format, the trainer's base): fp8_rows from a base stored in fp8 with row scales, fp8 from a bf16 base (routed
# experts in blocks) and from a block-scaled one (all it stores in fp8 requantised per block)
FORMATS_AND_BASES = [("bf16", None), ("fp8", None), ("fp8", "fp8_block"), ("fp8_rows", "fp8")]


@pytest.mark.parametrize("fmt,base", FORMATS_AND_BASES, ids=["bf16", "fp8", "fp8-block_base", "fp8_rows"])
@pytest.mark.parametrize("kind", list(MAKE))
def test_sender_allocations_stay_under_the_bound(tmp_path, kind, fmt, base):
    over = dict(n_routed_experts=64, num_experts_per_tok=4, moe_intermediate_size=64, vocab_size=512)
    src = _ours(tmp_path, kind, "bfloat16", lora=True, quantize=base, **over)
    dst = _ours(tmp_path, kind, "bfloat16", lora=False, seed=9, **over)
    stats, _ = run_sync(src, [lambda g: receive_into(g, dst)], format=fmt)
    assert stats["experts_per_unit"] > 1
    assert stats["peak_alloc"] <= stats["bound"]
    assert stats["peak_alloc"] >= 2 * min(stats["bucket"], stats["largest_group"] // 2)


@pytest.mark.parametrize("fmt,base", FORMATS_AND_BASES, ids=["bf16", "fp8", "fp8-block_base", "fp8_rows"])
@pytest.mark.parametrize("shape", ["glm5", "glm47-flash"])
def test_full_width_plans_fit_their_bound(shape, fmt, base):
    """The plan of a full-width model (built on the meta device: shapes only), LoRA merged: the ring of two buckets
    plus one unit's staging fits 1.25 × the largest group + one expert, and for GLM-5 with fp8 experts that bound
    (a MoE layer: 256 experts × 3 × 2048 × 6144 fp8 bytes + MLA + indexer) is far below the 31 GiB per layer the
    reference system needed after its fix."""
    cfg = ModelConfig.from_hf_dict(dict(BUILTIN[shape], num_hidden_layers=4))
    model = build_model(cfg, "meta")
    cast_model(model, torch.bfloat16)
    if base is not None:  # a trainer on an FP8 release: its frozen weights fp8 with row or 128×128-block scales
        quantize_model(model, scheme_named(base))
    apply_lora(model, TARGETS, 16, 32.0)
    tensors = plan_tensors(model, {**dict(model.named_parameters()), **dict(model.named_buffers())})
    plan = build_plan(model, tensors, fmt, "merge")
    prefix = f"model.layers.{cfg.num_hidden_layers - 1}.mlp.experts"
    I, H = cfg.moe_intermediate_size, cfg.hidden_size
    lora = {"gate_up": (f"{prefix}.lora.gate_up_A", f"{prefix}.lora.gate_up_B")}
    staging = plan.experts_per_unit * _expert_staging(tensors, prefix, I, H, lora)
    assert 2 * plan.bucket + staging <= plan.bound
    assert plan.block_shortfall == 0  # 128 rows of any block-fp8 weight fit the staging budget at these widths
    assert tensors["lm_head.weight"].numel() * 2 <= plan.largest_group / 2
    layer = cfg.n_routed_experts * 3 * I * H * (1 if fmt.startswith("fp8") else 2)
    if shape == "glm5":
        assert layer <= plan.largest_group <= 1.1 * layer  # the largest group is a MoE layer
        if fmt.startswith("fp8"):
            assert plan.bound < 13 * (1 << 30) < 31 * (1 << 30)
