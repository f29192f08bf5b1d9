"""GLM-4.7-Flash (glm4_moe_lite) and GLM-5 (glm_moe_dsa) against transformers, on checkpoints transformers wrote."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import moetune
from moetune.errors import ConfigError
from moetune.model.config import ModelConfig, resolve_model_config
from family_models import TINY_DSA, hf_dsa, hf_lite
from helpers import save_hf

VARIANTS = {
    "lite": (hf_lite, {}),
    "lite_no_q_lora": (hf_lite, dict(q_lora_rank=None)),
    "lite_neox_rope_bias": (hf_lite, dict(rope_interleave=False, attention_bias=True)),
    "dsa": (hf_dsa, {}),  # own top-k in layers 0, 2; reused in 1, 3
    "dsa_all_full_dense2": (hf_dsa, dict(indexer_types=None, first_k_dense_replace=2, index_topk=5)),
}
S = 24  # > TINY_DSA's index_topk: the indexer selects


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def _ids(n=2, seq=S, seed=0):
    return torch.randint(0, 96, (n, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(tmp_path, variant):
    make, over = VARIANTS[variant]
    ref = make(seed=1, **over)
    path = save_hf(ref, tmp_path / "ckpt")
    ours = moetune.load_model(path, dtype="float32")
    assert type(ours).__name__ == type(ref).__name__
    ids = _ids()
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = ours(ids, torch.arange(S).expand(2, S))
    assert got.shape == want.shape
    assert rel_err(got, want) < 1e-4


def test_latent_norms_use_transformers_eps(tmp_path):
    """q_a_layernorm / kv_a_layernorm use eps 1e-6 (transformers' RMSNorm default), not rms_norm_eps: visible
    once the latents are small."""
    ref = hf_lite(seed=8)
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.self_attn.q_a_proj.weight.mul_(0.01)
            layer.self_attn.kv_a_proj_with_mqa.weight.mul_(0.01)
    ours = moetune.load_model(save_hf(ref, tmp_path / "ckpt"), dtype="float32")
    ids = _ids(seed=7)
    with torch.no_grad():
        assert rel_err(ours(ids), ref(input_ids=ids).logits) < 1e-4


def test_dsa_selection_matters_and_shared_layers_reuse_the_previous_top_k(tmp_path):
    """The parity above would hold for a DSA that ignored its indexer, or that let a shared layer reuse the wrong
    layer's top-k, were those the same as the right answer: they are not, by far."""
    ref = hf_dsa(seed=2)
    ours = moetune.load_model(save_hf(ref, tmp_path / "ckpt"), dtype="float32")
    ids = _ids(seed=1)
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        assert rel_err(ours(ids), want) < 1e-4
        layers = ours.model.layers
        assert [layer.self_attn.indexer is not None for layer in layers] == [True, False, True, False]
        ours.config.index_topk = S  # dense: every causal key
        for layer in layers:
            layer.self_attn.index_topk = S
        assert rel_err(ours(ids), want) > 1e-2
        for layer in layers:
            layer.self_attn.index_topk = TINY_DSA["index_topk"]
        ours.config.index_topk = TINY_DSA["index_topk"]
        # layer 3 given layer 0's top-k instead of layer 2's
        first = {}
        orig = [layer.self_attn.select_keys for layer in layers]

        def keep_first(*args, _orig=orig[0]):
            attn, topk = _orig(*args)
            first["topk"] = topk
            return attn, topk

        def use_first(x, q_latent, cos, sin, attn, topk, cache, _orig=orig[3]):
            return _orig(x, q_latent, cos, sin, attn, first["topk"], cache)

        layers[0].self_attn.select_keys, layers[3].self_attn.select_keys = keep_first, use_first
        assert rel_err(ours(ids), want) > 1e-3


def test_dsa_short_sequences_skip_the_indexer_exactly(tmp_path):
    """At most index_topk keys: every key is selected; the dense kernel gives transformers' logits."""
    ref = hf_dsa(seed=3)
    ours = moetune.load_model(save_hf(ref, tmp_path / "ckpt"), dtype="float32")
    ids = _ids(seq=TINY_DSA["index_topk"])
    with torch.no_grad():
        assert rel_err(ours(ids), ref(input_ids=ids).logits) < 1e-4


def _loss_and_grads(model, ids, hf):
    model.zero_grad(set_to_none=True)
    if hf:
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
    else:
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
        loss = model(ids, labels=labels)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("make", [hf_lite, hf_dsa], ids=["lite", "dsa"])
def test_training_gradients_match_transformers(tmp_path, make):
    """Full fine-tuning gradients of every parameter equal transformers'. Through DSA: the indexer gets none
    (transformers runs it under no_grad), the attention's weights get theirs through the selected keys."""
    ref = make(seed=4)
    ours = moetune.load_model(save_hf(ref, tmp_path / "ckpt"), dtype="float32")
    for p in ours.parameters():
        p.requires_grad_(True)
    ids = _ids(seed=2)
    want_loss, want = _loss_and_grads(ref.train(), ids, hf=True)
    got_loss, got = _loss_and_grads(ours.train(), ids, hf=False)
    assert rel_err(got_loss, want_loss) < 1e-5
    assert set(got) == set(want)
    indexer = {n for n in got if ".indexer." in n}
    assert bool(indexer) == (make is hf_dsa)
    for name in indexer:
        assert want[name] is None and got[name] is None, name
    for name in set(got) - indexer:
        assert got[name] is not None and want[name] is not None, name
        assert rel_err(got[name], want[name]) < 1e-4, name
    # and with activation checkpointing: recomputed layers use the top-k their forward used
    for layer in ours.model.layers:
        layer.activation_checkpointing = "full"
    ac_loss, ac = _loss_and_grads(ours, ids, hf=False)
    assert torch.equal(ac_loss, got_loss)
    for name in set(got) - indexer:
        assert torch.allclose(ac[name], got[name], rtol=1e-5, atol=1e-7), name


def test_dsa_packed_documents_attend_and_select_within_their_document(tmp_path):
    """A packed row (positions restart at each document) gives each document the logits it has alone: the
    indexer scores only keys of the query's own document, and RoPE restarts."""
    ref = hf_dsa(seed=5)
    ours = moetune.load_model(save_hf(ref, tmp_path / "ckpt"), dtype="float32")
    a, b = _ids(1, 14, seed=3), _ids(1, 11, seed=4)  # both longer than index_topk
    packed = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(14), torch.arange(11)]).unsqueeze(0)
    with torch.no_grad():
        got = ours(packed, pos)
        alone = torch.cat([ours(a), ours(b)], 1)
        assert rel_err(alone[:, :14], ref(input_ids=a).logits) < 1e-4
    assert rel_err(got, alone) < 1e-5


