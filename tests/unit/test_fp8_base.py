"""An FP8 frozen base (model/quant): the storage formats, the matmuls' references, the hub's FP8 checkpoint layouts
loaded as they are, a bf16 checkpoint quantised at load, and LoRA over an fp8 base.

The reference for everything is the dequantised model: the same weights, stored in fp32 as q·scale."""

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from family_models import hf_dsa, hf_lite
from helpers import hf_model, rewrite_checkpoint, save_hf
from moetune.model.grouped_gemm import scaled_grouped_mm_reference
from moetune.model.hf_io import load_model
from moetune.model.quant.fp8 import FP8, ROWWISE, Fp8Scheme, quantize_blocks, quantize_rows
from moetune.model.quant.matmul import (expert_of_rows, fp8_grouped_linear, fp8_linear, fp8_mm, fp8_mm_dgrad,
                                        reference_fp8_dgrad, reference_fp8_grouped_linear, reference_fp8_linear)
from moetune.model.quant.modules import fp8_weights, scale_name, stacked_parts


def _rel(a, b):
    err = ((a.double() - b.double()).norm() / b.double().norm()).item()
    assert err == err, "NaN in a comparison"
    return err


# ----------------------------------------------------------------------------------------------- formats and matmuls
@pytest.mark.parametrize("scheme", [ROWWISE, Fp8Scheme((16, 32))], ids=["rowwise", "block"])
def test_quantise_round_trip_within_e4m3_error(scheme):
    torch.manual_seed(0)
    w = torch.randn(3, 48, 80) * torch.logspace(-2, 1, 48).view(1, 48, 1)  # rows of very different magnitude
    q, s = scheme.quantize(w)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == scheme.scale_shape(w.shape)
    back = scheme.dequantize(q, s)
    # e4m3 keeps 3 mantissa bits: each element within 2^-4 of its value, or of the subnormal step of its row/block
    assert _rel(back, w) < 0.04
    assert (q.float().abs().amax() <= 448).all()
    # scales are per row / block: a row of zeros stays exactly zero, no NaN
    w[0, 0] = 0
    q, s = scheme.quantize(w)
    assert torch.equal(scheme.dequantize(q, s)[0, 0], torch.zeros(80))


def test_block_scales_follow_the_blocks():
    w = torch.ones(32, 64)
    w[16:, 32:] *= 100.0
    q, s = quantize_blocks(w, (16, 32))
    assert s.shape == (2, 2)
    torch.testing.assert_close(s, torch.tensor([[1.0, 1.0], [1.0, 100.0]]) / 448)


def test_scaled_mm_kernel_calls_equal_their_references():
    """torch._scaled_mm runs on the CPU too: the exact operand layouts, scales and transposes of the GPU path (forward
    and the input gradient with the weight's row scales folded into dy) against the torch references."""
    torch.manual_seed(0)
    x, g = torch.randn(24, 64), torch.randn(24, 48)
    w8, s = quantize_rows(torch.randn(48, 64) * 0.05)
    bias = torch.randn(48)
    torch.testing.assert_close(fp8_mm(x, w8, s, bias).float(), reference_fp8_linear(x, w8, s, bias), rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(fp8_mm_dgrad(g, w8, s).float(), reference_fp8_dgrad(g, w8, s), rtol=1e-5, atol=1e-5)
    # and both are within fp8's own error of the dequantised fp32 product
    w = w8.float() * s
    assert _rel(reference_fp8_linear(x, w8, s), x @ w.t()) < 0.05
    assert _rel(reference_fp8_dgrad(g, w8, s), g @ w) < 0.05


def test_eager_quantisation_compiled_equals_op_by_op(monkeypatch):
    """`EAGER_QUANT = "compiled"` (the eager code of the expert-parallel exchange): each operand's quantisation runs
    as a compiled function of its own, with the values op-by-op torch gives."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from moetune.model.quant import matmul

    torch.manual_seed(0)
    x, g = torch.randn(24, 64).bfloat16(), torch.randn(24, 48).bfloat16()
    w8, s = quantize_rows(torch.randn(48, 64) * 0.05)
    offs = torch.tensor([5, 5, 17, 24], dtype=torch.int32)
    stack_scale = torch.rand(4, 48, 1) + 0.5

    def run():
        return (fp8_mm(x, w8, s, None), fp8_mm_dgrad(g, w8, s), *matmul._quantized(quantize_rows, x),
                *matmul._quantized(matmul._gmm_dgrad_operand, g, stack_scale, offs))

    torch._dynamo.reset()
    monkeypatch.setattr(matmul, "EAGER_QUANT", "torch")
    eager = run()
    counter = CompileCounterWithBackend("aot_eager")  # traced as Inductor would, without its code generation
    monkeypatch.setattr(matmul, "EAGER_QUANT", "compiled")
    monkeypatch.setattr(matmul, "EAGER_QUANT_BACKEND", counter)
    compiled = run()
    assert counter.frame_count == 3  # quantize_rows, the dense and the grouped input-gradient operands
    for a, b in zip(compiled, eager):
        assert a.dtype == b.dtype and torch.equal(a.float(), b.float())


def test_a_compiled_fp8_layer_keeps_no_copy_of_its_weights_for_backward(monkeypatch):
    """The input gradient reads each fp8 weight K-major, a transposed copy. Compiled, the partitioner must not compute
    that copy in the forward and keep it for the backward (a second copy of every stack: 11.6 GiB on one EP-8 rank of
    Air, BENCHMARKS.md): every fp8 tensor the forward graph saves is one of its inputs (a weight) or a view of one.
    The fp8 tensor-core path is forced on and only traced (the CPU has no `_scaled_grouped_mm` to run it)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from moetune.model.config import ModelConfig
    from moetune.model.glm4_moe import rope_cos_sin
    from moetune.model.hf_io import build_model, cast_model, init_weights
    from moetune.model.lora import apply_lora
    from moetune.model.quant import matmul
    from moetune.model.quant.modules import quantize_model

    monkeypatch.setattr(matmul, "_fp8_kernels", lambda *a: True)
    cfg = ModelConfig.from_hf_dict(dict(vocab_size=64, hidden_size=64, intermediate_size=48, moe_intermediate_size=32,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1))
    model = build_model(cfg, "meta")
    cast_model(model, torch.bfloat16)
    quantize_model(model, ROWWISE)
    apply_lora(model, ["q_proj", "k_proj", "v_proj", "o_proj"], 4, 8)
    model.to_empty(device="cpu")
    init_weights(model, 0.02, seed=0)
    saved_fp8 = []

    class Traced(Exception):
        pass

    def forward_compiler(gm, _):
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        for node in outputs:
            if isinstance(node, torch.fx.Node) and node.meta["val"].dtype == FP8:
                root = node
                while root.op == "call_function" and root.target in (torch.ops.aten.transpose.int,
                                                                      torch.ops.aten.t.default,
                                                                      torch.ops.aten.view.default):
                    root = root.args[0]
                saved_fp8.append((node.name, root.op, str(root.target)))
        raise Traced

    backend = aot_autograd(fw_compiler=forward_compiler, partition_fn=min_cut_rematerialization_partition)
    layer = model.model.layers[1]  # attention (fp8 q, k, v, o under LoRA) and the MoE (fp8 stacks, shared expert)
    layer.compile(dynamic=False, backend=backend)
    h = torch.randn(1, 24, 64, dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(24).unsqueeze(0)
    cos, sin = rope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta, torch.bfloat16)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as traced:
        layer(h, cos, sin, model.attn_meta(pos))
    assert isinstance(traced.value.inner_exception, Traced), traced.value
    assert saved_fp8, "the forward saves the fp8 weights the input gradients read"
    assert all(op == "placeholder" for _, op, _ in saved_fp8), saved_fp8


@pytest.mark.parametrize("scheme", [ROWWISE, Fp8Scheme((16, 16))], ids=["rowwise", "block"])
def test_dequantise_path_equals_the_dequantised_product_and_saves_no_weight(scheme):
    torch.manual_seed(0)
    w8, s = scheme.quantize(torch.randn(48, 64) * 0.05)
    w = scheme.dequantize(w8, s)
    x = torch.randn(2, 5, 64, requires_grad=True)
    bias = torch.randn(48)
    y = fp8_linear(x, w8, s, scheme, bias)
    x2 = x.detach().clone().requires_grad_(True)
    y2 = torch.nn.functional.linear(x2, w, bias)
    torch.testing.assert_close(y, y2)
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    torch.testing.assert_close(x.grad, x2.grad)

    # autograd keeps the fp8 weight, never a dequantised copy
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fp8_linear(x, w8, s, scheme)
    assert not [t for t in saved if t.dtype == torch.float32 and t.shape == w.shape]


def test_grouped_dequantise_path_and_reference():
    torch.manual_seed(0)
    E, N, K = 4, 32, 48
    w8, s = quantize_rows(torch.randn(E, N, K) * 0.05)
    offs = torch.tensor([5, 5, 17, 30], dtype=torch.int32)
    x = torch.randn(30, K, requires_grad=True)
    y = fp8_grouped_linear(x, w8, s, offs, ROWWISE)
    e = expert_of_rows(offs, 30)
    assert e.tolist() == [0] * 5 + [2] * 12 + [3] * 13
    w = w8.float() * s
    want = torch.einsum("nk,nok->no", x.detach(), w[e])
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(x.grad, torch.einsum("no,nok->nk", g, w[e]), rtol=1e-5, atol=1e-5)
    assert _rel(reference_fp8_grouped_linear(x.detach(), w8, s, offs), want) < 0.05


# ----------------------------------------------------------------------------------------------- checkpoints
QUANTISED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_a_proj",
             "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "_proj")


def _is_quantised(key: str) -> bool:
    """What the hub's FP8 releases store in fp8: every linear of the decoder layers but the router (mlp.gate) and
    DSA's indexer (kept bf16 in GLM-5-FP8's indexer? here: quantised, to check a bf16 module reading fp8)."""
    if not key.endswith(".weight") or not key.startswith("model.layers.") or "norm" in key:
        return False
    return key.endswith(("_proj.weight", "_proj_with_mqa.weight", ".wq_b.weight", ".wk.weight"))


def write_fp8_checkpoint(hf, path, layout: str, block=(16, 16)):
    """Save a transformers model as the hub's FP8 releases are laid out: `compressed-tensors` (fp8 weight +
    `weight_scale [out, 1]`, dynamic per-token activations) or DeepSeek-style `fp8` (`weight_scale_inv` per block).
    Returns the directory of the same weights dequantised (fp32), the reference."""
    plain = save_hf(hf, path / "plain")
    sd = {}
    for f in os.listdir(plain):
        if f.endswith(".safetensors"):
            sd.update(load_file(os.path.join(plain, f)))
    cfg = json.load(open(os.path.join(plain, "config.json")))
    scheme = ROWWISE if layout == "compressed-tensors" else Fp8Scheme(block)
    out, deq = {}, {}
    for k, v in sd.items():
        if _is_quantised(k):
            q, s = scheme.quantize(v)
            out[k] = q
            out[k[: -len("weight")] + ("weight_scale" if layout == "compressed-tensors" else "weight_scale_inv")] = s
            deq[k] = scheme.dequantize(q, s).contiguous()
        else:
            out[k] = deq[k] = v.contiguous()
    fp8_dir, deq_dir = path / layout, path / "dequantised"
    for d, tensors in ((fp8_dir, out), (deq_dir, deq)):
        os.makedirs(d, exist_ok=True)
        save_file(tensors, str(d / "model.safetensors"))
    if layout == "compressed-tensors":
        # as llm-compressor writes it: without quantization_status transformers takes the weights for uncompressed
        # ones and fake-quantises with zero points the file does not hold (NaN logits)
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
              "ignore": ["lm_head", "re:.*mlp.gate$"],
              "config_groups": {"group_0": {"targets": ["Linear"],
                                            "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                        "symmetric": True, "dynamic": False},
                                            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                                  "symmetric": True, "dynamic": True}}}}
    else:
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    json.dump(dict(cfg, quantization_config=qc), open(fp8_dir / "config.json", "w"))
    json.dump(cfg, open(deq_dir / "config.json", "w"))
    return str(fp8_dir), str(deq_dir)


