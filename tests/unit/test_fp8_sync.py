"""Weight sync from a trainer whose frozen base is stored in fp8 (model/quant). Format bf16: the wire carries the
weights the model computes with — each fp8 weight dequantised with its scales (row-wise or block), LoRA merged —
never the raw fp8 values or the scales. Format fp8_rows (an engine serving the compressed-tensors release) and, from
a block-scaled base, fp8 (an engine serving a block-FP8 release, GLM-5's): the fp8 weights requantised after the
merge with new scales, per row or per 128×128 block, as `export merged --dtype fp8` writes them. Always within the
sender's memory bound."""

import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import moetune
import moetune.sync.sender as sender_module
from helpers import hf_model, random_adapter, randomize_lora, save_hf
from moetune.export.merged import export_merged
from moetune.model.build import build_model
from moetune.model.config import ModelConfig
from moetune.model.hf_io import cast_model, init_weights
from moetune.model.lora import apply_lora
from moetune.model.quant.checkpoint import fp8_config
from moetune.model.quant.fp8 import ROWWISE, Fp8Scheme, dequantize_
from moetune.model.quant.modules import dequantize_model, fp8_weights, quantize_model
from moetune.sync import receive
from moetune.sync.fp8 import FP8, dequantize
from moetune.sync.plan import build_plan, plan_tensors
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
def _hub_fp8_base(tmp_path, experts_fp8: bool, scheme=ROWWISE, **dims) -> str:
    """A checkpoint in an FP8 release's layout: every decoder-layer projection fp8 (the routed experts too, or
    ignored and bf16), the rest bf16 (the correction bias fp32). Row-wise: the compressed-tensors releases' (GLM-4.5,
    4.7), a `weight_scale` per row; blocks: DeepSeek-style quant_method fp8 (GLM-5's), `weight_scale_inv`."""
    plain = save_hf(hf_model(seed=3, **dims), tmp_path / "plain")
    tensors = {}
    for k, v in load_file(os.path.join(plain, "model.safetensors")).items():
        if k.startswith("model.layers.") and k.endswith("_proj.weight") and (experts_fp8 or ".mlp.experts." not in k):
            tensors[k], tensors[k[: -len("weight")] + scheme.scale_suffix] = scheme.quantize(v)
        else:
            tensors[k] = v.contiguous() if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)
    qc = fp8_config(scheme)
    if not experts_fp8:
        qc["ignore"] = [*qc["ignore"], "re:.*mlp\\.experts\\..*"]
    os.makedirs(tmp_path / "base")
    save_file(tensors, str(tmp_path / "base" / "model.safetensors"))
    cfg = json.load(open(os.path.join(plain, "config.json")))
    json.dump(dict(cfg, dtype="bfloat16", quantization_config=qc), open(tmp_path / "base" / "config.json", "w"))
    return str(tmp_path / "base")


def _assert_handed_over(got, want):
    """What load_weights got is, name for name and bit for bit, the export's tensors."""
    assert set(got.seen) == set(want)
    for name, w in want.items():
        dtype, shape, value = got.seen[name]
        assert (dtype, shape) == (w.dtype, tuple(w.shape)), name
        bits = (lambda t: t.view(torch.uint8)) if w.dtype == FP8 else (lambda t: t)
        assert torch.equal(bits(value), bits(w)), name


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
    _assert_handed_over(got, want)
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


