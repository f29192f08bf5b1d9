"""`export merged --dtype fp8` writes in fp8 exactly what the base stores in fp8 (or, for a bf16 base trained on fp8,
what training stored in fp8), whatever the experts' layout:

- an FP8 checkpoint whose quantization_config ignores the routed experts (compressed-tensors `ignore`, experts kept
  bf16): it loads with fp8 attention/shared experts and bf16 experts, and the export keeps the experts bf16 (the config
  it keeps says they are not quantised; vLLM would otherwise read fp8 bytes as an unquantised MoE);
- a bf16 base with transformers v5's fused expert stacks (gate_up_proj [E, 2I, H]), trained on fp8: the export writes
  each expert in fp8 with its scale (it wrote the fp8 values cast back to bf16 beside a scale, which does not load).
"""

import json
import os

import torch
from safetensors.torch import load_file, save_file

from helpers import hf_model, random_adapter, save_hf
from moetune.export.merged import export_merged
from moetune.model.adapter_io import read_adapter, save_adapter
from moetune.model.hf_io import load_model
from moetune.model.quant.checkpoint import fp8_config
from moetune.model.quant.fp8 import FP8, ROWWISE
from moetune.model.quant.modules import fp8_weights

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "dense_mlp", "shared_experts", "experts"]
IGNORE_EXPERTS = {**fp8_config(ROWWISE),  # the releases' config, with the routed experts ignored too
                  "ignore": ["lm_head", "re:.*mlp\\.gate$", "re:.*mlp\\.experts\\..*"]}


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_an_fp8_base_with_bf16_experts_loads_and_exports_them_bf16(tmp_path):
    plain = save_hf(hf_model(seed=3), tmp_path / "plain")
    sd = load_file(os.path.join(plain, "model.safetensors"))
    fp8, deq = {}, {}
    for k, v in sd.items():
        if k.startswith("model.layers.") and k.endswith("_proj.weight") and ".mlp.experts." not in k:
            q, s = ROWWISE.quantize(v)
            fp8[k], fp8[k[: -len("weight")] + "weight_scale"] = q, s
            deq[k] = ROWWISE.dequantize(q, s).contiguous()
        else:
            fp8[k] = deq[k] = v.contiguous()
    cfg = json.load(open(os.path.join(plain, "config.json")))
    for name, tensors, qc in (("base", fp8, IGNORE_EXPERTS), ("dequantised", deq, None)):
        os.makedirs(tmp_path / name)
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
        json.dump(dict(cfg, quantization_config=qc) if qc else cfg, open(tmp_path / name / "config.json", "w"))
    base = str(tmp_path / "base")

    model = load_model(base, dtype="float32")
    names = {n for n, _ in fp8_weights(model)}
    assert {"model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight"} <= names
    assert not any(".mlp.experts." in n for n in names)
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.float32
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), load_model(str(tmp_path / "dequantised"), dtype="float32")(ids),
                                   rtol=1e-4, atol=1e-4)

    random_adapter(base, tmp_path / "adapter", TARGETS, scale=0.05)
    report = export_merged(base, str(tmp_path / "adapter"), str(tmp_path / "fp8"), dtype="fp8", verify=True)
    assert report["verify"]["merged_vs_reference"] < 1e-4
    assert json.load(open(tmp_path / "fp8" / "config.json"))["quantization_config"] == IGNORE_EXPERTS
    out = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    assert {k for k, v in out.items() if v.dtype == FP8} == {k for k, v in fp8.items() if v.dtype == FP8}
    assert {k for k in out if "scale" in k} == {k for k in fp8 if "scale" in k}
    assert out["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.bfloat16


def test_a_fused_expert_base_trained_on_fp8_exports_each_expert_in_fp8(tmp_path):
    plain = save_hf(hf_model(seed=5), tmp_path / "plain")
    sd = load_file(os.path.join(plain, "model.safetensors"))
    fused = {k: v for k, v in sd.items() if ".mlp.experts." not in k}
    for layer in (1, 2):
        p = f"model.layers.{layer}.mlp.experts"
        fused[f"{p}.gate_up_proj"] = torch.stack([torch.cat([sd[f"{p}.{e}.gate_proj.weight"],
                                                             sd[f"{p}.{e}.up_proj.weight"]]) for e in range(8)])
        fused[f"{p}.down_proj"] = torch.stack([sd[f"{p}.{e}.down_proj.weight"] for e in range(8)])
    os.makedirs(tmp_path / "base")
    save_file(fused, str(tmp_path / "base" / "model.safetensors"))
    (tmp_path / "base" / "config.json").write_text(open(os.path.join(plain, "config.json")).read())
    base = str(tmp_path / "base")
    random_adapter(base, tmp_path / "adapter", ["q_proj", "experts"])
    state, meta = read_adapter(str(tmp_path / "adapter"))
    meta = {k: v for k, v in meta.items() if k not in ("format", "base_model")}
    save_adapter(state, str(tmp_path / "adapter"), dict(meta, base_quantize="fp8"), base_model=base)

    report = export_merged(base, str(tmp_path / "adapter"), str(tmp_path / "fp8"), dtype="fp8", verify=True)
    assert report["verify"]["merged_vs_reference"] < 1e-4
    out = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    e = "model.layers.1.mlp.experts.3.up_proj"
    assert out[e + ".weight"].dtype == FP8 and out[e + ".weight_scale"].shape == (32, 1)
    trained = load_model(base, dtype="float32", adapter=str(tmp_path / "adapter"), quantize="fp8")
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # one more e4m3 rounding of each merged weight
        assert _rel(load_model(str(tmp_path / "fp8"), dtype="float32")(ids), trained(ids)) < 0.15