ARCHS = {"glm4_moe": lambda: hf_model(seed=1), "glm4_moe_lite": lambda: hf_lite(seed=1), "glm_moe_dsa": lambda: hf_dsa(seed=1)}


@pytest.mark.parametrize("layout", ["compressed-tensors", "fp8-block"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_fp8_checkpoint_loads_as_stored_and_equals_the_dequantised_model(tmp_path, arch, layout):
    hf = ARCHS[arch]()
    if layout == "fp8-block" and arch != "glm4_moe":
        block = (2, 4)  # MLA's tiny projections have 10-, 12- and 24-wide dims
    else:
        block = (16, 16)
    fp8_dir, deq_dir = write_fp8_checkpoint(hf, tmp_path, layout, block)
    model = load_model(fp8_dir, dtype="float32")
    names = dict(fp8_weights(model))
    assert names and all(model.get_parameter(n).dtype == FP8 for n in names)
    assert any(".experts.gate_up_proj" in n for n in names) and any("self_attn" in n for n in names)
    assert model.lm_head.weight.dtype == torch.float32 and model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    ref = load_model(deq_dir, dtype="float32")
    ids = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block", [(16, 16), (32, 16)], ids=["more-blocks-than-fused", "as-many-blocks-as-fused"])
def test_fused_gate_up_keeps_the_two_grids_of_its_parts(tmp_path, block):
    """The hub blocks each expert's gate and up [I, H] on their own grids: fused into [2I, H], the scales are the two
    grids side by side (2·⌈I/b0⌉ rows), not one grid of ⌈2I/b0⌉ — different where I is not a multiple of b0: I = 24
    with 16-row blocks (2 + 2 rows against 3) or 32-row blocks (1 + 1 against 2: the same count, other blocks)."""
    hf = hf_model(seed=1, moe_intermediate_size=24)
    fp8_dir, deq_dir = write_fp8_checkpoint(hf, tmp_path, "fp8-block", block)
    model = load_model(fp8_dir, dtype="float32")
    ref = load_model(deq_dir, dtype="float32")
    ids = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids), rtol=1e-4, atol=1e-4)
    # a bf16 checkpoint quantised at load uses the same grids: each part quantised alone, as the hub would store it
    quantised = load_model(deq_dir, dtype="float32", quantize="fp8_block")
    scheme = dict(fp8_weights(quantised))["model.layers.1.mlp.experts.gate_up_proj"]
    gate_up = quantised.get_parameter("model.layers.1.mlp.experts.gate_up_proj")
    scale = quantised.get_parameter(scale_name("model.layers.1.mlp.experts.gate_up_proj", scheme))
    w = ref.get_parameter("model.layers.1.mlp.experts.gate_up_proj")
    for part, rows in enumerate((slice(0, 24), slice(24, 48))):
        q, s = scheme.quantize(w[:, rows])
        assert torch.equal(gate_up[:, rows].view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale[:, part], s)


def test_unquantised_checkpoint_quantised_at_load_equals_quantising_each_weight(tmp_path):
    hf = hf_model(seed=2)
    path = save_hf(hf, tmp_path / "plain")
    model = load_model(path, dtype="float32", quantize="fp8")
    ref = load_model(path, dtype="float32")
    sd = ref.state_dict()
    for name, scheme in fp8_weights(model):
        q, s = scheme.quantize(sd[name])
        assert torch.equal(model.get_parameter(name).view(torch.uint8), q.view(torch.uint8)), name
    with torch.no_grad():
        for name, scheme in fp8_weights(model):
            sd[name] = scheme.dequantize(model.get_parameter(name), model.get_parameter(scale_name(name, scheme)))
        ref.load_state_dict(sd)
        ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(model(ids), ref(ids), rtol=1e-4, atol=1e-4)


