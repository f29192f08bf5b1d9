"""`export_merged`: a streaming merge that transformers loads as moetune's base+adapter, in bounded memory."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moetune.export import ExportError, export_merged
from moetune.model.adapter_io import save_adapter
from moetune.model.config import ModelConfig
from helpers import TINY_HF, hf_model, random_adapter, save_hf

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "dense_mlp", "shared_experts", "experts"]


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def hf_logits(path, ids):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return m(input_ids=ids).logits


@pytest.fixture
def base(tmp_path):
    path = save_hf(hf_model(seed=21), tmp_path / "base")
    (tmp_path / "base" / "tokenizer.json").write_text('{"fake": true}')
    (tmp_path / "base" / "chat_template.jinja").write_text("{{ messages }}")
    return path


def test_merged_round_trip_through_transformers(tmp_path, base):
    ours = random_adapter(base, tmp_path / "run" / "adapter", TARGETS, rank=4, alpha=8.0)
    max_shard = 150_000
    report = export_merged(base, tmp_path / "run", tmp_path / "merged", dtype="float32", max_shard_bytes=max_shard)
    out = tmp_path / "merged"
    ids = torch.randint(0, TINY_HF["vocab_size"], (3, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ours(ids)
    assert rel_err(hf_logits(out, ids), want) < 1e-4
    # hub layout, sharded with an index that names every tensor and the right total
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert report["shards"] == len(shards) > 1
    assert all(os.path.getsize(out / s) <= max_shard + 10_000 for s in shards)  # + header
    names = set(index["weight_map"])
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in names and not any("gate_up_proj" in n for n in names)
    assert not any("lora" in n for n in names)
    total = 0
    for s in shards:
        with safe_open(str(out / s), "pt") as f:
            for k in f.keys():
                assert index["weight_map"][k] == s
                total += f.get_tensor(k).numel() * 4
    assert total == index["metadata"]["total_size"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "glm4_moe" and cfg.get("dtype", cfg.get("torch_dtype")) == "float32"
    assert {"tokenizer.json", "chat_template.jinja", "generation_config.json"} <= set(report["copied"])
    assert (out / "tokenizer.json").read_text() == '{"fake": true}'


def test_bf16_merge_verifies(tmp_path, base):
    random_adapter(base, tmp_path / "adapter", TARGETS, rank=8, alpha=4.0, rslora=True)
    report = export_merged(base, tmp_path / "adapter", tmp_path / "merged", verify=True)
    v = report["verify"]
    assert v["transformers_vs_moetune"] < 1e-4 and v["merged_vs_reference"] < 1e-4
    with safe_open(str(tmp_path / "merged" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.1.mlp.experts.0.gate_proj.weight").dtype == torch.bfloat16
        assert f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32


def test_fused_base_layout_and_mtp_layer_pass_through(tmp_path, base):
    """A base in transformers v5's fused layout, with an MTP layer moetune does not model, merges to the same
    tensors as the hub layout; the MTP tensors come through (cast)."""
    random_adapter(base, tmp_path / "adapter", TARGETS)
    sd = hf_model(seed=21).state_dict()
    mtp = f"model.layers.{TINY_HF['num_hidden_layers']}.eh_proj.weight"
    sd[mtp] = torch.randn(64, 128)
    fused = tmp_path / "fused"
    fused.mkdir()
    save_file({k: v.contiguous() for k, v in sd.items()}, fused / "model.safetensors")
    (fused / "config.json").write_text((tmp_path / "base" / "config.json").read_text())
    assert "model.layers.1.mlp.experts.gate_up_proj" in sd
    export_merged(base, tmp_path / "adapter", tmp_path / "a", dtype="float32")
    export_merged(str(fused), tmp_path / "adapter", tmp_path / "b", dtype="bfloat16")
    a = load_file(tmp_path / "a" / "model.safetensors")
    b = load_file(tmp_path / "b" / "model.safetensors")
    assert set(b) == set(a) | {mtp}
    assert torch.equal(b[mtp], sd[mtp].to(torch.bfloat16))
    for k in a:
        if k.endswith("e_score_correction_bias"):
            assert torch.equal(a[k], b[k])
        else:
            assert torch.equal(a[k].to(torch.bfloat16), b[k]), k


def test_adapter_for_another_model_is_refused_before_writing(tmp_path, base):
    other = save_hf(hf_model(seed=1, num_hidden_layers=4), tmp_path / "other")
    random_adapter(other, tmp_path / "adapter", ["q_proj"])
    with pytest.raises(ExportError, match="match no weight"):
        export_merged(base, tmp_path / "adapter", tmp_path / "merged")
    assert not (tmp_path / "merged").exists()  # nothing at all: not even config.json
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".merged")]  # nor a temporary or a lock
    with pytest.raises(ExportError, match="out_dir must differ"):
        export_merged(base, tmp_path / "adapter", base)


# ------------------------------------------------------------------------------------- streaming memory bound
BIG = dict(TINY_HF, vocab_size=256, hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
           intermediate_size=512, moe_intermediate_size=256, n_routed_experts=32, num_experts_per_tok=4,
           num_hidden_layers=16, first_k_dense_replace=1)


def write_big_checkpoint(path, adapter_dir, rank=8):
    """A bf16 checkpoint in the hub's per-expert layout, written one layer per shard so the writer never holds
    more than a layer; plus an adapter on attention, shared and routed experts. Returns one MoE layer's bytes."""
    cfg = ModelConfig.from_hf_dict(dict(BIG, partial_rotary_factor=0.5))
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    H, I, E, q, kv = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, 8 * 64, 2 * 64
    g = torch.Generator().manual_seed(0)
    pool = (torch.randn(1 << 22, generator=g) * 0.02).to(torch.bfloat16)
    offset = [0]

    def bf(*shape):  # random-looking weights cut from one pool: drawing 200M normals would dominate the test
        n = torch.Size(shape).numel()
        offset[0] = (offset[0] + 7919) % (pool.numel() - n)
        return pool[offset[0]: offset[0] + n].clone().view(shape)

    weight_map, lora, layer_bytes = {}, {}, 0
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}"
        t = {f"{p}.input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
             f"{p}.post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
             f"{p}.self_attn.q_proj.weight": bf(q, H), f"{p}.self_attn.q_proj.bias": bf(q),
             f"{p}.self_attn.k_proj.weight": bf(kv, H), f"{p}.self_attn.k_proj.bias": bf(kv),
             f"{p}.self_attn.v_proj.weight": bf(kv, H), f"{p}.self_attn.v_proj.bias": bf(kv),
             f"{p}.self_attn.o_proj.weight": bf(H, q)}
        for name, (i, o) in dict(q_proj=(H, q), k_proj=(H, kv), v_proj=(H, kv), o_proj=(q, H)).items():
            lora[f"{p}.self_attn.{name}.lora_A"] = torch.randn(rank, i) * 0.01
            lora[f"{p}.self_attn.{name}.lora_B"] = torch.randn(o, rank) * 0.01
        if n < cfg.first_k_dense_replace:
            Id = cfg.intermediate_size
            t.update({f"{p}.mlp.gate_proj.weight": bf(Id, H), f"{p}.mlp.up_proj.weight": bf(Id, H),
                      f"{p}.mlp.down_proj.weight": bf(H, Id)})
        else:
            t[f"{p}.mlp.gate.weight"] = bf(E, H)
            t[f"{p}.mlp.gate.e_score_correction_bias"] = torch.zeros(E)
            for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                t[f"{p}.mlp.shared_experts.{proj}.weight"] = bf(*shape)
                lora[f"{p}.mlp.shared_experts.{proj}.lora_A"] = torch.randn(rank, shape[1]) * 0.01
                lora[f"{p}.mlp.shared_experts.{proj}.lora_B"] = torch.randn(shape[0], rank) * 0.01
                for e in range(E):
                    t[f"{p}.mlp.experts.{e}.{proj}.weight"] = bf(*shape)
            lora[f"{p}.mlp.experts.lora.gate_up_A"] = torch.randn(E, rank, H) * 0.01
            lora[f"{p}.mlp.experts.lora.gate_up_B"] = torch.randn(E, 2 * I, rank) * 0.01
            lora[f"{p}.mlp.experts.lora.down_A"] = torch.randn(E, rank, I) * 0.01
            lora[f"{p}.mlp.experts.lora.down_B"] = torch.randn(E, H, rank) * 0.01
            layer_bytes = max(layer_bytes, sum(v.numel() * v.element_size() for v in t.values()))
        fname = f"layer-{n:03d}.safetensors"
        save_file(t, path / fname)
        weight_map.update({k: fname for k in t})
        del t
    rest = {"model.embed_tokens.weight": bf(cfg.vocab_size, H), "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
            "lm_head.weight": bf(cfg.vocab_size, H)}
    save_file(rest, path / "rest.safetensors")
    weight_map.update({k: "rest.safetensors" for k in rest})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_adapter(lora, str(adapter_dir), dict(rank=rank, alpha=16.0, dropout=0.0, rslora=False,
                                              targets=["q_proj", "k_proj", "v_proj", "o_proj", "shared_experts", "experts"]))
    return layer_bytes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc/self/status and clear_refs")
