"""Our GLM-4.5 MoE against transformers' Glm4MoeForCausalLM on checkpoints transformers itself wrote."""

import json
import os
import re

import pytest
import torch
from safetensors.torch import save_file

import moetune
from moetune.model.hf_io import CheckpointError
from helpers import hf_model, rewrite_checkpoint, save_hf

VARIANTS = {
    "base": {},
    "group_limited": dict(n_group=4, topk_group=2, num_experts_per_tok=3),
    "qk_norm": dict(use_qk_norm=True),
    "dense3_scaled": dict(first_k_dense_replace=3, num_hidden_layers=4, routed_scaling_factor=2.5),
    "no_bias_full_rotary": dict(attention_bias=False, partial_rotary_factor=1.0),
    "no_norm_topk": dict(norm_topk_prob=False, n_shared_experts=2),
}


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(tmp_path, variant):
    ref = hf_model(seed=1, **VARIANTS[variant])
    path = save_hf(ref, tmp_path / "ckpt")
    ours = moetune.load_model(path, dtype="float32")
    ids = torch.randint(0, ref.config.vocab_size, (2, 24))
    pos = torch.arange(24).expand(2, 24)
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = ours(ids, pos)
        got_default_pos = ours(ids)
    assert got.shape == want.shape
    assert rel_err(got, want) < 1e-4
    assert torch.equal(got, got_default_pos)


def test_bf16_as_accurate_as_transformers_bf16(tmp_path):
    """bf16 routing flips make bitwise bf16 parity meaningless; both stacks' bf16 error against the fp32
    truth must be of the same size instead (ours, averaged over seeds, within 1.5x of transformers')."""
    ours_err, theirs_err = [], []
    for seed in range(4):
        ref = hf_model(seed=seed)
        path = save_hf(ref, tmp_path / f"ckpt{seed}")
        ours = moetune.load_model(path, dtype="bfloat16")
        assert ours.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
        ids = torch.randint(0, 96, (4, 32))
        with torch.no_grad():
            truth = ref(input_ids=ids).logits
            theirs_err.append(rel_err(ref.to(torch.bfloat16)(input_ids=ids).logits.float(), truth))
            ours_err.append(rel_err(ours(ids).float(), truth))
    assert sum(ours_err) < 1.5 * sum(theirs_err)


def test_fused_layout_and_sharded_files_load(tmp_path):
    ref = hf_model(seed=3)
    # transformers v5's fused layout, written by hand into two files with an index
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    keys = sorted(sd)
    half = len(keys) // 2
    d = tmp_path / "fused"
    d.mkdir()
    save_file({k: sd[k] for k in keys[:half]}, d / "a.safetensors")
    save_file({k: sd[k] for k in keys[half:]}, d / "b.safetensors")
    wm = {k: ("a.safetensors" if i < half else "b.safetensors") for i, k in enumerate(keys)}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    ref.config.to_json_file(d / "config.json")
    assert any("experts.gate_up_proj" in k for k in keys)
    ours = moetune.load_model(str(d))
    ids = torch.randint(0, 96, (1, 20))
    with torch.no_grad():
        assert rel_err(ours(ids), ref(input_ids=ids).logits) < 1e-4
    # and the hub's per-expert layout in many small shards
    path = save_hf(ref, tmp_path / "hub", max_shard_size="20KB")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    ours2 = moetune.load_model(path)
    with torch.no_grad():
        assert torch.equal(ours2(ids), ours(ids))


def test_missing_unexpected_misshaped_tensors_are_named(tmp_path):
    ref = hf_model(seed=4)
    for case in ("missing", "unexpected", "misshaped"):
        path = save_hf(ref, tmp_path / case)
        if case == "missing":
            rewrite_checkpoint(path, lambda sd: sd.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
            match = r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight.*missing"
        elif case == "unexpected":
            rewrite_checkpoint(path, lambda sd: sd.__setitem__("model.layers.1.mlp.bogus.weight", torch.zeros(2)))
            match = r"unexpected tensor model\.layers\.1\.mlp\.bogus\.weight in model\.safetensors"
        else:
            rewrite_checkpoint(path, lambda sd: sd.__setitem__("model.layers.0.self_attn.q_proj.weight",
                                                               torch.zeros(3, 3)))
            match = r"model\.layers\.0\.self_attn\.q_proj\.weight in model\.safetensors has shape \[3, 3\]"
        with pytest.raises(CheckpointError, match=match):
            moetune.load_model(path)


@pytest.mark.parametrize("key, value", [("model.layers.1.mlp.experts.2.down_proj.weight", float("nan")),
                                        ("model.layers.0.self_attn.o_proj.weight", float("-inf")),
                                        ("model.norm.weight", float("inf"))])
def test_a_non_finite_base_tensor_is_named_at_load(tmp_path, key, value):
    """One bad value anywhere (a routed expert's weight, fused into a stack at load; an attention projection; a norm)
    fails the load naming the tensor, instead of a first step whose loss is NaN."""
    path = save_hf(hf_model(seed=4), tmp_path / "ckpt")

    def spoil(sd):
        sd[key].view(-1)[7] = value
    rewrite_checkpoint(path, spoil)
    name = key.replace(".experts.2.down_proj.weight", ".experts.down_proj") if ".experts." in key else key
    with pytest.raises(CheckpointError, match=rf"tensor {re.escape(name)} of the checkpoint at .* non-finite values"):
        moetune.load_model(path)


def test_mtp_layer_is_ignored(tmp_path):
    ref = hf_model(seed=5)
    path = save_hf(ref, tmp_path / "ckpt")
    n = ref.config.num_hidden_layers
    rewrite_checkpoint(path, lambda sd: sd.update({f"model.layers.{n}.eh_proj.weight": torch.zeros(4, 4),
                                                   f"model.layers.{n}.self_attn.q_proj.weight": torch.zeros(4, 4)}))
    ours = moetune.load_model(path)  # strict: any other unexpected tensor would raise (see the test above)
    ids = torch.randint(0, ref.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(ours(ids), ref(input_ids=ids).logits) < 1e-5  # the MTP layer's tensors took no part
    assert len(ours.model.layers) == n
    # and a tensor of a real layer that the model lacks is still refused: the MTP exception is that layer only
    rewrite_checkpoint(path, lambda sd: sd.update({f"model.layers.{n - 1}.eh_proj.weight": torch.zeros(4, 4)}))
    with pytest.raises(CheckpointError, match=rf"unexpected tensor model\.layers\.{n - 1}\.eh_proj\.weight"):
        moetune.load_model(path)