def test_a_damaged_fp8_config_is_named(tmp_path):
    from moetune.errors import CheckpointError

    fp8_dir, _ = write_fp8_checkpoint(hf_model(seed=3), tmp_path, "compressed-tensors")
    cfg = json.load(open(os.path.join(fp8_dir, "config.json")))
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    json.dump(cfg, open(os.path.join(fp8_dir, "config.json"), "w"))
    with pytest.raises(CheckpointError, match="config.json.*8-bit float"):
        load_model(fp8_dir)


@pytest.mark.parametrize("qc, key", [
    ([1, 2], "quantization_config must be an object"),
    ({"quant_method": "compressed-tensors", "config_groups": [1]}, "quantization_config.config_groups must be"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": "x"}}}, "config_groups.g.weights must"),
    ({"quant_method": "fp8", "weight_block_size": "ab"}, "weight_block_size must be two positive integers"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be two positive integers"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "type": "float", "num_bits": 8, "strategy": "block", "block_structure": [128, 0]}}}}, "block_structure must be"),
])
def test_a_quantization_config_of_the_wrong_shape_is_named(tmp_path, qc, key):
    from moetune.errors import CheckpointError

    fp8_dir, _ = write_fp8_checkpoint(hf_model(seed=3), tmp_path, "compressed-tensors")
    cfg = json.load(open(os.path.join(fp8_dir, "config.json")))
    json.dump(dict(cfg, quantization_config=qc), open(os.path.join(fp8_dir, "config.json"), "w"))
    with pytest.raises(CheckpointError, match=f"config.json: .*{re.escape(key)}"):
        load_model(fp8_dir)


@pytest.mark.parametrize("key", ["model.layers.1.self_attn.q_proj.weight_scale",
                                 "model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.experts.0.up_proj.weight"])
def test_a_non_finite_fp8_weight_or_scale_is_named_at_load(tmp_path, key):
    """An fp8 weight holding e4m3's NaN code, or a scale that is NaN: the load fails naming it (ours: a routed expert's
    weights live in the fused stack)."""
    from moetune.errors import CheckpointError

    fp8_dir, _ = write_fp8_checkpoint(hf_model(seed=3), tmp_path, "compressed-tensors")

    def spoil(sd):
        if sd[key].dtype == FP8:
            sd[key].view(torch.uint8).view(-1)[3] = 0x7F  # e4m3fn's NaN
        else:
            sd[key].view(-1)[3] = float("nan")
    rewrite_checkpoint(fp8_dir, spoil)
    name = "model.layers.1.mlp.experts.gate_up_proj" if ".experts." in key else key
    with pytest.raises(CheckpointError, match=rf"tensor {re.escape(name)} of the checkpoint at .* non-finite values"):
        load_model(fp8_dir)


def test_an_fp8_scale_stored_as_integers_is_named(tmp_path):
    from moetune.errors import CheckpointError

    fp8_dir, _ = write_fp8_checkpoint(hf_model(seed=3), tmp_path, "compressed-tensors")
    key = "model.layers.1.self_attn.q_proj.weight_scale"
    rewrite_checkpoint(fp8_dir, lambda sd: sd.__setitem__(key, (sd[key] * 1e6).to(torch.int32)))
    with pytest.raises(CheckpointError, match=rf"tensor {re.escape(key)} of the checkpoint at .* stored as torch.int32"):
        load_model(fp8_dir)


# ----------------------------------------------------------------------------------------------- random base, LoRA
def _tiny(quantize=None, targets=None, dtype=torch.float32, layers=3, nonzero_lora=False, rank=4):
    """The builtin tiny model (`layers` decoder layers) in `dtype`, its base stored as `quantize` says, LoRA of `rank`
    on `targets` (nonzero_lora: B ≠ 0 too, so every LoRA path gets gradients)."""
    from moetune.model.build import build_model
    from moetune.model.config import BUILTIN, ModelConfig
    from moetune.model.hf_io import cast_model, init_weights
    from moetune.model.lora import apply_lora
    from moetune.model.quant.fp8 import scheme_named
    from moetune.model.quant.modules import quantize_model
    from moetune.train.setup import init_lora

    model = build_model(ModelConfig.from_hf_dict(dict(BUILTIN["tiny"], num_hidden_layers=layers)), "meta")
    cast_model(model, dtype)
    if quantize:
        quantize_model(model, scheme_named(quantize, (32, 32)))
    if targets:
        apply_lora(model, targets, rank, 2 * rank)
    model.to_empty(device="cpu")
    init_weights(model, 0.05, seed=0)
    init_lora(model, seed=0)
    if nonzero_lora:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.requires_grad:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    return model


@pytest.mark.parametrize("quantize", ["fp8", "fp8_block"])
def test_random_fp8_base_is_the_quantised_draw_of_the_same_seed(quantize):
    """Proxies and the demo draw an fp8 base as the bf16 one, then quantise: the two bases are the same weights."""
    plain, fp8 = _tiny(), _tiny(quantize)
    params = dict(plain.named_parameters())
    names = fp8_weights(fp8)
    assert len(names) == 3 * 4 + 3 + 2 * 3 + 2 * 2  # q,k,v,o per layer; dense MLP; shared experts; expert stacks
    for name, scheme in names:
        q, s = scheme.quantize(params[name], stacked_parts(name))  # gate_up: gate and up each on its own grid
        assert torch.equal(fp8.get_parameter(name).view(torch.uint8), q.view(torch.uint8)), name
        torch.testing.assert_close(fp8.get_parameter(scale_name(name, scheme)), s)
    for name, p in fp8.named_parameters():  # everything else: the same values
        if p.dtype != FP8 and "scale" not in name:
            assert torch.equal(p, params[name]), name


TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "dense_mlp", "shared_experts", "experts"]


def test_lora_over_an_fp8_base_gets_the_gradients_of_lora_over_the_dequantised_model():
    """LoRA on every kind of module over an fp8 base (CPU: the dequantise path) equals LoRA over the same weights
    dequantised into an fp32 model — whose LoRA equals PEFT's (test_lora_peft_parity)."""
    fp8 = _tiny("fp8", TARGETS)
    ref = _tiny(None, TARGETS)
    with torch.no_grad():
        for name, scheme in fp8_weights(fp8):
            ref.get_parameter(name).copy_(scheme.dequantize(fp8.get_parameter(name), fp8.get_parameter(scale_name(name, scheme))))
        for n, p in fp8.named_parameters():
            if p.requires_grad:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))  # B ≠ 0: every path counts
                ref.get_parameter(n).copy_(p)
    ids = torch.randint(0, 160, (2, 24), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, 1)
    for m in (fp8, ref):
        m(ids, labels=labels).backward()
    trainable = [(n, p) for n, p in fp8.named_parameters() if p.requires_grad]
    assert {n.rsplit(".", 2)[-2] for n, _ in trainable} >= {"q_proj", "gate_proj", "lora"}
    for n, p in trainable:
        assert p.grad is not None and p.grad.abs().sum() > 0, n
        torch.testing.assert_close(p.grad, ref.get_parameter(n).grad, rtol=1e-4, atol=1e-6)