def test_transformers_fused_layout_and_sharded_hub_files_load(tmp_path):
    ref = hf_dsa(seed=6)
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert any("experts.gate_up_proj" in k for k in sd) and any(".indexer.wq_b." in k for k in sd)
    d = tmp_path / "fused"
    d.mkdir()
    keys = sorted(sd)
    save_file({k: sd[k] for k in keys[::2]}, d / "a.safetensors")
    save_file({k: sd[k] for k in keys[1::2]}, d / "b.safetensors")
    wm = {k: "a.safetensors" if i % 2 == 0 else "b.safetensors" for i, k in enumerate(keys)}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    ref.config.to_json_file(d / "config.json")
    fused = moetune.load_model(str(d))
    hub_path = save_hf(ref, tmp_path / "hub", max_shard_size="20KB")
    with open(f"{hub_path}/model.safetensors.index.json") as f:
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in json.load(f)["weight_map"]
    hub = moetune.load_model(hub_path)
    ids = _ids(seed=5)
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        assert rel_err(fused(ids), want) < 1e-4
        assert torch.equal(hub(ids), fused(ids))


@pytest.mark.parametrize("make", [hf_lite, hf_dsa], ids=["lite", "dsa"])
def test_mtp_layer_is_ignored(tmp_path, make):
    from safetensors.torch import load_file

    ref = make(seed=7)
    path = save_hf(ref, tmp_path / "ckpt")
    n = ref.config.num_hidden_layers
    f = f"{path}/model.safetensors"
    sd = load_file(f)
    for k in [k for k in sd if k.startswith("model.layers.1.")]:  # a whole MoE layer as the MTP layer's body
        sd[k.replace("model.layers.1.", f"model.layers.{n}.")] = sd[k].clone()
    sd[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(4, 8)
    save_file(sd, f)
    ours = moetune.load_model(path)
    assert len(ours.model.layers) == n
    ids = _ids(seed=6)
    with torch.no_grad():
        assert rel_err(ours(ids), ref(input_ids=ids).logits) < 1e-4


# ---------------------------------------------------------------------------------------------- config
def test_config_reads_what_transformers_derives():
    from transformers import GlmMoeDsaConfig

    hf = GlmMoeDsaConfig(num_hidden_layers=7, index_topk_freq=3, first_k_dense_replace=2)
    cfg = ModelConfig.from_hf_dict(json.loads(hf.to_json_string()))
    assert cfg.indexer_types == hf.indexer_types and "shared" in cfg.indexer_types
    assert [cfg.is_moe_layer(i) for i in range(7)] == [t == "sparse" for t in hf.mlp_layer_types]
    assert cfg.head_dim == cfg.rotary_dim == 64 and cfg.q_lora_rank == 2048 and not cfg.attention_bias
    # a hub-style config with only the schedule keys and no mlp_layer_types
    raw = dict(model_type="glm_moe_dsa", num_hidden_layers=6, index_topk_freq=2, first_k_dense_replace=3,
               partial_rotary_factor=0.5, rope_theta=1e6)
    cfg = ModelConfig.from_hf_dict(raw)
    hf = GlmMoeDsaConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    assert cfg.indexer_types == hf.indexer_types and cfg.first_k_dense_replace == 3
    assert cfg.rotary_dim == 64  # GLM-5's RoPE ignores partial_rotary_factor, as transformers'
    lite = ModelConfig.from_hf_dict(dict(model_type="glm4_moe_lite", num_hidden_layers=5))
    assert [lite.is_moe_layer(i) for i in range(5)] == [False] + [True] * 4
    assert lite.routed_scaling_factor == 1.8 and lite.n_routed_experts == 64 and lite.q_lora_rank == 768


def test_config_round_trips_through_transformers():
    from transformers import AutoConfig

    for name in ("glm47-flash", "glm5"):
        cfg = resolve_model_config(None, name, num_hidden_layers=4)
        d = cfg.to_hf_dict()
        assert len(d["mlp_layer_types"]) == len(cfg.mlp_layer_types) == 4
        hf = AutoConfig.for_model(**d)
        assert type(hf).__name__ == {"glm47-flash": "Glm4MoeLiteConfig", "glm5": "GlmMoeDsaConfig"}[name]
        assert hf.qk_rope_head_dim == 64 and hf.rope_parameters["rope_theta"] == 1e6
        assert "use_qk_norm" not in d or d["model_type"] == "glm4_moe"
        back = ModelConfig.from_hf_dict(d)
        assert (back.model_type, back.num_hidden_layers, back.indexer_types, back.rotary_dim) == \
            (cfg.model_type, 4, cfg.indexer_types, cfg.rotary_dim)
    assert "q_lora_rank" not in resolve_model_config(None, "tiny").to_hf_dict()


@pytest.mark.parametrize("raw, match", [
    (dict(model_type="deepseek_v3"), r"model_type 'deepseek_v3' is not supported"),
    (dict(model_type="glm_moe_dsa", q_lora_rank=None), r"glm_moe_dsa needs q_lora_rank"),
    (dict(model_type="glm_moe_dsa", num_hidden_layers=2, indexer_types=["shared", "full"]), r"indexer_types\[0\]"),
    (dict(model_type="glm4_moe_lite", partial_rotary_factor=0.5), r"RoPE must rotate all qk_rope_head_dim"),
    (dict(model_type="glm4_moe_lite", first_k_dense_replace=2), r"first_k_dense_replace 2 without mlp_layer_types"),
    (dict(model_type="glm4_moe_lite", num_hidden_layers=3, mlp_layer_types=["dense", "moe", "sparse"]),
     r"mlp_layer_types holds \['moe'\]"),
])
def test_config_errors_name_the_key(raw, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_dict(raw)
