"""Weight sync from a trainer whose frozen base is stored in fp8 (model/quant): the wire carries the weights the model
computes with — each fp8 weight dequantised with its scales (row-wise or block), LoRA merged — never the raw fp8
values or the scales, within the sender's memory bound."""

import copy

import pytest
import torch

from test_sync import TARGETS, TINY, merged_reference, receive_into, run_sync, tiny_model  # noqa: F401
from helpers import randomize_lora
from moetune.model.build import build_model
from moetune.model.config import ModelConfig
from moetune.model.hf_io import cast_model, init_weights
from moetune.model.lora import apply_lora
from moetune.model.quant.fp8 import Fp8Scheme
from moetune.model.quant.modules import dequantize_model, fp8_weights, quantize_model


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