def test_train_on_an_fp8_base_resumes_exactly(tmp_path):
    """`moetune train` with model.quantize fp8: the loss falls, the checkpoint holds only the trainable state (no
    base weight), and 3 steps + resume + 3 steps give the straight run's losses."""
    import shutil

    from helpers import run_inprocess, small_run_args, step_losses
    from moetune.run_dir import load_model_state

    over = {"model.quantize": "fp8", "train.steps": 6, "checkpoint.every": 3, "parallel.layout": "auto"}
    straight = run_inprocess(small_run_args(tmp_path, "straight", **over))
    losses = step_losses(straight)
    assert len(losses) == 6 and all(x == x for x in losses) and losses[-1] < losses[0]
    state = load_model_state(os.path.join(straight, "checkpoints", "step_000003"))
    assert state and all(".lora" in k for k in state)
    resumed = tmp_path / "runs" / "resumed"
    os.makedirs(resumed / "checkpoints")
    shutil.copytree(os.path.join(straight, "checkpoints", "step_000003"), resumed / "checkpoints" / "step_000003")
    for f in ("metrics.jsonl", "config.yaml"):
        shutil.copy(os.path.join(straight, f), resumed / f)
    run_inprocess(small_run_args(tmp_path, "resumed", **over, resume="auto"))
    assert step_losses(resumed) == losses


def test_a_run_keeping_the_transposed_copies_trains_as_one_without(tmp_path, monkeypatch):
    """parallel.fp8_transposed_copies true: the layout keeps them, setup makes them, and the run's losses are those of
    the run without (on the CPU the fp8 weights are dequantised just in time: the copies are only made here, their
    reading is test_kept_transposed_copies_...)."""
    from helpers import run_inprocess, small_run_args, step_losses
    from moetune.model.quant import modules

    kept = []
    real = modules.keep_transposed_copies
    monkeypatch.setattr(modules, "keep_transposed_copies", lambda m: kept.append(real(m)) or kept[-1])
    import moetune.train.setup as setup

    monkeypatch.setattr(setup, "keep_transposed_copies", modules.keep_transposed_copies)
    over = {"model.quantize": "fp8", "train.steps": 3}
    without = step_losses(run_inprocess(small_run_args(tmp_path, "without", **over)))
    assert not kept  # auto on a CPU run: nothing reads them
    copies = step_losses(run_inprocess(small_run_args(tmp_path, "copies", **over,
                                                      **{"parallel.fp8_transposed_copies": "true"})))
    assert len(kept) == 1 and kept[0] > 0 and copies == without


def test_generation_rebuilds_the_fp8_base_a_run_trained_on(tmp_path):
    """A run with model.quantize records it in its adapter; `load_for_generation(run)` rebuilds the random base,
    stores it in fp8 as training did, and gives the trained model's logits (the same base draw quantised, the
    adapter applied)."""
    from helpers import run_inprocess, small_run_args
    from moetune.config import load_config
    from moetune.inference import load_for_generation
    from moetune.model.adapter_io import load_adapter, read_adapter_config
    from moetune.model.build import build_model
    from moetune.model.config import model_config_for
    from moetune.model.hf_io import cast_model, init_weights
    from moetune.model.quant.fp8 import scheme_named
    from moetune.model.quant.modules import quantize_model

    run = run_inprocess(small_run_args(tmp_path, "gen", **{"model.quantize": "fp8", "train.steps": 2}))
    assert read_adapter_config(os.path.join(run, "adapter"))["base_quantize"] == "fp8"
    model, _ = load_for_generation(str(run), device="cpu")
    assert fp8_weights(model)
    cfg = load_config(os.path.join(run, "config.yaml"))
    trained = build_model(model_config_for(cfg), "meta")  # the trainer's base: the seed's draw, quantised
    cast_model(trained, torch.float32)
    quantize_model(trained, scheme_named("fp8"))
    trained.to_empty(device="cpu")
    init_weights(trained, cfg.model.init_std, seed=cfg.run.seed)
    load_adapter(trained, os.path.join(run, "adapter"))
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), trained(ids), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------- exports
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "dense_mlp", "shared_experts", "experts"]


@pytest.mark.parametrize("layout", ["compressed-tensors", "fp8-block"])
def test_merged_export_of_an_fp8_base_dequantises_then_merges_or_requantises(tmp_path, layout):
    """An adapter over an FP8 checkpoint: `dtype bfloat16/float32` writes dequantised base + LoRA (no scales, no
    quantization_config) and equals base + adapter; `dtype fp8` writes the merge requantised in the base's own
    format (its scale names and quantization_config), which loads as fp8 and --verify passes."""
    from helpers import random_adapter
    from moetune.export.merged import export_merged

    fp8_dir, _ = write_fp8_checkpoint(hf_model(seed=4), tmp_path, layout)
    random_adapter(fp8_dir, tmp_path / "adapter", ALL_TARGETS)
    ref = load_model(fp8_dir, dtype="float32", adapter=str(tmp_path / "adapter"))
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))

    report = export_merged(fp8_dir, str(tmp_path / "adapter"), str(tmp_path / "f32"), dtype="float32", verify=True)
    assert report["verify"]["merged_vs_reference"] < 1e-4
    cfg = json.load(open(tmp_path / "f32" / "config.json"))
    assert "quantization_config" not in cfg
    merged = load_model(str(tmp_path / "f32"), dtype="float32")
    assert not fp8_weights(merged)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids), ref(ids), rtol=1e-4, atol=1e-4)

    report = export_merged(fp8_dir, str(tmp_path / "adapter"), str(tmp_path / "fp8"), dtype="fp8", verify=True)
    assert report["verify"]["merged_vs_reference"] < 1e-4
    cfg, base_cfg = (json.load(open(os.path.join(d, "config.json"))) for d in (tmp_path / "fp8", fp8_dir))
    assert cfg["quantization_config"] == base_cfg["quantization_config"]
    out = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    base = load_file(os.path.join(fp8_dir, "model.safetensors"))
    assert {k for k, v in out.items() if v.dtype == FP8} == {k for k, v in base.items() if v.dtype == FP8}
    assert {k for k in out if "scale" in k} == {k for k in base if "scale" in k}
    requant = load_model(str(tmp_path / "fp8"), dtype="float32")
    assert fp8_weights(requant)
    with torch.no_grad():
        # one more e4m3 rounding of every merged weight (--verify above holds it to the requantised merge at 1e-4);
        # on these random N(0, 0.08) weights that is ~9% of the logits after 3 layers
        assert _rel(requant(ids), ref(ids)) < 0.15


def test_merged_export_of_a_bf16_base_trained_in_fp8_is_the_trained_model(tmp_path):
    """model.quantize trained LoRA on the quantised base: the merge goes into the quantised-dequantised weights (the
    model that was trained), and `dtype fp8` writes our row-wise compressed-tensors format."""
    from helpers import random_adapter
    from moetune.export.merged import export_merged
    from moetune.model.adapter_io import read_adapter_config, save_adapter
    from moetune.model.adapter_io import read_adapter

    base = save_hf(hf_model(seed=5), tmp_path / "base")
    random_adapter(base, tmp_path / "adapter", ALL_TARGETS)
    state, meta = read_adapter(str(tmp_path / "adapter"))
    meta = {k: v for k, v in meta.items() if k not in ("format", "base_model")}
    save_adapter(state, str(tmp_path / "adapter"), dict(meta, base_quantize="fp8"), base_model=base)
    assert read_adapter_config(str(tmp_path / "adapter"))["base_quantize"] == "fp8"
    trained = load_model(base, dtype="float32", adapter=str(tmp_path / "adapter"), quantize="fp8")
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    report = export_merged(base, str(tmp_path / "adapter"), str(tmp_path / "f32"), dtype="float32", verify=True)
    assert report["verify"]["merged_vs_reference"] < 1e-4
    with torch.no_grad():
        torch.testing.assert_close(load_model(str(tmp_path / "f32"), dtype="float32")(ids), trained(ids),
                                   rtol=1e-4, atol=1e-4)
    export_merged(base, str(tmp_path / "adapter"), str(tmp_path / "fp8"), dtype="fp8")
    cfg = json.load(open(tmp_path / "fp8" / "config.json"))
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    assert fp8_weights(load_model(str(tmp_path / "fp8"), dtype="float32"))


