"""Weight sync from a trainer whose frozen base is stored in fp8 (model/quant). Formats bf16/fp8: the wire carries
the weights the model computes with — each fp8 weight dequantised with its scales (row-wise or block), LoRA merged —
never the raw fp8 values or the scales. Format fp8_rows (an engine serving the compressed-tensors release): the fp8
weights requantised after the merge with new row scales, as `export merged --dtype fp8` writes them. Always within
the sender's memory bound."""

import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import moetune
from helpers import hf_model, random_adapter, randomize_lora, save_hf
from moetune.export.merged import export_merged
from moetune.model.build import build_model
from moetune.model.config import ModelConfig
from moetune.model.hf_io import cast_model, init_weights
from moetune.model.lora import apply_lora
from moetune.model.quant.checkpoint import fp8_config
from moetune.model.quant.fp8 import ROWWISE, Fp8Scheme
from moetune.model.quant.modules import dequantize_model, fp8_weights, quantize_model
from moetune.sync import receive
from moetune.sync.fp8 import FP8
from moetune.sync.plan import build_plan
from moetune.sync.vllm import load_weights_consumer
from test_sync import TARGETS, TINY, NameRecorder, merged_reference, receive_into, run_sync, tiny_model  # noqa: F401


def fp8_model(scheme, seed=0):
    m = build_model(ModelConfig.from_hf_dict({**TINY, "num_hidden_layers": 3}), "cpu")
    cast_model(m, torch.bfloat16)
    quantize_model(m, scheme)
    init_weights(m, seed=seed)
    apply_lora(m, TARGETS, 4, 8.0)
    randomize_lora(m, seed + 1)
    return m


@pytest.mark.parametrize("scheme", [Fp8Scheme(), Fp8Scheme((16, 32))], ids=["rowwise", "block"])
def test_an_fp8_base_syncs_its_dequantised_merged_weights(scheme):
    src = fp8_model(scheme)
    assert fp8_weights(src)
    dst = tiny_model(lora=False, seed=7)
    stats, (got,) = run_sync(src, [lambda g: receive_into(g, dst)], format="bf16", bucket_bytes=48 << 10,
                             max_experts_per_unit=3)
    want = merged_reference(dequantize_model(copy.deepcopy(src)))  # the same model with plain fp32 weights
    assert set(got["updated"]) == set(want) and not any("scale" in n for n in got["updated"])
    state = {**dict(dst.named_parameters()), **dict(dst.named_buffers())}
    for name, w in want.items():
        assert state[name].dtype == w.dtype and torch.equal(state[name], w), name
    assert stats["peak_alloc"] <= stats["bound"]


# ------------------------------------------------------------------------------------------------ format fp8_rows
def _hub_fp8_base(tmp_path, experts_fp8: bool) -> str:
    """A checkpoint in the compressed-tensors FP8 releases' layout: every decoder-layer projection fp8 with a
    `weight_scale` per row (the routed experts too, or ignored and bf16), the rest bf16 (the correction bias fp32)."""
    plain = save_hf(hf_model(seed=3), tmp_path / "plain")
    tensors = {}
    for k, v in load_file(os.path.join(plain, "model.safetensors")).items():
        if k.startswith("model.layers.") and k.endswith("_proj.weight") and (experts_fp8 or ".mlp.experts." not in k):
            tensors[k], tensors[k[: -len("weight")] + "weight_scale"] = ROWWISE.quantize(v)
        else:
            tensors[k] = v.contiguous() if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)
    qc = fp8_config(ROWWISE)
    if not experts_fp8:
        qc["ignore"] = [*qc["ignore"], "re:.*mlp\\.experts\\..*"]
    os.makedirs(tmp_path / "base")
    save_file(tensors, str(tmp_path / "base" / "model.safetensors"))
    cfg = json.load(open(os.path.join(plain, "config.json")))
    json.dump(dict(cfg, dtype="bfloat16", quantization_config=qc), open(tmp_path / "base" / "config.json", "w"))
    return str(tmp_path / "base")


@pytest.mark.parametrize("experts_fp8", [False, True], ids=["experts_bf16", "experts_fp8"])
def test_an_fp8_rows_sync_carries_what_export_merged_fp8_writes(tmp_path, experts_fp8):
    """Format fp8_rows, for an engine serving the compressed-tensors FP8 release: what the sync hands vLLM's
    load_weights is, name for name and bit for bit, what `export merged --dtype fp8` writes — the weights the base
    stores in fp8 merged and requantised with a new scale per row, the rest bf16 — in many small buckets with the
    experts cut into units, within the sender's bound. A moetune model receiving it gets those weights dequantised."""
    base = _hub_fp8_base(tmp_path, experts_fp8)
    random_adapter(base, tmp_path / "adapter", ["q_proj", "k_proj", "v_proj", "o_proj", "dense_mlp", "shared_experts",
                                                 "experts"], scale=0.05)
    export_merged(base, str(tmp_path / "adapter"), str(tmp_path / "merged"), dtype="fp8")
    want = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert any(k.endswith("experts.0.gate_proj.weight_scale") for k in want) == experts_fp8

    trainer = moetune.load_model(base, dtype="float32", adapter=str(tmp_path / "adapter"))
    got, twin = NameRecorder(), moetune.load_model(base, dtype="float32")
    twin = dequantize_model(twin)
    stats, _ = run_sync(trainer, [lambda g: receive(g, load_weights_consumer(got)), lambda g: receive_into(g, twin)],
                        format="fp8_rows", bucket_bytes=24 << 10, max_experts_per_unit=3)
    assert stats["buckets"] > 6 and stats["peak_alloc"] <= stats["bound"]
    assert set(got.seen) == set(want)
    for name, w in want.items():
        dtype, shape, value = got.seen[name]
        assert (dtype, shape) == (w.dtype, tuple(w.shape)), name
        bits = (lambda t: t.view(torch.uint8)) if w.dtype == FP8 else (lambda t: t)
        assert torch.equal(bits(value), bits(w)), name
    # the moetune receiver: fp8 weights dequantised with their row scales
    q, s = want["model.layers.1.self_attn.q_proj.weight"], want["model.layers.1.self_attn.q_proj.weight_scale"]
    assert torch.equal(twin.model.layers[1].self_attn.q_proj.weight, q.float() * s)
    E = twin.model.layers[1].mlp.experts
    gate = want["model.layers.1.mlp.experts.2.gate_proj.weight"]
    if experts_fp8:
        gate = gate.float() * want["model.layers.1.mlp.experts.2.gate_proj.weight_scale"]
    assert torch.equal(E.gate_up_proj[2, : gate.shape[0]], gate.float())


def test_format_fp8_rows_needs_a_base_stored_in_fp8_rows():
    for model, needle in ((tiny_model(), "this model's base is not fp8"),
                          (fp8_model(Fp8Scheme((16, 32))), "this base is block-scaled: sync format fp8 or bf16")):
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        with pytest.raises(ValueError, match=needle):
            build_plan(model, tensors, "fp8_rows", "merge")
