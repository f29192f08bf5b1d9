"""LoRA on GLM-4.7-Flash / GLM-5 (MLA projections, MLPs, experts) against PEFT's on transformers' models holding
the same LoRA weights: logits, loss and every LoRA gradient agree."""

import warnings

import pytest
import torch

import moetune
from moetune.config import load_config
from moetune.export import peft_layout
from moetune.model.lora import apply_lora, lora_state_dict, trainable_table
from family_models import hf_dsa, hf_lite
from helpers import randomize_lora, save_hf

peft = pytest.importorskip("peft")

MLP = ["dense_mlp", "shared_experts", "experts"]
CASES = {
    "lite": (hf_lite, {}, ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"] + MLP),
    "lite_no_q_lora": (hf_lite, dict(q_lora_rank=None), ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]),
    "dsa": (hf_dsa, {}, ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"] + MLP),
}


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def to_peft(our_state, targets, rank, alpha):
    """Attention LoRA keys map one to one (PEFT's LoRA Linear); MLPs and experts through peft_layout."""
    attn = {k: v for k, v in our_state.items() if ".self_attn." in k}
    rest = {k: v for k, v in our_state.items() if k not in attn}
    mlp_targets = [t for t in targets if t in MLP]
    state, cfg = peft_layout.to_peft_state_dict(rest, {"rank": rank, "alpha": alpha, "targets": mlp_targets})
    state.update({f"{peft_layout.PREFIX}{k}.weight": v for k, v in attn.items()})
    cfg["target_modules"] = [t for t in targets if t not in MLP]
    return state, cfg


@pytest.mark.parametrize("case", list(CASES))
def test_loss_logits_and_lora_grads_match_peft(tmp_path, case):
    make, over, targets = CASES[case]
    rank, alpha = 4, 8.0
    path = save_hf(make(seed=2, **over), tmp_path / "ckpt")
    ours = moetune.load_model(path, dtype="float32")
    adapted = apply_lora(ours, targets, rank, alpha)
    assert all(adapted[t] for t in targets)
    randomize_lora(ours, 7)
    peft_state, peft_cfg = to_peft(lora_state_dict(ours), targets, rank, alpha)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(make(seed=2, **over), peft.LoraConfig(**{k: v for k, v in peft_cfg.items() if k != "peft_type"}))
    theirs_keys = {peft_layout.strip_adapter_name(k) for k, _ in pm.named_parameters() if ".lora_" in k}
    assert theirs_keys == set(peft_state)
    res = peft.set_peft_model_state_dict(pm, peft_state)
    assert not res.unexpected_keys

    B, S = 2, 24  # > the DSA index_topk: the indexer selects
    ids = torch.randint(0, 96, (B, S), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :6] = -100
    shifted = torch.cat([labels[:, 1:], torch.full((B, 1), -100)], dim=1)
    with torch.no_grad():
        want_logits = pm(input_ids=ids).logits
        assert rel_err(ours(ids), want_logits) < 1e-4
        with pm.disable_adapter():
            assert rel_err(pm(input_ids=ids).logits, want_logits) > 1e-2
    want_loss = pm(input_ids=ids, labels=labels).loss
    want_loss.backward()
    got_loss = ours(ids, labels=shifted) / (shifted != -100).sum()
    got_loss.backward()
    assert abs(got_loss.item() - want_loss.item()) / want_loss.item() < 1e-5

    grads = {peft_layout.strip_adapter_name(k): p.grad for k, p in pm.named_parameters() if ".lora_" in k}
    attn = {k[len(peft_layout.PREFIX):-len(".weight")]: v for k, v in grads.items() if ".self_attn." in k}
    theirs, _ = peft_layout.from_peft_state_dict({k: v for k, v in grads.items() if ".self_attn." not in k},
                                                 peft_cfg)
    theirs.update(attn)
    mine = {k: p.grad for k, p in ours.named_parameters() if ".lora" in k}
    assert set(mine) == set(theirs)
    assert all(v is not None and v.abs().sum() > 0 for v in mine.values())
    bad = {k: rel_err(mine[k], theirs[k]) for k in mine if rel_err(mine[k], theirs[k]) > 1e-4}
    assert not bad, bad


def test_mla_alias_adapts_the_query_form_the_model_has(tmp_path):
    targets = load_config(None, ["--lora.targets", "[mla_attention]"]).lora.targets
    assert targets == ["q_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"]
    with_q_lora = moetune.load_model(save_hf(hf_lite(seed=1), tmp_path / "a"))
    without = moetune.load_model(save_hf(hf_lite(seed=1, q_lora_rank=None), tmp_path / "b"))
    assert apply_lora(with_q_lora, targets, 2, 4.0) == dict.fromkeys(targets, 3) | {"q_proj": 0}
    assert apply_lora(without, targets, 2, 4.0) == dict.fromkeys(targets, 3) | {"q_a_proj": 0, "q_b_proj": 0}
    kinds = {k for k, _, _ in trainable_table(with_q_lora)}
    assert kinds == {"o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"}


@pytest.mark.parametrize("targets, match", [
    (["k_proj"], r"\['k_proj'\] match no module of this model \(glm4_moe_lite, MLA attention"),
    (["q_proj"], r"\['q_proj'\] match no module"),  # the model has q_a_proj/q_b_proj
])
def test_targets_the_model_lacks_are_named(tmp_path, targets, match):
    model = moetune.load_model(save_hf(hf_lite(seed=1), tmp_path / "a"))
    with pytest.raises(ValueError, match=match):
        apply_lora(model, targets, 2, 4.0)