def test_merged_export_in_fp8_needs_an_fp8_base_or_training(tmp_path):
    from helpers import random_adapter
    from moetune.export.merged import export_merged
    from moetune.errors import ExportError

    base = save_hf(hf_model(seed=6), tmp_path / "base")
    random_adapter(base, tmp_path / "adapter", ["q_proj"])
    with pytest.raises(ExportError, match="dtype fp8: .* not an FP8 checkpoint"):
        export_merged(base, str(tmp_path / "adapter"), str(tmp_path / "out"), dtype="fp8")
    assert not os.path.exists(tmp_path / "out")


def test_lora_over_an_fp8_checkpoint_equals_peft_on_the_dequantised_model(tmp_path):
    """An FP8 checkpoint loaded as stored, LoRA on every target: logits, loss and every LoRA gradient equal PEFT's on
    transformers' Glm4MoeForCausalLM holding the dequantised weights (what the fp8 base computes with)."""
    pytest.importorskip("peft")
    from test_lora_peft_parity import lora_grads_of_peft, peft_model, rel_err
    from helpers import randomize_lora
    from moetune.export import peft_layout
    from moetune.model.lora import apply_lora, lora_state_dict
    from transformers import AutoModelForCausalLM

    fp8_dir, deq_dir = write_fp8_checkpoint(hf_model(seed=8), tmp_path, "compressed-tensors")
    ours = load_model(fp8_dir, dtype="float32")
    assert fp8_weights(ours)
    apply_lora(ours, ALL_TARGETS, 4, 8.0, 0.0, False)
    randomize_lora(ours, seed=7)
    meta = {"rank": 4, "alpha": 8.0, "rslora": False, "targets": ALL_TARGETS}
    peft_state, peft_cfg = peft_layout.to_peft_state_dict(lora_state_dict(ours), meta)
    pm = peft_model(AutoModelForCausalLM.from_pretrained(deq_dir, dtype=torch.float32).eval(), peft_state, peft_cfg)
    B, S = 2, 20
    ids = torch.randint(0, 96, (B, S), generator=torch.Generator().manual_seed(3))
    shifted = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], dim=1)
    with torch.no_grad():
        assert rel_err(ours(ids), pm(input_ids=ids).logits) < 1e-4
    for n, p in pm.named_parameters():  # a model from from_pretrained comes frozen: train the LoRA tensors
        p.requires_grad_(".lora_" in n)
    pm(input_ids=ids, labels=ids).loss.backward()
    (ours(ids, labels=shifted) / (shifted != -100).sum()).backward()
    theirs = lora_grads_of_peft(pm, peft_cfg)
    mine = {k: p.grad for k, p in ours.named_parameters() if ".lora" in k}
    assert set(mine) == set(theirs) and len(mine) > 20
    for k in mine:
        assert rel_err(mine[k], theirs[k]) < 1e-4, k


@pytest.mark.parametrize("base_kind", ["fp8-checkpoint", "bf16-trained-in-fp8", "fp8-checkpoint-one-linear-bf16"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_transformers_reads_the_fp8_export_as_we_do(tmp_path, arch, base_kind):
    """The merged export in fp8 (compressed-tensors: an FP8 checkpoint's own format, or ours for a bf16 base trained
    with model.quantize fp8; or a checkpoint storing in bf16 a linear its config declares fp8, which the export's config
    then excludes by name) loaded by transformers through the compressed-tensors package: every weight it ends with
    is our dequantised one (its routed experts come out in bf16: equal to bf16 rounding), and its logits equal ours
    with the activations quantised where transformers quantises them: 5.17's dequantize=True keeps compressed-tensors'
    scheme on every fp8 linear and quantises its input (dynamic, per token); 5.25's dequantises into a dense model and
    quantises none."""
    from compressed_tensors import __version__  # noqa: F401  (a test dependency: pyproject's [test] extra)
    from helpers import random_adapter
    from moetune.export.merged import export_merged
    from moetune.model.adapter_io import read_adapter, save_adapter
    from moetune.model.quant.modules import dequantize_model
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    hf = ARCHS[arch]()
    odd = "model.layers.1.self_attn.o_proj"
    if base_kind.startswith("fp8-checkpoint"):
        base, _ = write_fp8_checkpoint(hf, tmp_path, "compressed-tensors")
        if base_kind == "fp8-checkpoint-one-linear-bf16":
            rewrite_checkpoint(base, lambda sd: sd.__setitem__(
                f"{odd}.weight", ROWWISE.dequantize(sd[f"{odd}.weight"], sd.pop(f"{odd}.weight_scale"))))
    else:
        base = save_hf(hf, tmp_path / "base")
    mla = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "shared_experts", "experts"]
    random_adapter(base, tmp_path / "adapter", ALL_TARGETS if arch == "glm4_moe" else mla)
    if base_kind == "bf16-trained-in-fp8":
        state, meta = read_adapter(str(tmp_path / "adapter"))
        meta = {k: v for k, v in meta.items() if k not in ("format", "base_model")}
        save_adapter(state, str(tmp_path / "adapter"), dict(meta, base_quantize="fp8"), base_model=base)
    out = str(tmp_path / "export")
    export_merged(base, str(tmp_path / "adapter"), out, dtype="fp8")
    ours = dequantize_model(load_model(out, dtype="float32"))
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                  quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    mine, got = ours.state_dict(), theirs.state_dict()
    fp8_in_file = {k for k, v in load_file(os.path.join(out, "model.safetensors")).items() if v.dtype == FP8}
    assert len(fp8_in_file) > 10
    ignore = json.load(open(os.path.join(out, "config.json")))["quantization_config"]["ignore"]
    assert (odd in ignore) == (base_kind == "fp8-checkpoint-one-linear-bf16"), ignore
    checked = 0
    for k, w in mine.items():
        assert k in got, k
        if got[k].dtype == torch.bfloat16:  # transformers dequantises fp8 expert stacks to bf16
            assert ".experts." in k, k
            torch.testing.assert_close(got[k].float(), w.to(torch.bfloat16).float(), rtol=0, atol=0)
        else:
            torch.testing.assert_close(got[k], w, rtol=1e-6, atol=1e-7)
        checked += 1
    assert checked == len(mine)
    # their bf16 expert stacks replaced by our fp32 ones (equal to bf16 rounding, above): that rounding alone moves
    # the logits of the DSA model by ~6% here (its indexer's top-k is discrete), and the rest is held tightly
    with torch.no_grad():
        for k, v in got.items():
            if v.dtype == torch.bfloat16:
                theirs.get_parameter(k).data = mine[k].clone()
    # The format's dynamic activations, where transformers applies them: the linears that carry compressed-tensors'
    # scheme with input activations (in 5.17 every linear the file stores in fp8; its expert stacks, dequantised at
    # load, see bf16 inputs) quantise their input; ours the same, by hooks. compressed-tensors' "token" scales reduce
    # all dims but the first two: per token for [B, T, in], but per sequence for the [B, 1, T, r] input transformers'
    # MLA attention gives kv_b_proj (3.1% off per-token scales on one product): mirrored.
    ids = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    their_inputs = {}

    def record(name):
        def hook(module, args):
            their_inputs[name] = args[0].shape
        return hook

    for name, module in theirs.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is not None and scheme.input_activations is not None:
            assert f"{name}.weight" in fp8_in_file and scheme.input_activations.dynamic, name
            module.register_forward_pre_hook(record(name))
    with torch.no_grad():
        theirs(input_ids=ids)

    def quantised_input(per_sequence):
        def hook(module, args):
            x = args[0]
            q, s = quantize_rows(x.reshape(x.shape[0], -1) if per_sequence else x.reshape(-1, x.shape[-1]))
            return ((q.float() * s).view(x.shape).to(x.dtype),) + args[1:]
        return hook

    for name, module in ours.named_modules():
        if name in their_inputs:
            shape = their_inputs[name]
            assert len(shape) == 3 or (len(shape) == 4 and shape[1] == 1), (name, shape)
            module.register_forward_pre_hook(quantised_input(len(shape) == 4))
    with torch.no_grad():
        assert _rel(theirs(input_ids=ids).logits, ours(ids)) < 0.02


def test_an_export_config_names_what_it_writes_in_bf16_whatever_the_bases_exclusion_lists_hold():
    """declare_unquantised reads exclusion entries as the loaders do; entries that are no valid regular expression or
    no string exclude nothing (no traceback), so the module is named; what an entry already excludes is not repeated."""
    from moetune.model.quant.checkpoint import declare_unquantised

    ct = {"quant_method": "compressed-tensors", "ignore": ["lm_head", "re:.*mlp\\.experts\\..*", "re:(", None, 3]}
    got = declare_unquantised(ct, ["model.layers.1.mlp.experts.0.up_proj", "model.layers.1.self_attn.o_proj"])
    assert got["ignore"] == ct["ignore"] + ["model.layers.1.self_attn.o_proj"]
    fp8 = {"quant_method": "fp8", "modules_to_not_convert": ["lm_head", "mlp.gate", "indexer", "[bad"]}
    names = ["model.layers.0.mlp.gate", "model.layers.0.mlp.gate_proj", "model.layers.2.self_attn.indexer.wq_b"]
    got = declare_unquantised(fp8, names)
    assert got["modules_to_not_convert"] == fp8["modules_to_not_convert"] + names[1:]  # a suffix excludes the router
    assert declare_unquantised(fp8, names[:1]) is fp8 and declare_unquantised({"quant_method": "fp8"}, names[:1]) == {
        "quant_method": "fp8", "modules_to_not_convert": names[:1]}


def test_kept_transposed_copies_give_the_input_gradients_of_copies_made_each_backward(monkeypatch):
    """On the fp8 tensor-core path (forced on: torch._scaled_mm runs on the CPU, the grouped GEMM its fp32 stand-in)
    the input gradient through each fp8 weight reads it K-major. Copies kept for the run (Layout.fp8_copies) give the
    LoRA gradients of copies made in each backward, bitwise, and no stack is copied in backward; the copies are read
    (zeroed, the gradients change); no state_dict, parameter or buffer list sees them; dequantize_model drops them."""
    from moetune.model.quant import matmul
    from moetune.model.quant.modules import dequantize_model, keep_transposed_copies, transposed_copy

    monkeypatch.setattr(matmul, "_fp8_kernels", lambda x, w8, scheme: x.dtype == torch.bfloat16)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm_reference)
    copied = []
    real_copy = matmul._k_major_copy
    monkeypatch.setattr(matmul, "_k_major_copy", lambda w8, g: copied.append(tuple(w8.shape)) or real_copy(w8, g))
    model = _tiny("fp8", ["q_proj", "v_proj", "dense_mlp", "shared_experts"], torch.bfloat16, layers=2,
                  nonzero_lora=True)
    ids = torch.randint(0, 160, (2, 32), generator=torch.Generator().manual_seed(0))

    def grads():
        model.zero_grad(set_to_none=True)
        model(ids, labels=torch.roll(ids, -1, 1)).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    state = set(model.state_dict())
    made_each_backward = grads()
    assert copied and len(copied) == len(list(model.moe_layers())) * 2  # gate_up and down of each MoE layer
    nbytes = keep_transposed_copies(model)
    weights = fp8_weights(model)
    assert nbytes == sum(model.get_parameter(n).numel() for n, _ in weights)  # one byte each
    copied.clear()
    kept = grads()
    assert not copied
    assert kept.keys() == made_each_backward.keys()
    for n in kept:
        assert torch.equal(kept[n], made_each_backward[n]), n
    assert set(model.state_dict()) == state and not any(n.endswith("_transposed") for n, _ in model.named_buffers())
    for kind in ("weight", "_proj"):  # the copies are what the gradients read: the linears', then the stacks'
        for name, _ in weights:
            owner, _, attr = name.rpartition(".")
            if attr.endswith(kind):
                copy = transposed_copy(model.get_submodule(owner), attr)
                copy.copy_(copy.flip(0))
        assert any(not torch.equal(g, kept[n]) for n, g in grads().items()), kind
        keep_transposed_copies(model)
    dequantize_model(model)
    assert not any(transposed_copy(m, a) is not None for m in model.modules() for a in ("weight", "gate_up_proj"))