def test_streaming_merge_peak_memory_is_about_a_layer(tmp_path):
    layer_bytes = write_big_checkpoint(tmp_path / "big", tmp_path / "adapter")
    ckpt_bytes = sum(os.path.getsize(tmp_path / "big" / f) for f in os.listdir(tmp_path / "big"))
    adapter_bytes = os.path.getsize(tmp_path / "adapter" / "adapter_model.safetensors")
    assert ckpt_bytes > 12 * layer_bytes > 250e6  # the bound below is far under what loading everything costs
    script = textwrap.dedent(f"""
        import json, torch
        from moetune.export import export_merged
        torch.ones(8) @ torch.ones(8)
        def status(key):
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak (VmHWM): transient import-time peaks must not hide the merge's growth
        before = status("VmRSS")
        r = export_merged({str(tmp_path / 'big')!r}, {str(tmp_path / 'adapter')!r}, {str(tmp_path / 'merged')!r},
                          dtype="bfloat16", max_shard_bytes={3 * layer_bytes})
        after = status("VmHWM")
        print(json.dumps({{"before": before, "after": after, "shards": r["shards"]}}))
    """)
    env = dict(os.environ, OMP_NUM_THREADS="2")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    m = json.loads(res.stdout.strip().splitlines()[-1])
    growth = m["after"] - m["before"]
    bound = 2 * layer_bytes + 64e6
    assert growth < bound, f"peak RSS grew {growth / 1e6:.0f} MB; bound {bound / 1e6:.0f} MB " \
                           f"(layer {layer_bytes / 1e6:.0f} MB, checkpoint {ckpt_bytes / 1e6:.0f} MB, adapter {adapter_bytes / 1e6:.0f} MB)"
    assert m["shards"] > 3
    # and the result is complete and right: spot-check one merged expert
    with open(tmp_path / "merged" / "model.safetensors.index.json") as f:
        wm = json.load(f)["weight_map"]
    k = "model.layers.9.mlp.experts.17.up_proj.weight"
    with safe_open(str(tmp_path / "merged" / wm[k]), "pt") as f:
        got = f.get_tensor(k)
    with safe_open(str(tmp_path / "big" / "layer-009.safetensors"), "pt") as f:
        W = f.get_tensor(k).float()
    A = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    Ie = BIG["moe_intermediate_size"]
    want = W + 2.0 * A["model.layers.9.mlp.experts.lora.gate_up_B"][17, Ie:] @ A["model.layers.9.mlp.experts.lora.gate_up_A"][17]
    assert torch.equal(got, want.to(torch.bfloat16))
