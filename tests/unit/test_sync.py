"""moetune.sync on one process: the sender and its receivers as threads joined by a gloo sync group over TCP.

fp8 block quantization against a blockwise reference; bf16 syncs bit-exact (LoRA merged as export/merged.py
merges it); fp8 syncs equal to the reference quantization and within its error bound; the wire's names are the
HF checkpoint's; adapter-only syncs; the sender's allocations under the plan's bound. The 3-process FSDP test
is tests/distributed/test_sync_fsdp.py."""

import threading

import pytest
import torch
from safetensors import safe_open

import moetune
from helpers import hf_model, randomize_lora, save_hf
from moetune.model.config import TINY, ModelConfig
from moetune.model.hf_io import build_model, cast_model, init_weights
from moetune.model.lora import apply_lora
from moetune.sync import WeightSender, connect, receive, receive_into
from moetune.sync.fp8 import FP8, FP8_MAX, dequantize, error_bound, quantize
from moetune.sync.group import SyncRefused, SyncTimeout, host_store, parse_address
from moetune.sync.vllm import load_weights_consumer
from moetune.sync.wire import layout_bucket

TARGETS = ["q_proj", "v_proj", "o_proj", "shared_experts", "experts"]


# ------------------------------------------------------------------------------------------------ helpers
def tiny_model(lora=True, dtype=torch.bfloat16, seed=0, **cfg):
    m = build_model(ModelConfig.from_hf_dict({**TINY, "num_hidden_layers": 3, **cfg}), "cpu")
    init_weights(m, seed=seed)
    cast_model(m, dtype)
    if lora:
        apply_lora(m, TARGETS, 4, 8.0)
        randomize_lora(m, seed + 1)
    return m


def run_sync(sender_model, receivers, **sender_kw):
    """Sync once from sender_model to len(receivers) receiver threads; receivers[i](group) receives and returns
    a result. Returns (sender stats, [results])."""
    store = host_store("127.0.0.1:0", len(receivers) + 1, 60)  # a port the OS picks: race-free
    addr = f"tcp://127.0.0.1:{store.port}"
    results, errors = [None] * len(receivers), []

    def run(i, fn):
        try:
            results[i] = fn(connect(addr, i + 1, len(receivers) + 1, "cpu", timeout_s=60))
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in enumerate(receivers)]
    for t in threads:
        t.start()
    stats = WeightSender(sender_model, connect(addr, 0, len(receivers) + 1, "cpu", timeout_s=60, store=store),
                         **sender_kw).sync()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return stats, results


def merged_reference(model) -> dict:
    """Every base tensor as the receiver should hold it: LoRA merged in fp32 as export/merged.py does, in bf16
    (e_score_correction_bias stays fp32), computed whole, without buckets, units or chunks."""
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    out = {}
    for name, W in params.items():
        if ".lora" in name:
            continue
        module = model.get_submodule(name.rsplit(".", 1)[0])
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            which = "gate_up" if name.endswith("gate_up_proj") else "down"
            lora = module.lora
            if lora is not None:
                A, B = getattr(lora, f"{which}_A"), getattr(lora, f"{which}_B")
                W = torch.stack([W[e].float() + (B[e].float() @ A[e].float()) * lora.scaling for e in range(W.shape[0])])
        elif hasattr(module, "lora_A") and name.endswith(".weight"):
            W = W.float() + (module.lora_B.float() @ module.lora_A.float()) * module.scaling
        out[name] = W.detach().to(torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16)
    return out


class NameRecorder:
    """Stands in for a vLLM model: load_weights gets (name, tensor) pairs."""

    def __init__(self):
        self.seen = {}

    def load_weights(self, weights):
        for name, t in weights:
            assert name not in self.seen, name
            self.seen[name] = (t.dtype, tuple(t.shape), t.clone())