def test_the_tma_expert_path_compiled_and_recomputed_gives_the_eager_gradients(monkeypatch):
    """The fp8 tensor-core path as a GPU runs it by default — expert stacks through the TMA kernel (an opaque custom
    op; here under Triton's interpreter), the linears through torch._scaled_mm — in a compiled layer (one graph) with
    the layer recomputed whole (`full`: every op tagged for recompute as it dispatches, the selective-checkpoint
    machinery `selective` uses too), with and without the kept transposed copies: the LoRA gradients of the eager
    run without recompute, bitwise."""
    from moetune.model import grouped_gemm_tiles as tiles
    from moetune.model import grouped_gemm_tma as tma
    from moetune.model.quant import matmul
    from moetune.model.quant.modules import keep_transposed_copies
    from moetune.parallel.apply import apply_ac

    monkeypatch.setattr(matmul, "_fp8_kernels", lambda x, w8, scheme: x.dtype == torch.bfloat16)
    monkeypatch.setattr(tiles, "KERNEL_ON_CPU", True)
    assert (matmul.GROUPED_FORWARD, matmul.GROUPED_DGRAD, matmul.TMA_LAUNCH) == ("tma", "tma", "custom_op")
    launches = []
    real = tma.grouped_gemm_tma
    monkeypatch.setattr(tma, "grouped_gemm_tma", lambda *a, **k: launches.append(1) or real(*a, **k))
    ids = torch.randint(0, 160, (1, 16), generator=torch.Generator().manual_seed(0))

    def grads(layer_ac, compiled, copies):
        model = _tiny("fp8", ["q_proj", "o_proj", "shared_experts"], torch.bfloat16, layers=2, nonzero_lora=True)
        if copies:
            keep_transposed_copies(model)
        apply_ac(model, layer_ac)
        if compiled:
            torch._dynamo.reset()
            for layer in model.model.layers:
                layer.compile(fullgraph=True, backend="aot_eager", dynamic=False)
        model(ids, labels=torch.roll(ids, -1, 1)).backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    want = grads("none", False, False)
    assert launches  # the experts ran through the TMA kernel
    for copies in (False, True):
        launches.clear()
        got = grads("full", True, copies)
        assert len(launches) >= 5  # forward (gate_up, down), what backward recomputes of it, two input gradients
        assert not [n for n in want if not torch.equal(got[n], want[n])], copies


def _tiny_fp8_step(ids, compiled):
    """One forward and backward of the 2-layer tiny model on an fp8 base (LoRA on q, o and the shared expert,
    nonzero), each layer compiled as one graph or eager: the loss and the LoRA gradients."""
    return _tiny_step(_tiny("fp8", ["q_proj", "o_proj", "shared_experts"], torch.bfloat16, layers=2,
                            nonzero_lora=True), ids, compiled)


def _tiny_step(model, ids, compiled):
    """One forward and backward of `model`, each layer compiled as one graph or eager: the loss and the LoRA
    gradients."""
    if compiled:
        torch._dynamo.reset()
        for layer in model.model.layers:
            layer.compile(fullgraph=True, backend="aot_eager", dynamic=False)
    loss = model(ids, labels=torch.roll(ids, -1, 1))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("compiled", [False, True])