# ------------------------------------------------------------------------------------------------ format fp8, blocks
def test_a_block_fp8_sync_carries_what_export_merged_fp8_writes(tmp_path, monkeypatch):
    """Format fp8 from a trainer on a block-FP8 release (GLM-5's layout, 128×128 blocks): what vLLM's load_weights
    gets is, name for name and bit for bit, what `export merged --dtype fp8` writes — every weight the base stores in
    fp8, attention and dense MLP included, merged and requantised per block with a new `weight_scale_inv`, the rest
    bf16 — with widths over a block (grids of several blocks, short last ones: the dense MLP's 272 rows) and plain
    weights staged 128 rows at a time, within the bound. A moetune model receiving it gets those weights dequantised."""
    base = _hub_fp8_base(tmp_path, True, Fp8Scheme((128, 128)), intermediate_size=272, moe_intermediate_size=136)
    random_adapter(base, tmp_path / "adapter", ["q_proj", "k_proj", "v_proj", "o_proj", "dense_mlp", "shared_experts",
                                                 "experts"], scale=0.05)
    export_merged(base, str(tmp_path / "adapter"), str(tmp_path / "merged"), dtype="fp8")
    want = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert want["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (3, 1)  # 272 rows: 2 blocks + a short one

    trainer = moetune.load_model(base, dtype="float32", adapter=str(tmp_path / "adapter"))
    got, twin = NameRecorder(), dequantize_model(moetune.load_model(base, dtype="float32"))
    chunks = []
    real = sender_module.staging_rows
    monkeypatch.setattr(sender_module, "staging_rows", lambda *a, **k: chunks.append(1) or min(50, real(*a, **k)))
    stats, _ = run_sync(trainer, [lambda g: receive(g, load_weights_consumer(got)), lambda g: receive_into(g, twin)],
                        format="fp8", bucket_bytes=24 << 10, max_experts_per_unit=3)
    assert chunks and stats["buckets"] > 6 and stats["peak_alloc"] <= stats["bound"]
    _assert_handed_over(got, want)
    # the moetune receiver: fp8 weights dequantised with their block scales
    for name, module in (("model.layers.0.mlp.gate_proj", twin.model.layers[0].mlp.gate_proj),
                         ("model.layers.1.self_attn.q_proj", twin.model.layers[1].self_attn.q_proj)):
        deq = dequantize(want[f"{name}.weight"], want[f"{name}.weight_scale_inv"])
        assert torch.equal(module.weight, deq), name
    gate = want["model.layers.1.mlp.experts.2.gate_proj.weight"]
    deq = dequantize(gate, want["model.layers.1.mlp.experts.2.gate_proj.weight_scale_inv"])
    assert torch.equal(twin.model.layers[1].mlp.experts.gate_up_proj[2, : gate.shape[0]], deq)


def test_format_fp8_sends_a_row_wise_base_dequantised_besides_its_block_experts():
    """Format fp8 requantises into blocks only what a block-scaled base stores in fp8: a row-wise base's attention
    goes bf16 (its own format is fp8_rows), routed experts go in blocks whatever the base."""
    for scheme, attention in ((ROWWISE, "bfloat16"), (Fp8Scheme((16, 32)), "float8_e4m3fn")):
        model = fp8_model(scheme)
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        header = build_plan(model, plan_tensors(model, tensors), "fp8", "merge").header
        plain = {n: d for b in header["buckets"] for n, d, _, _ in b["tensors"]}
        assert plain["model.layers.1.self_attn.q_proj.weight"] == attention
        assert ("model.layers.1.self_attn.q_proj.weight_scale_inv" in plain) == (attention != "bfloat16")
        assert all(b["experts"]["scales"] == "block" for b in header["buckets"] if b["experts"])


# ------------------------------------------------------------------------------------------------ staging memory
def test_in_place_dequantisation_equals_the_schemes_bit_for_bit():
    """fp8.dequantize_ (the sync's staging) against Fp8Scheme.dequantize: rows, blocks with short last blocks, rows
    gathered from inside a block row, and a gate_up stack whose two parts are blocked apart."""
    torch.manual_seed(0)
    for scheme in (ROWWISE, Fp8Scheme((16, 32))):
        q, s = scheme.quantize(torch.randn(3, 2 * 40, 72), parts=2)
        assert torch.equal(dequantize_(q.float(), s, scheme), scheme.dequantize(q, s))
        q, s = scheme.quantize(torch.randn(70, 72))
        whole = scheme.dequantize(q, s)
        b0 = scheme.block[0] if scheme.block else 1
        for lo, hi in ((0, 70), (5, 37), (16, 33), (33, 70)):
            got = dequantize_(q[lo:hi].float(), s[lo // b0: -(-hi // b0)], scheme, lo - lo // b0 * b0)
            assert torch.equal(got, whole[lo:hi]), (scheme, lo, hi)


def test_gathered_fp8_rows_are_dequantised_in_their_one_counted_buffer():
    """The sender's bound counts one fp32 buffer for an fp8 weight's gathered rows: dequantising them allocates
    nothing else of their size (every tensor an op creates is recorded)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from moetune.sync.alloc import Allocations
    from moetune.sync.shards import ShardMap

    class Created(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            self.sizes += [t.untyped_storage().nbytes() for t in tree_leaves(out)
                           if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given]
            return out

    for scheme in (ROWWISE, Fp8Scheme((16, 32))):
        q, s = scheme.quantize(torch.randn(70, 72))
        mem = Allocations()
        shards = ShardMap({"w": q, "w_scale": s}, device="cpu", mem=mem, fp8={"w": ("w_scale", scheme)})
        with Created() as created:
            w = shards.gather("w", 5, 37)
        assert torch.equal(w, scheme.dequantize(q, s)[5:37])
        rows = 32 * 72 * 4
        assert max(created.sizes) == rows == mem.peak, created.sizes
        assert sum(n >= 32 * 72 for n in created.sizes) == 1, created.sizes  # nothing else the rows' size