# ------------------------------------------------------------------------------------------------ fp8
def blockwise_reference(w, block=128):
    """Quantization written the slow, obvious way: one block at a time."""
    R, C = w.shape
    q = torch.empty(R, C, dtype=FP8)
    s = torch.empty(-(-R // block), -(-C // block))
    for i in range(0, R, block):
        for j in range(0, C, block):
            blk = w[i:i + block, j:j + block].float()
            scale = max(blk.abs().max().item() / FP8_MAX, torch.finfo(torch.float32).tiny)
            s[i // block, j // block] = scale
            q[i:i + block, j:j + block] = (blk / torch.tensor(scale, dtype=torch.float32)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, s


@pytest.mark.parametrize("shape", [(300, 200), (128, 256), (5, 7), (2, 130, 129)])
def test_fp8_matches_blockwise_reference_and_bound(shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[-1])  # columns of very different scales
    w[..., :3, :3] = 0.0  # an (almost) all-zero block
    w[..., -1, -1] = 50.0  # an outlier
    w[..., 1, 1:5] = torch.tensor([1e-6, -1e-7, 3e-9, 0.0])  # subnormal territory of a block with larger values
    q, s = quantize(w)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape[-2:] == (-(-shape[-2] // 128), -(-shape[-1] // 128))
    for i in range(w.shape[0] if w.dim() == 3 else 1):
        wi, qi, si = (w[i], q[i], s[i]) if w.dim() == 3 else (w, q, s)
        q_ref, s_ref = blockwise_reference(wi)
        assert torch.equal(si, s_ref)
        assert torch.equal(qi.view(torch.uint8), q_ref.view(torch.uint8))
    err = (dequantize(q, s) - w).abs()
    assert (err <= error_bound(w, s)).all()
    assert dequantize(q, s)[w == 0].eq(0).all()


# ------------------------------------------------------------------------------------------------ wire
def test_layout_is_aligned_and_disjoint():
    meta = layout_bucket(3, [("a", "bfloat16", (3, 5)), ("b", "float32", (7,))],
                         {"prefix": "model.layers.3.mlp.experts", "first": 4, "count": 3, "I": 96, "H": 160,
                          "dtype": "float8_e4m3fn"})
    offsets = [t[3] for t in meta["tensors"]] + [meta["experts"][k] for k in ("w13", "w2", "w13_scale", "w2_scale")]
    assert all(o % 64 == 0 for o in offsets) and offsets == sorted(offsets)
    assert meta["experts"]["w2_scale"] + 3 * 2 * 1 * 4 <= meta["nbytes"]  # w2_scale [3, ⌈160/128⌉, ⌈96/128⌉]
    assert parse_address("tcp://10.0.0.1:29600") == ("10.0.0.1", 29600) == parse_address("10.0.0.1:29600")
    with pytest.raises(ValueError, match="tcp://host:port"):
        parse_address("10.0.0.1")


# ------------------------------------------------------------------------------------------------ syncs
def test_bf16_merged_sync_is_bitwise_in_many_buckets():
    src = tiny_model(lora=True)
    dst = tiny_model(lora=False, seed=7)
    stats, (got,) = run_sync(src, [lambda g: receive_into(g, dst)], format="bf16", bucket_bytes=48 << 10,
                             max_experts_per_unit=3)  # 8 experts in units of 3, 3, 2; buckets of ≤ 48 KiB
    assert stats["buckets"] > 8 and got["buckets"] == stats["buckets"] and got["bytes"] == stats["bytes"]
    want = merged_reference(src)
    assert set(got["updated"]) == set(want)  # everything, and nothing of LoRA
    state = {**dict(dst.named_parameters()), **dict(dst.named_buffers())}
    for name, w in want.items():
        assert state[name].dtype == w.dtype and torch.equal(state[name], w), name
    assert stats["peak_alloc"] <= stats["bound"]


def test_fp8_sync_into_transformers_model(tmp_path):
    """Full fine-tuning (fp32 weights, no LoRA) into transformers' Glm4MoeForCausalLM: experts hold exactly the
    reference quantization's dequantized values (within the documented bound of the trainer's), the rest bf16."""
    hf_src = hf_model(seed=1, hidden_size=160, moe_intermediate_size=136, head_dim=40)  # blocks of 128 and tails
    src = moetune.load_model(save_hf(hf_src, tmp_path / "ckpt"), dtype="float32")
    dst = hf_model(seed=2, hidden_size=160, moe_intermediate_size=136, head_dim=40)
    stats, (got,) = run_sync(src, [lambda g: receive_into(g, dst)], format="fp8")
    assert got["format"] == "fp8" and stats["peak_alloc"] <= stats["bound"]
    mine = {**dict(src.named_parameters()), **dict(src.named_buffers())}
    theirs = {**dict(dst.named_parameters()), **dict(dst.named_buffers())}
    I = 136
    for name, w in mine.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            halves = [slice(0, I), slice(I, 2 * I)] if name.endswith("gate_up_proj") else [slice(None)]
            for rows in halves:
                q, s = quantize(w[:, rows])
                want = dequantize(q, s)
                assert torch.equal(theirs[name][:, rows].detach(), want), name
                assert ((want - w[:, rows]).abs() <= error_bound(w[:, rows], s)).all()
        elif name.endswith("e_score_correction_bias"):
            assert torch.equal(theirs[name], w)
        else:
            assert torch.equal(theirs[name].detach(), w.detach().to(torch.bfloat16).float()), name


def test_bf16_sync_into_transformers_model_equals_its_bf16_weights(tmp_path):
    hf_src = hf_model(seed=1)
    src = moetune.load_model(save_hf(hf_src, tmp_path / "ckpt"), dtype="float32")
    dst = hf_model(seed=2)
    run_sync(src, [lambda g: receive_into(g, dst)], format="bf16")
    with torch.no_grad():
        for name, p in hf_src.named_parameters():
            if not name.endswith("e_score_correction_bias"):
                p.copy_(p.to(torch.bfloat16).float())
    ids = torch.randint(0, 96, (2, 16))
    want, got = hf_src(input_ids=ids).logits, dst(input_ids=ids).logits
    assert torch.equal(got, want)


def test_wire_names_are_the_hf_checkpoints(tmp_path):
    """What a load_weights consumer (the vLLM extension) receives: the tensors of the checkpoint transformers
    writes, experts one by one, under the same names; here to two receivers at once."""
    hf_src = hf_model(seed=1)
    path = save_hf(hf_src, tmp_path / "ckpt")
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        ckpt = {k: f.get_tensor(k) for k in f.keys()}
    src = moetune.load_model(path, dtype="bfloat16")
    bf16, fp8, twin = NameRecorder(), NameRecorder(), moetune.load_model(path, dtype="bfloat16")
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    run_sync(src, [lambda g: receive(g, load_weights_consumer(bf16)), lambda g: receive_into(g, twin)], format="bf16")
    assert set(bf16.seen) == set(ckpt)
    for k, t in ckpt.items():
        dtype, shape, value = bf16.seen[k]
        assert shape == tuple(t.shape) and torch.equal(value, t.to(dtype)), k
    for (name, a), b in zip(src.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), name
    run_sync(src, [lambda g: receive(g, load_weights_consumer(fp8))], format="fp8")
    expert = "model.layers.1.mlp.experts.3.up_proj"
    assert fp8.seen[f"{expert}.weight"][:2] == (FP8, (32, 64))
    assert fp8.seen[f"{expert}.weight_scale_inv"][:2] == (torch.float32, (1, 1))
    scales = {k for k in fp8.seen if k.endswith("weight_scale_inv")}
    assert len(scales) == 2 * 8 * 3 and set(fp8.seen) - scales == set(ckpt)


def test_adapter_sync_sends_only_lora():
    src = tiny_model(lora=True)
    dst = tiny_model(lora=True, seed=5)
    base_before = {k: v.clone() for k, v in dst.state_dict().items() if ".lora" not in k}
    stats, (got,) = run_sync(src, [lambda g: receive_into(g, dst)], lora="adapter")
    assert got["format"] == "adapter"
    lora = {k: v for k, v in src.named_parameters() if ".lora" in k}
    assert set(got["updated"]) == set(lora)
    state = dst.state_dict()
    for k, v in lora.items():
        assert state[k].dtype == torch.float32 and torch.equal(state[k], v), k
    for k, v in base_before.items():
        assert torch.equal(state[k], v), k
    with pytest.raises(ValueError, match="adapter sync"):
        load_weights_consumer(NameRecorder())(type("B", (), {"format": "adapter"})())


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_sender_allocations_stay_under_the_bound(fmt):
    """Many experts (units of several experts, staged in fp32 for the merge and quantization): the tracked peak of
    the sender's buffers stays under 1.25 × the largest layer's wire bytes + one expert's bf16 bytes, and is
    mostly the two ring buffers the plan sized (which shows the tracking sees them)."""
    src = tiny_model(lora=True, n_routed_experts=64, num_experts_per_tok=4, moe_intermediate_size=64, vocab_size=512)
    dst = tiny_model(lora=False, n_routed_experts=64, num_experts_per_tok=4, moe_intermediate_size=64, vocab_size=512)
    stats, _ = run_sync(src, [lambda g: receive_into(g, dst)], format=fmt)
    assert stats["experts_per_unit"] > 1
    assert stats["peak_alloc"] <= stats["bound"]
    assert stats["peak_alloc"] >= 2 * min(stats["bucket"], stats["largest_group"] // 2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="format"):
        WeightSender(tiny_model(lora=False), None, format="int4", train_group=None, root=1).sync()
    with pytest.raises(ValueError, match="no LoRA"):
        WeightSender(tiny_model(lora=False), None, lora="adapter", train_group=None, root=1).sync()
    with pytest.raises(ValueError, match="sync group"):
        WeightSender(tiny_model(lora=False), None)


def test_fused_kernels_match_the_torch_path():
    """kernels.py (the sender's CUDA path for experts) against the torch path: on a GPU, or on the CPU under
    TRITON_INTERPRET=1 (whose bf16/fp8 casts truncate, so there only the fp32 output and the scales are compared)."""
    import os

    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU (set TRITON_INTERPRET=1 to run the kernels on the CPU)")
    from moetune.sync.kernels import merge_experts_

    g = torch.Generator().manual_seed(0)
    n, I, H, r, s = 3, 136, 260, 4, 0.5  # blocks of 128 and tails
    W = torch.randn(n, 2 * I, H, generator=g).to(device, torch.bfloat16)
    A, B = torch.randn(n, r, H, generator=g).to(device), torch.randn(n, 2 * I, r, generator=g).to(device)
    ref = torch.matmul(B, A).mul_(s).add_(W)  # the torch path's merge
    out32 = torch.empty(n, 2 * I, H, device=device)
    merge_experts_(W, out32, A, B, s)
    torch.testing.assert_close(out32, ref, rtol=1e-5, atol=1e-5)
    q = torch.empty(n, I, H, dtype=FP8, device=device)
    scale = torch.empty(n, 2, 3, device=device)
    merge_experts_(W[:, I:], q, A, B[:, I:], s, scale=scale)  # the up half: strided views, as the sender passes
    q_ref, s_ref = quantize(ref[:, I:])
    torch.testing.assert_close(scale, s_ref, rtol=1e-6, atol=0)
    if device == "cuda":
        out = torch.empty(n, 2 * I, H, dtype=torch.bfloat16, device=device)
        merge_experts_(W, out, A, B, s)
        assert (out != ref.to(torch.bfloat16)).float().mean() < 1e-3  # an fp32 rounding apart, at most
        assert ((dequantize(q, scale) - ref[:, I:]).abs() <= error_bound(ref[:, I:], scale)).all()
        assert (q.view(torch.uint8) != q_ref.view(torch.uint8)).float().mean() < 1e-3


# ------------------------------------------------------------------------------------------------ bad input
def _sync_with(receivers, sender_model, deadline_s=60.0, **sender_kw):
    """Like run_sync, but returns (the sender's exception or stats, [each receiver's exception or result]); a
    receiver is fn(group) and is named "engine-R"."""
    store = host_store("127.0.0.1:0", len(receivers) + 1, 60)
    addr = f"tcp://127.0.0.1:{store.port}"
    out = [None] * len(receivers)
    kw = dict(timeout_s=60, deadline_s=deadline_s, min_bytes_per_s=1e9)

    def run(i, fn):
        try:
            out[i] = fn(connect(addr, i + 1, len(receivers) + 1, "cpu", name=f"engine-{i + 1}", **kw))
        except BaseException as e:  # noqa: BLE001 - returned to the test
            out[i] = e

    threads = [threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in enumerate(receivers)]
    for t in threads:
        t.start()
    try:
        sent = WeightSender(sender_model, connect(addr, 0, len(receivers) + 1, "cpu", store=store, **kw),
                            **sender_kw).sync()
    except BaseException as e:  # noqa: BLE001 - returned to the test
        sent = e
    for t in threads:
        t.join(5)
    return sent, out


def test_a_receiver_whose_model_differs_refuses_before_any_weight_moves():
    """Shapes (one more expert row) or names (a layer the sender lacks) that differ: every member learns it from
    the header, the trainer's error names the receiver and the tensor, and no receiver's weights change."""
    src = tiny_model()
    same, other, deeper = (tiny_model(lora=False, seed=9, **kw) for kw in ({}, {"moe_intermediate_size": 48},
                                                                           {"num_hidden_layers": 2}))
    before = {id(m): {k: v.clone() for k, v in m.state_dict().items()} for m in (same, other, deeper)}
    consumed = []

    def counting(model):
        updater = moetune.sync.ModelUpdater(model)

        class Consumer:
            check = staticmethod(updater.check)

            def __call__(self, bucket):
                consumed.append(bucket)
                updater(bucket)
        return lambda g: receive(g, Consumer())

    sent, (a, b, c) = _sync_with([counting(same), counting(other), counting(deeper)], src, format="bf16")
    assert isinstance(sent, SyncRefused), sent
    assert "engine-2 (sync rank 2" in str(sent) and "model.layers.1.mlp.shared_experts.gate_proj.weight [96, 128]: this model's is [48, 128]" in str(sent)
    assert "engine-3 (sync rank 3" in str(sent) and "model.layers.2" in str(sent) and "engine-1" not in str(sent)
    assert isinstance(a, SyncRefused) and "called off by the trainer" in str(a)
    assert isinstance(b, SyncRefused) and "refused by this receiver (engine-2" in str(b)
    assert consumed == []
    for m in (same, other, deeper):
        assert all(torch.equal(v, before[id(m)][k]) for k, v in m.state_dict().items())


@pytest.mark.parametrize("when", ["never calls in", "stops mid-sync"])
def test_a_receiver_that_stops_answering_is_named_not_waited_for(when):
    """Issue 22: a gone receiver blocked the trainer for the group's 30 minutes. Now every wait ends at the
    deadline (here 1 s + the bytes at 1 GB/s) with the receiver's name."""
    src, dst = tiny_model(), tiny_model(lora=False, seed=3)
    stuck = threading.Event()

    def gone(group):
        if when == "never calls in":
            stuck.wait(30)
            return None
        updater = moetune.sync.ModelUpdater(dst)
        return receive(group, lambda bucket: (updater(bucket), stuck.wait(30)))  # hangs in its first bucket

    try:
        sent, (result,) = _sync_with([gone], src, deadline_s=1.0, format="bf16", bucket_bytes=48 << 10)
    finally:
        stuck.set()
    assert isinstance(sent, SyncTimeout), sent
    msg = str(sent)
    assert "engine-1 (sync rank 1, host " in msg and "did not answer within" in msg, msg
    if when == "never calls in":
        assert "header" in msg, msg
    else:
        assert "bucket" in msg or "confirming it received the whole sync" in msg, msg