def test_the_fused_fp8_expert_mlp_on_the_stacks_as_stored_gives_the_gradients_of_the_k_major_copies(monkeypatch,
                                                                                                     compiled):
    """The fused expert node's two input gradients on the TMA path (forced on, Triton's interpreter) run on the
    stacks as stored (the TMA kernel's transposed product, SWAP), no K-major copy made, under GROUPED_DGRAD "w8a8",
    and under "tma" where the groups average at most STORED_DGRAD_MAX_ROWS rows (the tiny step's do); above it "tma"
    makes the copies. The loss and LoRA gradients are the copies' (the same fp8 operands). Eager, and compiled as one
    graph per layer."""
    from moetune.model import grouped_gemm_tiles as tiles
    from moetune.model import grouped_gemm_tma as tma
    from moetune.model.quant import matmul

    monkeypatch.setattr(matmul, "_fp8_kernels", lambda x, w8, scheme: x.dtype == torch.bfloat16)
    monkeypatch.setattr(tiles, "KERNEL_ON_CPU", True)
    for name in ("TMA_CONFIG_FP8", "TMA_CONFIG_FP8_SWAP"):
        monkeypatch.setattr(tma, name, dict(getattr(tma, name), BK=tiles._INTERPRETER_CONFIG["BK"]))
    swaps, copies = [], []
    real, real_copy = tma.grouped_gemm_tma, tma.k_major_copy
    monkeypatch.setattr(tma, "grouped_gemm_tma", lambda *a, **k: swaps.append(not a[4]) or real(*a, **k))
    # the stacks' copies (eager, the dense weights' input gradients copy their weights by the same kernel)
    monkeypatch.setattr(matmul, "k_major_copy", lambda w: (w.dim() == 3 and copies.append(w.shape)) or real_copy(w))
    ids = torch.randint(0, 160, (1, 16), generator=torch.Generator().manual_seed(0))

    def run(dgrad, max_rows):
        monkeypatch.setattr(matmul, "GROUPED_DGRAD", dgrad)
        monkeypatch.setattr(matmul, "STORED_DGRAD_MAX_ROWS", max_rows)
        swaps.clear(), copies.clear()
        return _tiny_fp8_step(ids, compiled)

    default = matmul.STORED_DGRAD_MAX_ROWS
    loss, grads = run("tma", 0)
    assert swaps.count(True) == 0 and len(copies) == 2  # gate_up's and down's copies, one a backward
    for dgrad, max_rows in (("tma", default), ("w8a8", 0)):
        got_loss, got = run(dgrad, max_rows)
        assert swaps.count(True) == 2 and not copies, dgrad  # both input gradients on the stacks as stored
        assert torch.equal(got_loss, loss)
        for n in grads:
            torch.testing.assert_close(got[n], grads[n], rtol=1e-3, atol=1e-6, msg=n)


