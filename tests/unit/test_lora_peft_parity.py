"""Our LoRA against PEFT's on transformers' Glm4MoeForCausalLM holding the same LoRA weights: logits, loss and
every LoRA gradient agree. The PEFT names and layouts used here are moetune.export.peft_layout's, so these
tests are also what verifies that module's facts against PEFT itself."""

import warnings

import pytest
import torch

import moetune
from moetune.export import peft_layout
from moetune.model.lora import apply_lora, format_trainable_table, lora_state_dict, trainable_table
from helpers import TINY_HF, hf_model, randomize_lora, save_hf

peft = pytest.importorskip("peft")

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "dense_mlp", "shared_experts", "experts"]


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def peft_model(base, peft_state, peft_cfg):
    """`base` wrapped by PEFT from our exported config, holding our exported tensors (all keys must fit)."""
    cfg = peft.LoraConfig(**{k: v for k, v in peft_cfg.items() if k != "peft_type"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(base, cfg)
    theirs = {peft_layout.strip_adapter_name(k) for k, _ in pm.named_parameters() if ".lora_" in k}
    theirs = {k if k.startswith(peft_layout.PREFIX) else peft_layout.PREFIX + k for k in theirs}
    assert theirs == set(peft_state), (sorted(theirs - set(peft_state))[:4], sorted(set(peft_state) - theirs)[:4])
    res = peft.set_peft_model_state_dict(pm, peft_state)
    assert not res.unexpected_keys and not [k for k in res.missing_keys if ".lora_" in k]
    return pm


def lora_grads_of_peft(pm, peft_cfg):
    grads = {}
    for k, p in pm.named_parameters():
        if ".lora_" in k:
            k = peft_layout.strip_adapter_name(k)
            grads[k if k.startswith(peft_layout.PREFIX) else peft_layout.PREFIX + k] = p.grad
    return peft_layout.from_peft_state_dict(grads, peft_cfg)[0]


@pytest.mark.parametrize("rank,alpha,rslora", [(4, 8.0, False), (8, 5.0, True)])
def test_loss_logits_and_lora_grads_match_peft(tmp_path, rank, alpha, rslora):
    path = save_hf(hf_model(seed=2), tmp_path / "ckpt")
    ours = moetune.load_model(path, dtype="float32")
    apply_lora(ours, ALL_TARGETS, rank, alpha, 0.0, rslora)
    randomize_lora(ours, seed=7)
    meta = {"rank": rank, "alpha": alpha, "rslora": rslora, "targets": ALL_TARGETS}
    peft_state, peft_cfg = peft_layout.to_peft_state_dict(lora_state_dict(ours), meta)
    pm = peft_model(hf_model(seed=2), peft_state, peft_cfg)

    B, S = 2, 24
    ids = torch.randint(0, TINY_HF["vocab_size"], (B, S), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :6] = -100  # a masked prompt
    shifted = torch.cat([labels[:, 1:], torch.full((B, 1), -100)], dim=1)
    n_targets = (shifted != -100).sum()

    with torch.no_grad():
        want_logits = pm(input_ids=ids).logits
        got_logits = ours(ids, torch.arange(S).expand(B, S))
    assert rel_err(got_logits, want_logits) < 1e-4
    with torch.no_grad(), pm.disable_adapter():
        base_logits = pm(input_ids=ids).logits
    assert rel_err(base_logits, want_logits) > 1e-2, "the LoRA weights must actually change the output"

    want_loss = pm(input_ids=ids, labels=labels).loss  # mean over the shifted targets
    want_loss.backward()
    got_loss = ours(ids, torch.arange(S).expand(B, S), labels=shifted) / n_targets  # ours is the sum
    got_loss.backward()
    assert abs(got_loss.item() - want_loss.item()) / want_loss.item() < 1e-5

    theirs = lora_grads_of_peft(pm, peft_cfg)
    mine = {k: p.grad for k, p in ours.named_parameters() if ".lora" in k}
    assert set(mine) == set(theirs)
    assert all(g is not None and g.abs().sum() > 0 for g in mine.values())
    bad = {k: rel_err(mine[k], theirs[k]) for k in mine if rel_err(mine[k], theirs[k]) > 1e-4}
    assert not bad, bad


def test_expert_factor_orderings_verified_against_peft(tmp_path):
    """Only expert 5 gets a LoRA (written through peft_layout); PEFT must change only expert 5's output, by
    exactly scaling·B₅A₅. Pins A's expert-major rows and B's rank-major columns independently of our model."""
    r, E, e0 = 3, TINY_HF["n_routed_experts"], 5
    H, I = TINY_HF["hidden_size"], TINY_HF["moe_intermediate_size"]
    g = torch.Generator().manual_seed(0)
    state = {}
    for layer in (1, 2):
        p = f"model.layers.{layer}.mlp.experts.lora."
        for name, shape in (("gate_up_A", (E, r, H)), ("gate_up_B", (E, 2 * I, r)), ("down_A", (E, r, I)), ("down_B", (E, H, r))):
            t = torch.zeros(shape)
            t[e0] = torch.randn(shape[1:], generator=g)
            state[p + name] = t
    meta = {"rank": r, "alpha": 6.0, "targets": ["experts"]}
    peft_state, peft_cfg = peft_layout.to_peft_state_dict(state, meta)
    pm = peft_model(hf_model(seed=1), peft_state, peft_cfg)
    experts = pm.base_model.model.model.layers[1].mlp.experts
    base = experts.get_base_layer()
    x = torch.randn(4, H, generator=g)
    s = 6.0 / r
    with torch.no_grad():
        for e in range(E):
            idx, w = torch.full((4, 1), e), torch.ones(4, 1)
            y = experts(x, idx, w)
            with pm.disable_adapter():
                y0 = experts(x, idx, w)
            if e != e0:
                assert torch.equal(y, y0), f"expert {e} changed"
                continue
            lora = {k.rsplit(".", 1)[-1]: v[e0] for k, v in state.items() if ".layers.1." in k}
            gu = base.gate_up_proj[e0] + s * lora["gate_up_B"] @ lora["gate_up_A"]
            dn = base.down_proj[e0] + s * lora["down_B"] @ lora["down_A"]
            gate, up = (x @ gu.T).chunk(2, dim=-1)
            want = (torch.nn.functional.silu(gate) * up) @ dn.T
            assert rel_err(y, want) < 1e-5 and rel_err(y, y0) > 1e-2


def test_peft_round_trip_of_layout():
    E, r, H, I2 = 8, 3, 16, 10
    state = {"model.layers.1.mlp.experts.lora.gate_up_A": torch.randn(E, r, H),
             "model.layers.1.mlp.experts.lora.gate_up_B": torch.randn(E, I2, r),
             "model.layers.0.self_attn.q_proj.lora_A": torch.randn(r, H),
             "model.layers.0.mlp.down_proj.lora_B": torch.randn(H, r),
             "model.layers.1.mlp.shared_experts.up_proj.lora_A": torch.randn(r, H)}
    peft_state, cfg = peft_layout.to_peft_state_dict(state, {"rank": r, "alpha": 1.0})
    assert peft_state["base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight"].shape == (I2, r * E)
    back, meta = peft_layout.from_peft_state_dict(peft_state, cfg)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    assert meta["targets"] == ["q_proj", "dense_mlp", "shared_experts", "experts"]


def test_peft_rewrites_mlp_target_modules_on_glm4_moe():
    """Why peft_layout expresses dense/shared MLP LoRA as 2-D target_parameters: PEFT turns target_modules
    gate/up/down_proj into the routed experts' fused parameters and leaves dense and shared MLPs bare."""
    cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(hf_model(seed=0), cfg)
    adapted = {k.split(".lora_")[0] for k, _ in pm.named_parameters() if ".lora_" in k}
    if any("shared_experts" in k for k in adapted):
        pytest.skip("this PEFT no longer rewrites MLP target_modules; peft_layout's 2-D target_parameters still work")
    assert not any(".layers.0.mlp." in k for k in adapted)
    assert any(k.endswith("mlp.experts.base_layer") for k in adapted)  # experts adapted although never asked for


def test_lora_at_init_leaves_logits_unchanged(tmp_path):
    path = save_hf(hf_model(seed=4), tmp_path / "ckpt")
    model = moetune.load_model(path, dtype="float32")
    ids = torch.randint(0, TINY_HF["vocab_size"], (2, 16))
    with torch.no_grad():
        before = model(ids)
        apply_lora(model, ALL_TARGETS, rank=4, alpha=16.0)
        after = model(ids)
    assert all(p.abs().sum() > 0 for k, p in model.named_parameters() if k.endswith(("lora_A", "_A")))
    assert torch.equal(before, after)


def test_trainable_table_counts_exactly_the_targeted_parameters(tmp_path):
    path = save_hf(hf_model(seed=5), tmp_path / "ckpt")
    model = moetune.load_model(path, dtype="float32")
    r = 4
    apply_lora(model, ALL_TARGETS, rank=r, alpha=8.0)
    # TINY_HF: H 64, 4 heads x 16 (q out 64), 2 kv heads (k/v out 32), 3 layers of which layer 0 dense
    # (intermediate 96), layers 1-2 MoE: 8 experts of intermediate 32, one shared expert of 32.
    H, Q, KV, Id, Ie, E, L, moe = 64, 64, 32, 96, 32, 8, 3, 2
    lin = lambda i, o: r * i + o * r  # noqa: E731  (A [r, in] + B [out, r])
    want = {
        "q_proj": (2 * L, L * lin(H, Q)),                                    # 1536
        "k_proj": (2 * L, L * lin(H, KV)),                                   # 1152
        "v_proj": (2 * L, L * lin(H, KV)),                                   # 1152
        "o_proj": (2 * L, L * lin(Q, H)),                                    # 1536
        "dense_mlp": (6, 2 * lin(H, Id) + lin(Id, H)),                       # 1920
        "shared_experts": (6 * moe, moe * (2 * lin(H, Ie) + lin(Ie, H))),    # 2304
        "experts": (4 * moe, moe * E * (r * H + 2 * Ie * r + r * Ie + H * r)),  # 14336
    }
    assert want["experts"][1] == 14336 and want["dense_mlp"][1] == 1920
    got = {k: (n, c) for k, n, c in trainable_table(model)}
    assert got == want
    text = format_trainable_table(model)
    total = sum(c for _, c in want.values())
    assert f"{total:,}" in text
    for kind, (n, c) in want.items():
        assert any(line.split()[:3] == [kind, str(n), f"{c:,}"] for line in text.splitlines()), kind
    base = sum(p.numel() for k, p in model.named_parameters() if ".lora" not in k)
    assert sum(p.numel() for p in model.parameters()) == base + total
