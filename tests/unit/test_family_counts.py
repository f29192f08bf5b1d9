"""Parameter counts of GLM-4.7-Flash (MLA) and GLM-5 (MLA + DSA): the closed-form active count (MFU's numerator)
equals what our built model holds, the builtins match the model cards, and the recipes inspect."""

from pathlib import Path

import pytest

from moetune.cli import main
from moetune.model.config import resolve_model_config
from moetune.model.hf_io import build_model
from moetune.train.metrics import active_matmul_params

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MLA = dict(model_type="glm4_moe_lite", vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
           kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=20)
DSA = dict(MLA, model_type="glm_moe_dsa", num_hidden_layers=4, index_topk=8, index_head_dim=16, index_n_heads=4,
           first_k_dense_replace=1, indexer_types=["full", "shared", "full", "shared"])


def built_active_params(m) -> int:
    """What a token multiplies by in the built model (meta device): every weight but the embedding, norms and
    biases, the routed experts scaled by top-k / E."""
    model = build_model(m, "meta")
    total = 0
    for name, p in model.named_parameters():
        if name == "model.embed_tokens.weight" or "norm." in name or name.endswith(".bias"):
            continue
        if ".mlp.experts." in name:
            assert p.numel() % m.n_routed_experts == 0
            total += p.numel() // m.n_routed_experts * m.num_experts_per_tok
        else:
            total += p.numel()
    return total


@pytest.mark.parametrize("config", [
    MLA,
    dict(MLA, q_lora_rank=None),  # one q_proj
    dict(MLA, attention_bias=True, n_shared_experts=2),
    DSA,  # layers 1 and 3 have no indexer
    dict(DSA, indexer_types=None, first_k_dense_replace=2),
    "glm47-flash", "glm5", "glm45-air",
], ids=["mla", "mla-no-q-lora", "mla-bias", "dsa-shared", "dsa-all-full", "glm47-flash", "glm5", "glm45-air"])
def test_active_count_is_the_built_models(config):
    m = resolve_model_config(None, config)
    assert active_matmul_params(m) == built_active_params(m)


def test_a_dsa_layer_without_its_own_indexer_counts_less():
    own, shared = (resolve_model_config(None, dict(DSA, indexer_types=t)) for t in
                   (["full"] * 4, ["full", "shared", "full", "shared"]))
    indexer = 24 * 4 * 16 + 64 * 16 + 64 * 4  # wq_b, wk, weights_proj of one layer
    assert active_matmul_params(own) - active_matmul_params(shared) == 2 * indexer


def _total(name):
    return sum(p.numel() for p in build_model(resolve_model_config(None, name), "meta").parameters())


# The cards: GLM-4.7-Flash "30B-A3B" (hub card); GLM-5 "744B parameters (40B active)" (hub card and its technical
# report, whose table lists the MTP layer apart). Both totals are without the MTP layer, as ours (with it GLM-5
# would be ~754B), and both active figures are whole billions rounded down, as GLM-4.5's "355B/32B" and Air's
# "106B/12B" are of our 352.8/32.9 and 106.9/12.8; the active count includes lm_head, not the embedding lookup.
@pytest.mark.parametrize("name, total_b, active_b", [("glm47-flash", 30, 3), ("glm5", 744, 40)])
def test_builtin_counts_match_the_model_cards(name, total_b, active_b):
    total, active = _total(name), active_matmul_params(resolve_model_config(None, name))
    assert abs(total / 1e9 - total_b) < 0.5, total
    assert active_b <= active / 1e9 < active_b + 1, active
    # pinned: a change of the builtin shape or of the counting shows here
    assert (total, active) == {"glm47-flash": (29_943_390_976, 3_579_314_176),
                               "glm5": (743_911_199_232, 40_831_942_656)}[name]


@pytest.mark.parametrize("recipe, world, gpu, want", [
    ("glm47-flash-lora", 1, "139.8", ["GLM-4.7-Flash (glm4_moe_lite, MLA): 47 layers (1 dense + 46 MoE)",
                                       "29,943,390,976", "3,579,314,176", "21,031,936",
                                       "layout (auto): one process, activation checkpointing none"]),
    ("glm5-lora", 32, "139.8", ["GLM-5 (glm_moe_dsa, MLA + DSA): 78 layers (3 dense + 75 MoE)", "743,911,199,232",
                                "40,831,942,656", "106,149,888", "DSA indexer (forward)",
                                "layout (auto): expert parallel (ep 8 × FSDP dp_shard 4), activation checkpointing attention"]),
])
def test_recipes_inspect_with_the_builtin_shapes(recipe, world, gpu, want, capsys):
    assert main(["inspect", str(CONFIGS / f"{recipe}.yaml"), "--world-size", str(world), "--gpu-mem-gib", gpu]) == 0
    out = capsys.readouterr().out
    assert f"showing the builtin '{recipe.removesuffix('-lora')}'" in out  # model.path is a placeholder
    for text in want:
        assert text in out, text
    assert "q_a_proj" in out and "kv_b_proj" in out and "q_proj " not in out  # LoRA on the MLA projections


def test_inspect_says_in_one_line_which_lora_targets_an_mla_model_lacks(capsys):
    assert main(["inspect", str(CONFIGS / "glm47-flash-lora.yaml"), "--lora.targets", "[attention]"]) == 1
    out = capsys.readouterr().out
    assert "error: lora.targets ['q_proj', 'k_proj', 'v_proj'] match no module of this model (glm4_moe_lite" in out


def test_mfu_counts_the_indexer_forward_only():
    """GLM-5's indexer runs without backward: 2 flops per parameter and token, whatever the fine-tuning mode."""
    from moetune.train.metrics import indexer_matmul_params, mfu

    m = resolve_model_config(None, "glm5")
    P = active_matmul_params(m)
    idx = sum(indexer_matmul_params(m, i) for i in range(m.num_hidden_layers))
    assert idx == 78 * (2048 * 32 * 128 + 6144 * 128 + 6144 * 32)
    assert mfu(1000.0, m, False, 1e15) == pytest.approx((4 * (P - idx) + 2 * idx) * 1000 / 1e15, rel=1e-12)
    assert mfu(1000.0, m, True, 1e15) == pytest.approx((6 * (P - idx) + 2 * idx) * 1000 / 1e15, rel=1e-12)
    flash = resolve_model_config(None, "glm47-flash")
    assert mfu(1000.0, flash, False, 1e15) == pytest.approx(4 * active_matmul_params(flash) * 1000 / 1e15, rel=1e-12)