@pytest.mark.parametrize("compiled", [False, True])
def test_the_fused_fp8_expert_mlp_gives_the_gradients_of_its_gemms_one_by_one(monkeypatch, compiled):
    """On the fp8 tensor-core path as a GPU runs it (forced on: the expert stacks through the TMA kernel under
    Triton's interpreter, the linears through torch._scaled_mm) the routed experts without expert LoRA run as one node (quant.matmul.fp8_expert_mlp: the SwiGLU quantised for down where it is computed,
    its backward writing gate_up's scaled, quantised operand). Against the GEMM-by-GEMM path (FUSED_EXPERT_MLP
    False): the same loss and LoRA gradients — the fused node's CPU path is the same arithmetic, only the routing
    weights' gradient is summed in another order — eager, and compiled as one graph per layer (where the node takes
    the tokens quantised, then gathered, and sums each token's rows itself: experts.fp8_routed_experts)."""
    from moetune.model import experts
    from moetune.model import grouped_gemm_tiles as tiles
    from moetune.model.quant import matmul

    monkeypatch.setattr(matmul, "_fp8_kernels", lambda x, w8, scheme: x.dtype == torch.bfloat16)
    monkeypatch.setattr(tiles, "KERNEL_ON_CPU", True)
    # the GEMM-by-GEMM path's SwiGLU backward as autograd's traced ops, whose arithmetic the fused node's CPU path
    # repeats (the row kernel, on here, keeps silu(gate)·up and its gradients in fp32 where they round to bf16 between
    # ops: 3.8% apart on a layer-0 LoRA gradient)
    monkeypatch.setattr(experts, "SWIGLU_BACKWARD", "inductor")
    calls = []
    # what the custom ops run (opaque to compile)
    for name in ("weighted_swiglu_fp8", "weighted_swiglu_bwd_fp8", "gathered_rows_fp8"):
        real = getattr(matmul, name)
        monkeypatch.setattr(matmul, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    ids = torch.randint(0, 160, (1, 16), generator=torch.Generator().manual_seed(0))

    def run(fused):
        monkeypatch.setattr(matmul, "FUSED_EXPERT_MLP", fused)
        return _tiny_fp8_step(ids, compiled)

    loss, grads = run(False)
    assert not calls
    got_loss, got = run(True)
    moe_layers = 1  # the tiny model's layer 0 is dense
    assert calls.count("weighted_swiglu_fp8") == moe_layers and calls.count("weighted_swiglu_bwd_fp8") == moe_layers
    assert calls.count("gathered_rows_fp8") == (moe_layers if compiled else 0)  # the combine inside: compiled only
    assert torch.equal(got_loss, loss)
    assert got.keys() == grads.keys()
    for n in grads:
        torch.testing.assert_close(got[n], grads[n], rtol=1e-2, atol=1e-5, msg=n)


@pytest.mark.parametrize("compiled", [False, True])
def test_dense_operands_quantised_by_the_row_kernel_give_the_traced_quantisations_gradients(monkeypatch, compiled):
    """The dense fp8 linears' operands (the activation forward; the gradient times the weight's row scales backward)
    quantised by the row kernel as an opaque op (DENSE_QUANT "kernel", forced on the CPU, where the op runs its torch
    reference) give the loss and LoRA gradients of quantize_rows traced into the graph ("inductor"), bitwise: the
    same arithmetic. Eager, and compiled as one graph per layer."""
    from moetune.model import grouped_gemm_tiles as tiles
    from moetune.model.quant import matmul

    from moetune.model import lora

    monkeypatch.setattr(matmul, "_fp8_kernels", lambda x, w8, scheme: x.dtype == torch.bfloat16)
    monkeypatch.setattr(tiles, "KERNEL_ON_CPU", True)
    monkeypatch.setattr(lora, "LORA_LINEAR", "addmm")  # LoRA's branch traced both ways (the op: the test below)
    calls = []
    real = matmul.scaled_rows_fp8
    monkeypatch.setattr(matmul, "scaled_rows_fp8", lambda x, cs: calls.append(cs is not None) or real(x, cs))
    ids = torch.randint(0, 160, (1, 16), generator=torch.Generator().manual_seed(0))

    def run(mode):
        monkeypatch.setattr(matmul, "DENSE_QUANT", mode)
        monkeypatch.setattr(matmul, "_dense_kernel_quant", lambda x2: mode == "kernel")
        calls.clear()
        return _tiny_fp8_step(ids, compiled)

    loss, grads = run("inductor")
    assert not calls
    got_loss, got = run("kernel")
    assert calls.count(False) >= 4 and calls.count(True) >= 4  # q, o and the shared expert's, forward and backward
    assert torch.equal(got_loss, loss)
    assert not [n for n in grads if not torch.equal(got[n], grads[n])]


@pytest.mark.parametrize("compiled", [False, True])
def test_lora_on_fp8_linears_as_one_op_gives_the_traced_forms_loss_and_gradients(monkeypatch, compiled):
    """Where the dense fp8 operands are quantised by the row kernel (forced on the CPU), the LoRA linears on fp8
    weights run as one op each way (lora.lora_linear), forward and backward, and the tiny model's loss and every
    LoRA gradient are those of the traced form (fp8 GEMM, then LoRA's addmm) within bf16's rounding: the same fp8
    products, the branch added in place. A rounding that moves a gradient value across an fp8 step moves every layer
    below it: the traced forms themselves (addmm against the product written, then added) differ by 4-8% relative L2
    in these gradients, the op against addmm by 0-6%; under 10% here, where dropping the branch from x's gradient
    gives 24% (layer 0's q). Eager, and compiled as one graph per layer."""
    from moetune.model import grouped_gemm_tiles as tiles
    from moetune.model import lora
    from moetune.model.quant import matmul

    monkeypatch.setattr(matmul, "_fp8_kernels", lambda x, w8, scheme: x.dtype == torch.bfloat16)
    monkeypatch.setattr(matmul, "_dense_kernel_quant", lambda x2: True)
    monkeypatch.setattr(tiles, "KERNEL_ON_CPU", True)
    calls = []  # the op's own GEMMs, run by its bodies (compiled too: the op is opaque)
    for name in ("fp8_mm", "fp8_mm_dgrad"):
        real = getattr(lora, name)
        monkeypatch.setattr(lora, name, lambda *a, _n=name, _f=real, **k: calls.append(_n) or _f(*a, **k))
    ids = torch.randint(0, 160, (1, 16), generator=torch.Generator().manual_seed(0))
    results = {}
    for form in ("addmm", "op"):
        monkeypatch.setattr(lora, "LORA_LINEAR", form)
        calls.clear()
        results[form] = _tiny_fp8_step(ids, compiled)
        # q and o of 2 layers, the shared expert's 3 linears of the MoE layer; an input gradient for each but layer 0's
        # q (its input comes from the frozen embedding)
        assert (calls.count("fp8_mm"), calls.count("fp8_mm_dgrad")) == ((7, 6) if form == "op" else (0, 0))
    (loss, grads), (got_loss, got) = results["addmm"], results["op"]
    torch.testing.assert_close(got_loss, loss, rtol=1e-3, atol=0)
    assert grads and all(g.abs().sum() > 0 for g in grads.values())
    for n in grads:
        rel = ((got[n] - grads[n]).norm() / grads[n].norm()).item()
        assert rel < 0.1, (n, rel)  # NaN fails too


def test_dense_operands_take_the_row_kernel_where_the_layers_replay_as_cuda_graphs(monkeypatch):
    """DENSE_QUANT "auto": the one-pass row kernel where apply_compile makes the layers CUDA graphs (its launches are
    replayed), Inductor's fused quantisations where the host launches every kernel; an explicit choice wins."""
    from moetune.model.build import build_model
    from moetune.model.config import BUILTIN, ModelConfig
    from moetune.model.quant import matmul
    from moetune.parallel.apply import apply_compile

    monkeypatch.setattr(matmul, "REPLAYED_AS_CUDA_GRAPHS", False)
    model = build_model(ModelConfig.from_hf_dict(BUILTIN["tiny"]), "meta")
    assert matmul.dense_quant_mode() == "inductor"
    apply_compile(model, mode="reduce-overhead")  # lazy: nothing compiles until a layer runs
    assert matmul.dense_quant_mode() == "kernel"
    monkeypatch.setattr(matmul, "DENSE_QUANT", "inductor")
    assert matmul.dense_quant_mode() == "inductor"
    monkeypatch.setattr(matmul, "DENSE_QUANT", "auto")
    apply_compile(model)
    assert matmul.dense_quant_mode() == "inductor"


@pytest.mark.parametrize("targets", [["q_proj", "o_proj"], ["q_proj", "experts"]])
def test_compiled_layers_with_the_swiglu_backward_kernel_give_the_traced_backwards_gradients(monkeypatch, targets):
    """A bf16 base's layers compiled as one graph each, the routed experts' SwiGLU backward as the row kernel's opaque
    op (experts.SWIGLU_BACKWARD "kernel"; forced on the CPU, Triton's interpreter) against Inductor's traced backward
    ("inductor"): the op runs once per MoE layer, the loss is the same forward, and the LoRA gradients agree to bf16's
    rounding (the kernel computes in fp32 and rounds once: within 0.9% of each gradient's largest value measured; the
    routing weights' gradient dropped fails every case) — with and without LoRA on the experts. (CPU torch cannot
    compile fp32 stacks' grouped GEMMs; tests/unit/test_fast_paths.py checks the op in fp32.)"""
    from moetune.model import experts
    from moetune.model import grouped_gemm_tiles as tiles

    monkeypatch.setattr(tiles, "KERNEL_ON_CPU", True)
    calls = []
    real = experts.weighted_swiglu_bwd
    monkeypatch.setattr(experts, "weighted_swiglu_bwd",
                        lambda *a, **kw: calls.append(kw.get("use_kernel")) or real(*a, **kw))
    ids = torch.randint(0, 160, (1, 16), generator=torch.Generator().manual_seed(0))

    def run(mode):
        monkeypatch.setattr(experts, "SWIGLU_BACKWARD", mode)
        calls.clear()
        model = _tiny(None, targets, torch.bfloat16, layers=2, nonzero_lora=True)
        torch._dynamo.reset()
        for layer in model.model.layers:
            layer.compile(fullgraph=True, backend="aot_eager", dynamic=False)
        loss = model(ids, labels=torch.roll(ids, -1, 1))
        loss.backward()
        return loss.detach(), {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}

    loss, grads = run("inductor")
    assert not calls
    got_loss, got = run("kernel")
    assert calls == [True]  # once (the tiny model's layer 0 is dense), at run time: the opaque op
    assert torch.equal(got_loss, loss)
    assert got.keys() == grads.keys() and any("experts" in n for n in got) == ("experts" in targets)
    for n in grads:
        scale = grads[n].abs().max()
        assert scale > 0, n
        torch.testing.assert_close(got[n], grads[n], rtol=0, atol=0.015 * scale.item(), msg=n)


@pytest.mark.parametrize("compiled", [False, True])
def test_expert_lora_in_the_grouped_gemms_epilogue_gives_the_lora_branchs_gradients(monkeypatch, compiled):
    """LoRA on a bf16 base's routed experts added in the TMA kernel's epilogue (experts.LORA_IN_EPILOGUE; forced on the
    CPU, Triton's interpreter) against the branch written out and added (ExpertLoRA.delta): the op runs for gate_up and
    down in every MoE layer, forward and input gradient, and the loss and every LoRA gradient agree to bf16's rounding
    (the epilogue sums base and branch in fp32 and rounds once). Eager, and each layer compiled as one graph."""
    from moetune.model import experts
    from moetune.model import grouped_gemm_tiles as tiles
    from moetune.model import grouped_gemm_tma as tma

    monkeypatch.setattr(tiles, "KERNEL_ON_CPU", True)
    launches = []
    real = tma.grouped_gemm_tma
    monkeypatch.setattr(tma, "grouped_gemm_tma", lambda *a, **kw: launches.append(kw.get("lora") is not None)
                        or real(*a, **kw))
    ids = torch.randint(0, 160, (1, 16), generator=torch.Generator().manual_seed(0))

    def run(epilogue):
        monkeypatch.setattr(experts, "LORA_IN_EPILOGUE", epilogue)
        launches.clear()
        loss, grads = _tiny_step(_tiny(None, ["q_proj", "experts"], torch.bfloat16, layers=2, nonzero_lora=True,
                                       rank=16), ids, compiled)
        return loss.float(), {n: g.float() for n, g in grads.items()}

    loss, grads = run(False)
    assert True not in launches
    got_loss, got = run(True)
    assert launches.count(True) == 4  # one MoE layer (the tiny model's layer 0 is dense): gate_up, down, both ways
    torch.testing.assert_close(got_loss, loss, rtol=5e-3, atol=0)
    assert got.keys() == grads.keys() and any("experts" in n for n in got)
    for n in grads:
        scale = grads[n].abs().max()
        assert scale > 0, n
        torch.testing.assert_close(got[n], grads[n], rtol=0, atol=0.02 * scale.item(), msg=n)
