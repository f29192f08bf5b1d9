"""Every fast path against the plain computation it replaces (forward and gradients)."""

import collections
import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from moetune.model.flash_attention_4 import flash_attention_4_installed
from moetune.model.loss import linear_cross_entropy, linear_logprobs
from moetune.model.experts import grouped_linear, permute, unpermute


def _lm_head_inputs(seed):
    """h [37, 16] and W [50, 16] in fp64 (with twins for the plain computation), labels with every 5th ignored."""
    torch.manual_seed(seed)
    T, H, V = 37, 16, 50
    h = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (T,))
    labels[::5] = -100
    return h, w, labels, h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()


def test_fused_linear_cross_entropy_matches_plain():
    h, w, labels, h2, w2 = _lm_head_inputs(0)
    got = linear_cross_entropy(h, w, labels, chunk=8)
    want = F.cross_entropy(h2 @ w2.t(), labels, ignore_index=-100, reduction="sum")
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    (got * 0.7).backward()
    (want * 0.7).backward()
    # logits are fp32 by design, so fp64 inputs agree to fp32 precision
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-6)


def test_fused_linear_cross_entropy_frozen_weight_and_no_grad():
    h = torch.randn(9, 8, requires_grad=True)
    w = torch.randn(20, 8)
    labels = torch.randint(0, 20, (9,))
    linear_cross_entropy(h, w, labels, chunk=4).backward()
    assert h.grad is not None and w.grad is None
    with torch.no_grad():
        v = linear_cross_entropy(h, w, labels)
    torch.testing.assert_close(v, F.cross_entropy(h @ w.t(), labels, reduction="sum"))


def test_fused_linear_logprobs_match_plain():
    """Per-token log-probabilities without [T, V] logits (a custom loss's input): values and the gradients of h and
    W under an upstream gradient that differs per token (a policy-gradient weight); ignored labels give 0 and no
    gradient."""
    h, w, labels, h2, w2 = _lm_head_inputs(1)
    got = linear_logprobs(h, w, labels, chunk=8)
    picked = (h2 @ w2.t()).log_softmax(-1).gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    want = torch.where(labels != -100, picked, 0.0)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert got.dtype == torch.float32 and bool((got[::5] == 0).all())
    advantage = torch.randn(len(labels), dtype=torch.float64)
    (got.double() * advantage).sum().backward()
    (want * advantage).sum().backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-6)
    frozen = torch.randn(w.shape)
    hf = torch.randn(h.shape, requires_grad=True)
    linear_logprobs(hf, frozen, labels, chunk=8).sum().backward()
    assert hf.grad is not None and bool(torch.isfinite(hf.grad).all())


def test_grouped_experts_match_a_per_expert_loop():
    torch.manual_seed(1)
    T, k, E, H, I = 23, 2, 4, 8, 12
    x = torch.randn(T, H, dtype=torch.float32)
    w1 = torch.randn(E, 2 * I, H, dtype=torch.float32, requires_grad=True)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    weights = torch.rand(T, k, dtype=torch.float32)
    perm = permute(idx, E)
    rows = grouped_linear(x[perm.token_idx], w1, perm.offs) * weights.reshape(-1)[perm.order].unsqueeze(-1)
    y = unpermute(rows, perm, T)
    ref = torch.zeros(T, 2 * I, dtype=torch.float32)
    for t in range(T):
        for j in range(k):
            ref[t] += weights[t, j] * (w1[idx[t, j]] @ x[t])
    torch.testing.assert_close(y, ref)
    g = torch.randn_like(ref)
    gy, = torch.autograd.grad((y * g).sum(), w1)
    gr, = torch.autograd.grad((ref * g).sum(), w1)
    torch.testing.assert_close(gy, gr)


@pytest.mark.parametrize("compiled", [False, True])
def test_the_permutation_gathers_give_autograds_values_and_gradients(compiled):
    """permute_rows / unpermute, whose backwards are gathers (each token's k row gradients summed; each row reading its
    token's gradient) and whose compiled sums are k gathers added, give the values and gradients of x[token_idx] and
    of the [T, k, H] sum under autograd (its scatters into zeros) — the same sums in another order (fp64 here: equal
    to rounding) — eager (the torch reference of the bag-sum kernel) and compiled in one graph."""
    from moetune.model import experts

    torch.manual_seed(2)
    T, k, E, H = 19, 3, 5, 6
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    perm = permute(idx, E)
    x0, g = torch.randn(T, H, dtype=torch.float64), torch.randn(T, H, dtype=torch.float64)
    w = torch.randn(T * k, H, dtype=torch.float64)

    def ours(x):
        return experts.unpermute(experts.permute_rows(x, perm) * w, perm, T)

    def autograds(x):
        return (x[perm.token_idx] * w)[perm.inverse].view(T, k, H).sum(1)

    def run(f):
        x = x0.clone().requires_grad_()
        y = (torch.compile(f, backend="aot_eager", fullgraph=True) if compiled and f is ours else f)(x)
        y.backward(g)
        return y.detach(), x.grad

    (y0, gx0), (y1, gx1) = run(autograds), run(ours)
    torch.testing.assert_close(y1, y0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx1, gx0, rtol=1e-12, atol=1e-12)
    want = torch.stack([sum(g[t] * w[perm.inverse[t * k + j]] for j in range(k)) for t in range(T)])
    torch.testing.assert_close(gx1, want, rtol=1e-12, atol=1e-12)


def test_compiled_bag_sums_skip_empty_slots():
    """gather_sum compiled (k gathers added) over a map with empty slots (−1, as the expert-parallel exchange's maps
    have): the sums of bag_sum's torch reference, a bag with no items zeros."""
    from moetune.model.kernels import bag_sum_torch, gather_sum

    torch.manual_seed(4)
    rows = torch.randn(7, 5, dtype=torch.float64)
    slots = torch.tensor([[0, -1, 3], [-1, -1, -1], [6, 2, -1], [1, 4, 5]])
    got = torch.compile(lambda r: gather_sum(r, slots.reshape(-1), 4, empty_slots=True), backend="aot_eager",
                        fullgraph=True)(rows)
    torch.testing.assert_close(got, bag_sum_torch(rows, slots), rtol=1e-12, atol=1e-12)
    assert (got[1] == 0).all()


def test_flex_attention_document_mask_matches_dense_mask():
    """The packed-document kernel of the GPU (FlexAttention + block mask), compiled for the CPU here."""
    from moetune.model.attention import AttnMeta, attend, build_attn_meta, dense_document_mask

    torch.manual_seed(2)
    B, H, Hkv, S, D = 2, 4, 2, 128, 16
    q, k, v = torch.randn(B, H, S, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    pos = torch.stack([torch.cat([torch.arange(50), torch.arange(78)]),
                       torch.cat([torch.arange(10), torch.arange(100), torch.arange(18)])])
    got = attend(q, k, v, build_attn_meta(pos, "flex"))
    want = attend(q, k, v, AttnMeta(dense_mask=dense_document_mask(pos)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compiled_block_mask_is_the_eager_one(monkeypatch):
    """attention.COMPILED_BLOCK_MASK: the document mask's blocks by create_block_mask under torch.compile equal the
    eager ones for any documents, compiled once for a row length (the documents are data: no recompile per batch)."""
    import torch._dynamo.utils as dynamo_utils

    from moetune.model import attention
    from moetune.model.attention import build_attn_meta

    attention._compiled_create_block_mask.cache_clear()
    torch._dynamo.reset()
    frames = []
    for docs in ((128, 128, 128, 128), (100, 300, 112), (512,), (8,) * 64):
        pos = torch.cat([torch.arange(n) for n in docs])[None]
        monkeypatch.setattr(attention, "COMPILED_BLOCK_MASK", False)
        want = build_attn_meta(pos, "flex").block_mask
        monkeypatch.setattr(attention, "COMPILED_BLOCK_MASK", True)
        got = build_attn_meta(pos, "flex").block_mask
        frames.append(dynamo_utils.counters["stats"]["unique_graphs"])
        for name in attention.BLOCK_MASK_TENSORS:
            a, b = getattr(got, name, None), getattr(want, name, None)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (docs, name)
    assert frames[0] >= 1 and len(set(frames)) == 1, frames
    attention._compiled_create_block_mask.cache_clear()


def _reference_fa4_kernels(calls):
    """Stand-ins for FlashAttention-4's forward and backward entry points with their contract (flattened rows,
    cumulative document starts, lse [heads, T]): each document causal in fp32, the backward written out (a custom
    op's body runs below autograd)."""
    def documents(cu_seqlens):
        bounds = cu_seqlens.tolist()
        return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]

    def document(q, k, v, a, b):
        """One document's heads-first fp32 q, k and v (k, v repeated per query head), and its probabilities."""
        qd, kd, vd = (t[a:b].transpose(0, 1).float() for t in (q, k, v))
        kd, vd = (t.repeat_interleave(qd.shape[0] // t.shape[0], 0) for t in (kd, vd))
        scores = (qd @ kd.transpose(1, 2)) / qd.shape[-1] ** 0.5
        scores = scores.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool).tril(), float("-inf"))
        return qd, kd, vd, scores

    def attention(q, k, v, cu_seqlens):
        outs, lses = [], []
        for a, b in documents(cu_seqlens):
            _, _, vd, scores = document(q, k, v, a, b)
            outs.append((scores.softmax(-1) @ vd).transpose(0, 1))
            lses.append(scores.logsumexp(-1))
        return torch.cat(outs).to(q.dtype), torch.cat(lses, 1)

    def gradients(q, k, v, dout, cu_seqlens):
        dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v))
        group = q.shape[1] // k.shape[1]
        for a, b in documents(cu_seqlens):
            qd, kd, vd, scores = document(q, k, v, a, b)
            p, do = scores.softmax(-1), dout[a:b].transpose(0, 1).float()
            dp = do @ vd.transpose(1, 2)
            ds = p * (dp - (dp * p).sum(-1, keepdim=True)) / qd.shape[-1] ** 0.5
            dq[a:b] = (ds @ kd).transpose(0, 1)
            dk[a:b] = (ds.transpose(1, 2) @ qd).unflatten(0, (-1, group)).sum(1).transpose(0, 1)
            dv[a:b] = (p.transpose(1, 2) @ do).unflatten(0, (-1, group)).sum(1).transpose(0, 1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    def forward(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, return_lse):
        calls.append(("forward", cu_seqlens_q.tolist(), max_seqlen_q, causal, return_lse))
        assert cu_seqlens_k is cu_seqlens_q and max_seqlen_k == max_seqlen_q and cu_seqlens_q.dtype == torch.int32
        out, lse = attention(q, k, v, cu_seqlens_q)
        return out, lse, None, None, None

    def backward(q, k, v, out, dout, lse, *, causal, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        calls.append(("backward", cu_seqlens_q.tolist(), max_seqlen_q, causal, None))
        want_out, want_lse = attention(q, k, v, cu_seqlens_q)
        torch.testing.assert_close(out, want_out)  # the forward's own output and lse come back
        torch.testing.assert_close(lse, want_lse)
        return gradients(q, k, v, dout, cu_seqlens_q)

    return forward, backward


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() and flash_attention_4_installed()
                                              else []))
def test_varlen_fa4_runs_flashattention4_over_the_documents(device, monkeypatch):
    """model.attn_implementation varlen_fa4: packed rows, and rows of one document each, go to FlashAttention-4's
    variable-length kernels (through the moetune::fa4_varlen custom op, eager and inside a compiled region as the
    model's compiled layers call it) with the padded document starts; output and gradients equal the dense document
    mask's. On the CPU stand-ins with the kernels' contract record the calls, and the CPU's own meta for varlen_fa4 is
    the dense mask or SDPA's causal kernel; on a GPU with flash-attn-4, the kernels themselves in bf16. A GPU that
    cannot run them is a ConfigError."""
    from moetune.errors import ConfigError
    from moetune.model import flash_attention_4
    from moetune.model.attention import check_attn_implementation

    cuda, calls = device == "cuda", []
    if not cuda:
        monkeypatch.setattr(flash_attention_4, "fa4_kernels", lambda: _reference_fa4_kernels(calls))
    torch.manual_seed(2)
    B, H, Hkv, S, D = 2, 4, 2, 256, 64
    dtype = torch.bfloat16 if cuda else torch.float32
    packed = torch.stack([torch.cat([torch.arange(50), torch.arange(206)]),
                          torch.cat([torch.arange(10), torch.arange(200), torch.arange(46)])]).to(device)
    # rows of one document each go to FlashAttention-4 too (on the GPU; the CPU takes SDPA's causal kernel)
    for pos, starts in ((packed, [0, 50, 256, 266, 466, 512, 512, 512, 512]),
                        (torch.arange(S, device=device).expand(B, S), [0, 256, 512, 512, 512, 512, 512, 512, 512])):
        _check_varlen_fa4(pos, starts, cuda, calls, B, H, Hkv, S, D, dtype)
    check_attn_implementation("varlen_fa4", "cpu")  # nothing to check off a GPU
    check_attn_implementation("flex", "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ConfigError, match="varlen_fa4, but FlashAttention-4 runs on Hopper or newer GPUs"):
        check_attn_implementation("varlen_fa4", "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(flash_attention_4, "flash_attention_4_installed", lambda: False)
    with pytest.raises(ConfigError, match=r'varlen_fa4, but FlashAttention-4 is not installed \(pip install "moetune'):
        check_attn_implementation("varlen_fa4", "cuda")
    # a Hopper GPU with flash-attn-4 installed: its private entry points must take what the op passes
    monkeypatch.setattr(flash_attention_4, "flash_attention_4_installed", lambda: True)
    monkeypatch.setattr(flash_attention_4, "fa4_kernels", lambda: _reference_fa4_kernels([]))
    check_attn_implementation("varlen_fa4", "cuda")
    forward, backward = _reference_fa4_kernels([])

    def older_forward(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal):
        return forward(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                       max_seqlen_k=max_seqlen_k, causal=causal, return_lse=True)

    monkeypatch.setattr(flash_attention_4, "fa4_kernels", lambda: (older_forward, backward))
    with pytest.raises(ConfigError, match=r"entry points lack older_forward\(return_lse=\)"):
        check_attn_implementation("varlen_fa4", "cuda")


def _check_varlen_fa4(pos, starts, cuda, calls, B, H, Hkv, S, D, dtype):
    """varlen_fa4 on rows `pos`: the kernels get the padded document starts `starts`; output and gradients equal the
    dense document mask's, eager and compiled."""
    from moetune.model import attention
    from moetune.model.attention import AttnMeta, attend, build_attn_meta

    dense = AttnMeta(dense_mask=attention.dense_document_mask(pos))
    if cuda:
        meta = build_attn_meta(pos, "varlen_fa4")
    else:
        cpu_meta = build_attn_meta(pos, "varlen_fa4")  # the CPU's path: the dense mask, or SDPA's causal kernel
        assert cpu_meta.cu_seqlens is None and cpu_meta.block_mask is None
        with pytest.MonkeyPatch.context() as m:  # as on a GPU: the rows' meta for the kernels, whatever their documents
            m.setattr(attention, "varlen_kernels_run", lambda position_ids: True)
            meta = build_attn_meta(pos, "varlen_fa4")
            fa2 = build_attn_meta(pos, "varlen")  # FlashAttention-2's varlen leaves rows of one document to SDPA
        assert (fa2.cu_seqlens is None) == (not attention.is_packed(pos))
        assert fa2.dense_mask is None and fa2.block_mask is None
    assert meta.varlen_kernel == "fa4" and meta.max_len == S and meta.cu_seqlens.tolist() == starts
    tol = {"rtol": 2e-2, "atol": 2e-2} if cuda else {"rtol": 1e-4, "atol": 1e-5}
    for call in (attend, torch.compile(attend, dynamic=False, fullgraph=True)):
        calls.clear()
        q, k, v = (torch.randn(B, h, S, D, device=pos.device, dtype=dtype, requires_grad=True)
                   for h in (H, Hkv, Hkv))
        got = call(q, k, v, meta)
        grads = torch.autograd.grad(got.float().square().sum(), (q, k, v))
        q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
        want = attend(q2, k2, v2, dense)
        want_grads = torch.autograd.grad(want.float().square().sum(), (q2, k2, v2))
        for a, b in zip((got, *grads), (want, *want_grads)):
            torch.testing.assert_close(a, b, **tol)
        if not cuda:
            assert calls == [("forward", starts, S, True, True), ("backward", starts, S, True, None)]


def varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False):
    """torch.nn.attention.varlen.varlen_attn's contract (FlashAttention-2 varlen: [tokens, heads, D], one sequence per
    cu_seqlens interval, causal for window (-1, 0), GQA by head groups: where the installed torch's varlen_attn takes
    `enable_gqa`, only when told), one SDPA per sequence: the CPU's stand-in."""
    from moetune.model.attention import VARLEN_TAKES_GQA

    assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
    assert enable_gqa == (VARLEN_TAKES_GQA and q.shape[1] != k.shape[1]), (enable_gqa, q.shape, k.shape)
    bounds = cu_q.tolist()
    assert max(b - a for a, b in zip(bounds, bounds[1:])) <= max_q
    outs = [F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                                           is_causal=True, enable_gqa=True).transpose(0, 1)
            for a, b in zip(bounds, bounds[1:]) if b > a]  # empty sequences (padding) contribute nothing
    return torch.cat(outs)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_varlen_attention_over_packed_rows_matches_the_dense_document_mask(device, monkeypatch):
    """model.attn_implementation varlen: FlashAttention-2's variable-length kernel over the documents of the flattened
    rows, forward and gradients equal to the dense document-causal mask's; GQA; a row that starts inside a
    document starts a sequence of its own. On the CPU the kernel is its torch reference (the plumbing is what is
    tested: flattening, cu_seqlens, the layout back); on a GPU, the kernel itself in bf16."""
    from moetune.model.attention import (AttnMeta, attend, build_attn_meta, dense_document_mask, document_starts,
                                         padded_document_starts)

    torch.manual_seed(3)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cpu":
        import moetune.model.attention as attention

        monkeypatch.setattr(attention, "varlen_attn", varlen_reference)
    B, H, Hkv, S, D = 2, 4, 2, 128, 64
    pos = torch.stack([torch.cat([torch.arange(7, 57), torch.arange(78)]),  # the first document began a row before
                       torch.cat([torch.arange(10), torch.arange(100), torch.arange(18)])]).to(device)
    assert document_starts(pos).tolist() == [0, 50, 128, 138, 238, 256]
    # padded to 8 documents, the 3 empty ones at the end: one compiled shape for up to 8 documents
    assert padded_document_starts(pos).tolist() == [0, 50, 128, 138, 238, 256, 256, 256, 256]
    meta = (build_attn_meta(pos, "varlen") if device == "cuda"
            else AttnMeta(cu_seqlens=padded_document_starts(pos), max_len=S))
    assert meta.cu_seqlens is not None
    leaves = [torch.randn(B, h, S, D, device=device, dtype=dtype, requires_grad=True) for h in (H, Hkv, Hkv)]
    # the callers' layout: q, k, v made [B, S, heads, D] by the projections, transposed to [B, heads, S, D]
    q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in leaves)
    got = attend(q, k, v, meta)
    grads = torch.autograd.grad(got.float().square().sum(), (q, k, v))
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    want = attend(q2, k2, v2, AttnMeta(dense_mask=dense_document_mask(pos)))
    want_grads = torch.autograd.grad(want.float().square().sum(), (q2, k2, v2))
    tol = dict(rtol=2e-2, atol=2e-2) if device == "cuda" else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, want, **tol)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, **tol)


def test_expert_lora_any_rank_matches_per_expert_products():
    """grouped_mm needs 16-byte strides; odd ranks are padded inside, which must change nothing."""
    from moetune.model.lora import ExpertLoRA

    torch.manual_seed(3)
    for r in (1, 3, 8):
        for dt in (torch.float32, torch.bfloat16):
            lora = ExpertLoRA(4, 16, 8, r, 2.0 * r, 0.0, False)
            torch.nn.init.normal_(lora.gate_up_B)
            x = torch.randn(10, 16, dtype=dt)
            idx = torch.randint(0, 4, (10, 1))
            p = permute(idx, 4)
            xe, e = x[p.token_idx], idx.reshape(-1)[p.order]
            got = lora.delta(xe, lora.gate_up_A, lora.gate_up_B, p.offs)
            want = torch.stack([lora.gate_up_B[j].to(dt) @ (lora.gate_up_A[j].to(dt) @ xe[i])
                                for i, j in enumerate(e)]) * lora.scaling
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2 if dt == torch.bfloat16 else 1e-5,
                                       atol=1e-2 if dt == torch.bfloat16 else 1e-5)
            got.float().pow(2).sum().backward()
            assert lora.gate_up_A.grad.shape == (4, r, 16)


def test_activation_checkpointing_modes_give_the_same_gradients(tmp_path):
    import moetune
    from moetune.model.lora import apply_lora
    from moetune.parallel.ac_modes import AC_MODES
    from moetune.parallel.apply import apply_ac

    from helpers import hf_model, save_hf

    path = save_hf(hf_model(seed=8), tmp_path / "ckpt")
    ids = torch.randint(0, 96, (2, 16))
    labels = torch.roll(ids, -1, 1)
    grads = {}
    layers = len(moetune.load_model(path).model.layers)
    mixed = {"full": 1, "attention": layers - 2, "none": 1}  # modes per layer, in the order written (ac_modes)
    for mode in AC_MODES + ("mixed",):
        model = moetune.load_model(path)
        torch.manual_seed(0)
        apply_lora(model, ["q_proj", "experts"], 4, 8)
        for n, p in model.named_parameters():
            if "lora_B" in n or n.endswith("_B"):
                torch.nn.init.normal_(p, std=0.1)
        apply_ac(model, mixed if mode == "mixed" else mode)
        model.train()
        model(ids, labels=labels).backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert set(AC_MODES) == {"none", "attention", "selective", "full"}
    assert layers >= 3 and [layer.activation_checkpointing for layer in model.model.layers] == (
        ["full"] + ["attention"] * (layers - 2) + ["none"])
    for mode in AC_MODES[1:] + ("mixed",):
        for n, g in grads["none"].items():
            torch.testing.assert_close(grads[mode][n], g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec, message", [
    ({"full": 1}, "add up to the model's 3 layers"),
    ({"full": 4, "none": -1}, "≥ 0"),
    ({"fulll": 3}, r"unknown mode\(s\) \['fulll'\], choose from \['none', 'attention', 'selective', 'full'\]"),
])
def test_activation_checkpointing_per_layer_errors_name_the_key(spec, message):
    from moetune.errors import ConfigError
    from moetune.parallel.ac_modes import layer_modes

    with pytest.raises(ConfigError, match=r"train\.activation_checkpointing .*" + message):
        layer_modes(spec, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_swiglu_backward_equals_autograd(dtype):
    """The eager hand-written backward (kept memory: h and the weights only) gives autograd's gradients."""
    from moetune.model.kernels import swiglu
    from moetune.model.experts import _WeightedSwiGLU

    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 2 * 24, generator=g).to(dtype).requires_grad_()
    w = torch.rand(37, generator=g).requires_grad_()
    out_grad = torch.randn(37, 24, generator=g).to(dtype)
    ref = (swiglu(h).float() * w.unsqueeze(-1)).to(dtype)
    ref_h, ref_w = torch.autograd.grad(ref, (h, w), out_grad)
    got = _WeightedSwiGLU.apply(h, w)
    got_h, got_w = torch.autograd.grad(got, (h, w), out_grad)
    assert torch.equal(got, ref)
    torch.testing.assert_close(got_h, ref_h, rtol=0, atol=0)
    torch.testing.assert_close(got_w, ref_w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bag_sum_kernel_equals_the_torch_reference(dtype):
    """The EP exchange's combine (model/kernels.py): the Triton kernel (on the CPU under TRITON_INTERPRET=1,
    conftest) equals the torch reference, with empty slots, bags of one, empty bags and a width that is not a
    multiple of the kernel's block; and the reference is the plain sum it claims to be."""
    from moetune.model.kernels import BLOCK, bag_sum, bag_sum_torch, kernel_available

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert kernel_available(device), "triton is a test dependency (pyproject) and TRITON_INTERPRET=1 is set"
    g = torch.Generator().manual_seed(0)
    n, H = 23, BLOCK + 70
    src = torch.randn(n, H, generator=g).to(device, dtype)
    slots = torch.randint(-1, n, (9, 3), generator=g)
    slots[0] = -1  # an empty bag
    slots[1] = torch.tensor([5, -1, -1])  # a bag of one
    slots = slots.to(device)
    ref = bag_sum_torch(src, slots)
    expected = torch.stack([sum((src[s].float() for s in row if s >= 0), torch.zeros(H, device=device))
                            for row in slots.tolist()]).to(dtype)
    torch.testing.assert_close(ref, expected, rtol=0, atol=0) if dtype == torch.float32 else \
        torch.testing.assert_close(ref, expected)
    out = bag_sum(src, slots, use_kernel=True)
    assert out.dtype == dtype and out.shape == (9, H)
    # bf16: one rounding of the same fp32 sum (the interpreter truncates instead of rounding: one ulp)
    torch.testing.assert_close(out, ref, **({"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {}))
    assert out[0].abs().sum() == 0 and torch.equal(out[1], src[5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_swiglu_kernels_equal_the_torch_reference(dtype):
    """The Triton forward and backward of the weighted SwiGLU (the EP path's eager expert activation) against
    the torch reference the CPU runs, for an intermediate size that is not a power of two."""
    from moetune.model.kernels import (kernel_available, weighted_swiglu_bwd, weighted_swiglu_bwd_torch,
                                       weighted_swiglu_fwd, weighted_swiglu_fwd_torch)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert kernel_available(device)
    g = torch.Generator().manual_seed(0)
    N, I = 19, 88
    h = (torch.randn(N, 2 * I, generator=g) * 2).to(device, dtype)
    w = torch.rand(N, generator=g).to(device)
    dy = torch.randn(N, I, generator=g).to(device, dtype)
    # The kernels compute in fp32 from the bf16 inputs and round once: the reference on the upcast inputs, within
    # one bf16 rounding of the output (the interpreter truncates instead of rounding).
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-5}
    out = weighted_swiglu_fwd(h, w, use_kernel=True)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), weighted_swiglu_fwd_torch(h.float(), w), **tol)
    got_h, got_w = weighted_swiglu_bwd(h, w, dy, True, use_kernel=True)
    ref_h, ref_w = weighted_swiglu_bwd_torch(h.float(), w, dy.float(), True)
    assert got_h.dtype == dtype and got_w.dtype == w.dtype
    torch.testing.assert_close(got_h.float(), ref_h, **tol)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-5, atol=1e-5)
    assert weighted_swiglu_bwd(h, w, dy, False, use_kernel=True)[1] is None


def _fp8_units(q, scale, ref_q, ref_scale):
    """Both quantised rows in units of the reference's scale (fp32), and one fp8 step at each reference value."""
    got = q.float() * scale / ref_scale
    ref = ref_q.float()
    return got, ref, ref.abs() * 2.0 ** -3 + 2.0 ** -9


def test_weighted_swiglu_fp8_kernels_equal_the_torch_reference():
    """The weighted SwiGLU with its output quantised per row (an fp8 base's down_proj operand), and its backward with
    the gradient times each row's expert's weight scales, quantised per row (gate_up's input-gradient operand),
    against the torch references the CPU runs: the scales within one bf16 rounding of the amax, every value within one
    fp8 step (the kernels round the bf16 intermediates once, the interpreter truncates), the routing weights'
    gradient within fp32 summation; most values equal."""
    from moetune.model.kernels import (kernel_available, weighted_swiglu_bwd_fp8, weighted_swiglu_bwd_fp8_torch,
                                       weighted_swiglu_bwd_torch, weighted_swiglu_fp8, weighted_swiglu_fp8_torch)
    from moetune.model.quant.fp8 import FP8

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert kernel_available(device)
    g = torch.Generator().manual_seed(0)
    N, I, E = 23, 88, 5
    h = (torch.randn(N, 2 * I, generator=g) * 2).to(device, torch.bfloat16)
    w = torch.rand(N, generator=g).to(device)
    dy = torch.randn(N, I, generator=g).to(device, torch.bfloat16)
    h[3] = 0  # a row of zeros: scale _TINY, values 0
    scales = (torch.rand(E, 2 * I, generator=g) * 3 + 0.01).to(device)  # each expert's weight scales, spread wide
    expert = torch.randint(0, E, (N,), generator=g).to(device)

    q, s = weighted_swiglu_fp8(h, w, use_kernel=True)
    rq, rs = weighted_swiglu_fp8_torch(h, w)
    assert q.dtype == FP8 and q.shape == (N, I) and s.shape == (N, 1)
    torch.testing.assert_close(s, rs, rtol=8e-3, atol=0)
    got, ref, step = _fp8_units(q, s, rq, rs)
    assert ((got - ref).abs() <= step).all() and not got.isnan().any()
    assert (q.float() == rq.float()).float().mean() > 0.9

    q, s, gw = weighted_swiglu_bwd_fp8(h, w, dy, scales, expert, use_kernel=True)
    rq, rs, rgw = weighted_swiglu_bwd_fp8_torch(h, w, dy, scales[expert])
    assert q.dtype == FP8 and q.shape == (N, 2 * I) and s.shape == (N, 1) and gw.dtype == torch.float32
    # the reference rounds to bf16 at each of its ops (the bf16 path's autograd), the kernel once: two roundings apart
    torch.testing.assert_close(s, rs, rtol=2e-2, atol=0)
    got, ref, step = _fp8_units(q, s, rq, rs)
    assert ((got - ref).abs() <= step).all() and not got.isnan().any()
    assert (q.float() == rq.float()).float().mean() > 0.9
    # the routing weights' gradient is summed in fp32 from the bf16 inputs: the reference on the upcast inputs
    torch.testing.assert_close(gw, weighted_swiglu_bwd_torch(h.float(), w, dy.float(), True)[1], rtol=1e-5, atol=1e-4)
    # the torch reference the CPU takes is the same function of the table and the rows' experts
    tq, ts, tgw = weighted_swiglu_bwd_fp8(h, w, dy, scales, expert, use_kernel=False)
    assert torch.equal(tq.float(), rq.float()) and torch.equal(ts, rs) and torch.equal(tgw, rgw)


def test_gathered_rows_fp8_kernel_equals_the_torch_reference():
    """Rows gathered from their tokens, times each row's expert's weight scales, quantised per row (down_proj's
    input-gradient operand on an fp8 base) against the torch reference the CPU runs: the same scales (one exact amax
    of the same fp32 products), every value equal (the interpreter's cast corrected onto the fp8 grid)."""
    from moetune.model.kernels import gathered_rows_fp8, gathered_rows_fp8_torch, kernel_available
    from moetune.model.quant.fp8 import FP8

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert kernel_available(device)
    g = torch.Generator().manual_seed(0)
    T, N, H, E = 7, 20, 200, 3
    src = torch.randn(T, H, generator=g).to(device, torch.bfloat16)
    src[2] = 0  # a token of zeros: scale _TINY, values 0
    index = torch.randint(0, T, (N,), generator=g).to(device)
    scales = (torch.rand(E, H, generator=g) * 3 + 0.01).to(device)
    expert = torch.randint(0, E, (N,), generator=g).to(device)
    q, s = gathered_rows_fp8(src, index, scales, expert, use_kernel=True)
    rq, rs = gathered_rows_fp8_torch(src, index, scales[expert])
    assert q.dtype == FP8 and q.shape == (N, H) and s.shape == (N, 1)
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    torch.testing.assert_close(q.float(), rq.float(), rtol=0, atol=0)
    tq, ts = gathered_rows_fp8(src, index, scales, expert, use_kernel=False)
    assert torch.equal(tq.float(), rq.float()) and torch.equal(ts, rs)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_frozen_router_logits_equal_the_fp32_product(device):
    """The router's logits from bf16 operands on tensor cores (CUDA) are transformers' fp32 product up to the order of
    the sums, and x's bf16 gradient is the fp32 gradient rounded once, but where the sums' order moves a rounding:
    the gradient's two 16-bit halves (one alone matches only ~58% of elements)."""
    from moetune.model.glm4_moe import _FrozenRouterLogits, router_logits

    torch.manual_seed(0)
    x = torch.randn(512, 256).bfloat16().to(device).requires_grad_()
    w = (torch.randn(64, 256) * 0.02).bfloat16().to(device)
    x32 = x.detach().float().requires_grad_()
    got = _FrozenRouterLogits.apply(x, w) if device == "cpu" else router_logits(x, w)
    want = x32 @ w.float().t()
    assert got.dtype == torch.float32 and got.grad_fn.name().endswith("FrozenRouterLogitsBackward")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    g = torch.randn(512, 64, device=device)
    got.backward(g)
    want.backward(g)
    assert x.grad.dtype == torch.bfloat16
    assert (x.grad == x32.grad.bfloat16()).float().mean() > 0.98


def test_router_logits_keep_the_fp32_product_where_the_weight_trains():
    from moetune.model.glm4_moe import router_logits

    x = torch.randn(4, 8).bfloat16()
    w = torch.randn(3, 8).bfloat16().requires_grad_()
    router_logits(x, w).sum().backward()  # full fine-tuning: the fp32 product and its weight gradient
    assert w.grad is not None and w.grad.shape == w.shape


@pytest.mark.parametrize("num_keys,dtype", [(64, torch.uint8), (256, torch.uint8), (257, torch.int16),
                                            (40000, torch.int32)])
def test_sort_by_key_sorts_narrow_keys_to_the_int64_order(num_keys, dtype, monkeypatch):
    from moetune.model import experts

    torch.manual_seed(0)
    key = torch.randint(0, num_keys, (5000,))
    key[:50] = num_keys - 1  # the largest key, many ties
    seen = []
    argsort = torch.argsort
    monkeypatch.setattr(torch, "argsort", lambda k, **kw: seen.append(k.dtype) or argsort(k, **kw))
    got = experts.sort_by_key(key, num_keys)
    assert seen == [dtype]
    assert torch.equal(got, argsort(key, stable=True))


class _SeenOps(TorchDispatchMode):
    """The ops that run under it, by name (e.g. "moetune.lora_linear"), and how many times each ran."""

    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    @property
    def seen(self) -> set:
        return set(self.count)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(12, 20, (3, 5)), (8, 96, (4, 16))], ids=["in_place", "along_k"])
def test_lora_linear_forms_are_one_product(compiled, bias, shape, monkeypatch):
    """The forms of a LoRA linear on a bf16-like base (lora.LORA_LINEAR; float64 here): the one op each way (its
    branch added in place, or along the GEMM's reduction where the output is much wider than the input:
    lora.LORA_ALONG_K), the addmm and the plain sum give the same output and the same gradients for x, A and B, eager
    and compiled (Inductor); so does the op with the branch's product written first and the base GEMM added onto it
    (lora.LORA_FIRST); the op form runs the op, forward and backward, and the others do not."""
    from moetune.model import lora

    n_in, n_out, lead = shape
    torch.manual_seed(0)
    layer = lora.LoRALinear(torch.nn.Linear(n_in, n_out, bias=bias).double(), rank=4, alpha=12, dropout=0.0,
                            rslora=False)
    torch.nn.init.normal_(layer.lora_B)
    layer.lora_A.data, layer.lora_B.data = layer.lora_A.data.double(), layer.lora_B.data.double()
    x = torch.randn(*lead, n_in, dtype=torch.float64)
    assert lora._wide_output(math.prod(lead), layer.weight, layer.lora_A.shape[0]) == (n_out == 96)
    weights = torch.randn(n_out, dtype=torch.float64)
    chosen = []
    for fn in ("_product_along_k", "_grads_along_k", "_branch_then_base"):
        monkeypatch.setattr(lora, fn, lambda *a, _fn=getattr(lora, fn), _name=fn: chosen.append(_name) or _fn(*a))
    results = []
    for form, along_k, first in (("op", True, False), ("op", False, False), ("op", False, True), ("addmm", True, False),
                                 ("sum", True, False)):
        monkeypatch.setattr(lora, "LORA_LINEAR", form)
        monkeypatch.setattr(lora, "LORA_ALONG_K", along_k)
        monkeypatch.setattr(lora, "LORA_FIRST", first)
        torch._dynamo.reset()
        f = torch.compile(layer, backend="inductor") if compiled else layer
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        with _SeenOps() as ops:
            y = f(xi)
            (y * weights).sum().backward()
        if not compiled:
            assert ("moetune.lora_linear" in ops.seen and "moetune.lora_linear_bwd" in ops.seen) == (form == "op")
            # the op's two halves each took LoRA's branch along K where it pays (and it was allowed), else in place
            assert chosen == (["_product_along_k", "_grads_along_k"] if form == "op" and along_k and n_out == 96
                              else ["_branch_then_base"] if form == "op" and first else [])
        chosen.clear()
        results.append((y, xi.grad, layer.lora_A.grad.clone(), layer.lora_B.grad.clone()))
    for got in results[1:]:
        for a, b in zip(results[0], got):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert results[0][3].abs().sum() > 0 and results[0][2].abs().sum() > 0


@pytest.mark.parametrize("n_in, n_out, rows", [(64, 96, 40), (16, 256, 128)], ids=["in_place", "along_k"])
def test_lora_linear_op_in_bf16_and_where_it_does_not_apply(n_in, n_out, rows, monkeypatch):
    """In bf16 the op's output and gradients are those of the traced form within bf16's rounding (the same GEMMs, the
    sums in fp32 accumulators; cuBLAS's on CUDA), its branch added in place, or along the reduction, or written first
    with the base GEMM added onto it (lora.LORA_FIRST); an input that needs no gradient gets none (B's and A's still
    come); LoRA dropout and an fp32 input fall back to the traced form."""
    from moetune.model import lora

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(1)
    layer = lora.LoRALinear(torch.nn.Linear(n_in, n_out, bias=True).bfloat16().to(device), rank=8, alpha=16,
                            dropout=0.0, rslora=False)
    torch.nn.init.normal_(layer.lora_B)
    x = torch.randn(rows, n_in, dtype=torch.bfloat16, device=device)
    assert lora._wide_output(rows, layer.weight, layer.lora_A.shape[0]) == (n_out == 256)
    out = []
    for form, first in (("addmm", False), ("op", False), ("op", True)):
        monkeypatch.setattr(lora, "LORA_LINEAR", form)
        monkeypatch.setattr(lora, "LORA_FIRST", first)
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.float().square().sum().backward()
        out.append((y.float(), xi.grad.float(), layer.lora_A.grad.clone(), layer.lora_B.grad.clone()))
    for got in out[1:]:
        for a, b in zip(got, out[0]):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())
    monkeypatch.setattr(lora, "LORA_FIRST", False)
    monkeypatch.setattr(lora, "LORA_LINEAR", "op")
    layer.zero_grad()
    layer(x).float().sum().backward()  # x needs no gradient
    assert layer.lora_A.grad is not None and layer.lora_B.grad.abs().sum() > 0
    assert layer.in_one_op(x) and not layer.in_one_op(x.float())
    dropped = lora.LoRALinear(torch.nn.Linear(n_in, n_out).bfloat16().to(device), rank=8, alpha=16, dropout=0.1,
                              rslora=False)
    assert not dropped.in_one_op(x)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("first", [False, True], ids=["in_place", "first"])
@pytest.mark.parametrize("along_k", [False, True], ids=["no_k", "along_k"])
def test_lora_linears_of_one_input_as_one_op_give_each_ones_outputs_and_gradients(compiled, first, along_k,
                                                                                monkeypatch):
    """LoRA linears that read one input (lora.JOINT_INPUTS: GQA's q, k, v) run as one op each way, and give what each
    gives as its own op and as the traced form: every output, x's gradient (the members' products summed inside the
    op's backward), every A's and B's (A's products of all members one GEMM each way); members of different ranks,
    with and without bias, one wide (its branch along K where allowed); the branch added in place or written first
    (lora.LORA_FIRST); float64, eager and compiled (on the GPU where there is one: cuBLAS's GEMMs); an input that
    needs no gradient gets none, A's and B's still come. One op runs each way where the members join, one per member
    where they do not."""
    from moetune.model import lora
    from moetune.model.glm4_moe import linears_of_one_input

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(3)
    n_in, rows = 8, 16
    members = [lora.LoRALinear(torch.nn.Linear(n_in, n_out, bias=bias).double().to(device), rank=rank, alpha=6,
                               dropout=0.0, rslora=False)
               for n_out, bias, rank in ((96, True, 4), (20, False, 2), (6, True, 4))]
    for m in members:
        torch.nn.init.normal_(m.lora_B)
        m.lora_A.data, m.lora_B.data = m.lora_A.data.double(), m.lora_B.data.double()
    assert [lora._wide_output(rows, m.weight, m.lora_A.shape[0]) for m in members] == [True, False, False]
    x = torch.randn(2, rows // 2, n_in, dtype=torch.float64, device=device)
    weights = [torch.randn(m.out_features, dtype=torch.float64, device=device) for m in members]
    monkeypatch.setattr(lora, "LORA_ALONG_K", along_k)
    monkeypatch.setattr(lora, "LORA_FIRST", first)

    def run(form, joint, input_grad=True):
        monkeypatch.setattr(lora, "LORA_LINEAR", form)
        monkeypatch.setattr(lora, "JOINT_INPUTS", joint)
        torch._dynamo.reset()
        f = lambda xi: linears_of_one_input(xi, *members)  # noqa: E731
        f = torch.compile(f, backend="inductor", fullgraph=True) if compiled else f
        for m in members:
            m.zero_grad()
        xi = x.clone().requires_grad_(input_grad)
        ops = _SeenOps()  # (no dispatch mode under torch.compile)
        with contextlib.nullcontext() if compiled else ops:
            ys = f(xi)
            sum((y * w).sum() for y, w in zip(ys, weights)).backward()
        if not compiled:
            n = 0 if form != "op" else 1 if joint else 3
            assert (ops.count["moetune.lora_linear"], ops.count["moetune.lora_linear_bwd"]) == (n, n)
        grads = [g.clone() for m in members for g in (m.lora_A.grad, m.lora_B.grad)]
        return [y.detach() for y in ys] + [xi.grad] + grads

    want = run("addmm", False)
    for got in (run("op", False), run("op", True)):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert all(g.abs().sum() > 0 for g in want[4:])
    no_x = run("op", True, input_grad=False)
    assert no_x[3] is None
    for a, b in zip(no_x[4:], want[4:]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("model_type", ["glm4_moe", "glm4_moe_lite"])
def test_a_model_with_joint_lora_linears_gives_the_same_loss_and_gradients(model_type, monkeypatch):
    """The tiny GLM-4.5 (q, k, v; the shared expert's and the dense MLP's gate and up) and GLM-4.7-Flash (q_a and
    kv_a) with lora.JOINT_INPUTS: the same loss and LoRA gradients as each linear its own op (fp32: the sums' order is
    all that differs), with fewer LoRA ops (compiled: the test above)."""
    from family_models import TINY_MLA
    from moetune.model import lora
    from moetune.model.build import build_model
    from moetune.model.config import BUILTIN, ModelConfig
    from moetune.model.hf_io import init_weights
    from moetune.train.setup import init_lora

    if model_type == "glm4_moe":
        cfg = dict(BUILTIN["tiny"], num_hidden_layers=2)
        targets, lora_ops = ["q_proj", "k_proj", "v_proj", "o_proj", "shared_experts", "dense_mlp"], (14, 8)
    else:
        cfg = dict(TINY_MLA, model_type="glm4_moe_lite", num_hidden_layers=2, first_k_dense_replace=1)
        targets, lora_ops = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"], (10, 8)
    monkeypatch.setattr(lora, "LORA_LINEAR", "op")
    model = build_model(ModelConfig.from_hf_dict(cfg), "meta")
    lora.apply_lora(model, targets, 4, 8)
    model.to_empty(device="cpu")
    init_weights(model, 0.05, seed=0)
    init_lora(model, seed=0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    ids = torch.randint(0, cfg["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    results = {}
    for joint in (False, True):
        monkeypatch.setattr(lora, "JOINT_INPUTS", joint)
        model.zero_grad()
        with _SeenOps() as ops:
            loss = model(ids, labels=torch.roll(ids, -1, 1))
            loss.backward()
        # 2 layers (the first dense): each LoRA linear its own op, or q, k, v (q_a, kv_a) as one, gate and up as one
        assert ops.count["moetune.lora_linear"] == ops.count["moetune.lora_linear_bwd"] == lora_ops[joint]
        results[joint] = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    (loss, grads), (got_loss, got) = results[False], results[True]
    torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=0)
    assert grads and all(g.abs().sum() > 0 for g in grads.values())
    for n in grads:
        torch.testing.assert_close(got[n], grads[n], rtol=1e-4, atol=1e-4 * grads[n].abs().max().item())


def _fp8_lora_layer(device, bias: bool, dropout: float = 0.0, rank: int = 8, n_in: int = 64, n_out: int = 96):
    """A LoRA linear on a frozen row-scaled fp8 weight (64 -> 96, r 8 unless given), B nonzero."""
    from moetune.model import lora
    from moetune.model.quant.fp8 import ROWWISE, quantize_rows
    from moetune.model.quant.modules import Fp8Linear

    torch.manual_seed(2)
    base = Fp8Linear(n_in, n_out, bias, ROWWISE, device=device, bias_dtype=torch.bfloat16)
    w8, scale = quantize_rows(torch.randn(n_out, n_in, device=device) / 8)
    base.weight.data, base.weight_scale.data = w8, scale
    if bias:
        base.bias.data = torch.randn(n_out, device=device).bfloat16()
    layer = lora.LoRALinear(base, rank=rank, alpha=16, dropout=dropout, rslora=False)
    torch.nn.init.normal_(layer.lora_B)
    return layer


@pytest.mark.parametrize("bias", [False, True])
def test_lora_linear_fp8_op_is_the_fp8_product_plus_the_branch(bias):
    """The LoRA op on an fp8 weight: its output is quant.matmul's fp8 product (activation rows quantised, fp8 x fp8,
    `reference_fp8_linear`) plus s·(x·Aᵀ)·Bᵀ, x's gradient the fp8 input gradient (dy with the weight's scales
    folded in, quantised: `reference_fp8_dgrad`) plus (dy·s·B)·A, A's and B's gradients the branch's; in fp32 (on the
    CPU torch._scaled_mm's own kernel, on a GPU its twin); an input that needs no gradient gets none."""
    from moetune.model import lora
    from moetune.model.quant.matmul import reference_fp8_dgrad, reference_fp8_linear
    from moetune.model.quant.modules import weight_scale

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layer = _fp8_lora_layer(device, bias)
    x = torch.randn(3, 10, 64, device=device).requires_grad_()
    A, B = (p.detach().clone().requires_grad_() for p in (layer.lora_A, layer.lora_B))
    y = lora.lora_linear(x, layer.weight, layer.bias, A, B, layer.scaling, weight_scale(layer))
    grad = torch.randn(3, 10, 96, device=device)
    y.backward(grad)

    xr, Ar, Br = (t.detach().clone().requires_grad_() for t in (x, A, B))
    branch = layer.scaling * (xr @ Ar.t()) @ Br.t()
    want = reference_fp8_linear(xr.detach(), layer.weight, weight_scale(layer), layer.bias) + branch
    (branch * grad).sum().backward()
    dx = reference_fp8_dgrad(grad, layer.weight, weight_scale(layer)) + xr.grad
    for got, ref in ((y, want), (x.grad, dx), (A.grad, Ar.grad), (B.grad, Br.grad)):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    assert B.grad.abs().sum() > 0 and A.grad.abs().sum() > 0
    A.grad = None
    y = lora.lora_linear(x.detach(), layer.weight, layer.bias, A, B, layer.scaling, weight_scale(layer))
    y.sum().backward()
    assert A.grad is not None


@pytest.mark.parametrize("epilogue", [False, True], ids=["added_in_place", "in_the_epilogue"])
@pytest.mark.parametrize("bias", [False, True])
def test_lora_linear_on_an_fp8_weight_takes_the_op_where_the_row_kernel_quantises(bias, epilogue, monkeypatch):
    """A LoRA linear on an fp8 weight runs the one op each way where the fp8 GEMMs run on tensor cores with their
    operands quantised by the row kernel (quant.matmul.DENSE_QUANT "kernel"), and there gives the traced form's
    output and x/A/B gradients within bf16's rounding (the same fp8 GEMMs; the branch added in place, or in the TMA
    kernel's epilogue where the output is much wider than the input and FP8_LORA_EPILOGUE allows it: no bias, rank
    16); under Inductor's quantisations, with LoRA dropout, or without fp8 tensor cores (the CPU) it keeps the traced
    form."""
    from moetune.model import lora
    from moetune.model.quant import matmul

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    # the epilogue where the output is much wider than the input (lora._wide_output): 32 -> 512 at 128 rows
    n_in, n_out, rows = (32, 512, 128) if epilogue else (64, 96, 40)
    layer = _fp8_lora_layer(device, bias, rank=16 if epilogue else 8, n_in=n_in, n_out=n_out)
    assert lora._wide_output(rows, layer.weight, layer.lora_A.shape[0]) == epilogue
    monkeypatch.setattr(matmul, "FP8_LORA_EPILOGUE", epilogue)
    epilogues = []
    real_epilogue = lora.fp8_mm_lora
    monkeypatch.setattr(lora, "fp8_mm_lora", lambda *a: epilogues.append(1) or real_epilogue(*a))
    x = torch.randn(rows, n_in, dtype=torch.bfloat16, device=device)
    monkeypatch.setattr(matmul, "DENSE_QUANT", "inductor")
    assert not layer.in_one_op(x)
    monkeypatch.setattr(matmul, "DENSE_QUANT", "kernel")
    assert layer.in_one_op(x) == cuda  # the fp8 tensor-core path is CUDA's (the CPU dequantises just in time)
    out = []
    for form in ("op", "addmm"):
        monkeypatch.setattr(lora, "LORA_LINEAR", form)
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        with _SeenOps() as ops:
            y = layer(xi)
            y.float().square().sum().backward()
        assert ("moetune.lora_linear" in ops.seen and "moetune.lora_linear_bwd" in ops.seen) == (form == "op" and cuda)
        assert len(epilogues) == (form == "op" and cuda and epilogue and not bias)
        epilogues.clear()
        out.append((y.float(), xi.grad.float(), layer.lora_A.grad.clone(), layer.lora_B.grad.clone()))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())
    dropped = _fp8_lora_layer(device, bias, dropout=0.1, n_in=n_in, n_out=n_out)
    assert not dropped.in_one_op(x)


@pytest.mark.parametrize("scaled", [False, True])
def test_scaled_rows_fp8_kernel_equals_the_torch_reference(scaled):
    """Rows (times a weight's row scales: a dense input gradient's operand) quantised per row in one pass, against
    the torch reference the CPU runs: the same scales (one exact amax of the same fp32 products), every value equal
    (the interpreter's cast corrected onto the fp8 grid); a row of zeros gets the tiny scale and zeros."""
    from moetune.model.kernels import kernel_available, scaled_rows_fp8, scaled_rows_fp8_torch
    from moetune.model.quant.fp8 import _TINY, FP8

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert kernel_available(device)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(23, 200, generator=g) * 3).to(device, torch.bfloat16)
    x[4] = 0
    cs = (torch.rand(200, generator=g) * 3 + 0.01).to(device) if scaled else None
    q, s = scaled_rows_fp8(x, cs, use_kernel=True)
    rq, rs = scaled_rows_fp8_torch(x, cs)
    assert q.dtype == FP8 and q.shape == x.shape and s.shape == (23, 1)
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    torch.testing.assert_close(q.float(), rq.float(), rtol=0, atol=0)
    assert s[4].item() == torch.tensor(_TINY).item() and not q[4].float().any()
    if scaled:  # the scales are applied: without them the values differ
        assert not torch.equal(q.float(), scaled_rows_fp8_torch(x)[0].float())


@pytest.mark.parametrize("backend, dtype", [("eager", torch.float32), ("aot_eager", torch.float32),
                                            ("aot_eager", torch.bfloat16)])
def test_compiled_swiglu_backward_as_one_kernel_gives_autograds_gradients(monkeypatch, backend, dtype):
    """In compiled code the weighted SwiGLU's backward is model/kernels.py's row kernel as an opaque op
    (SWIGLU_BACKWARD "kernel"; on the CPU under the interpreter): called once, the forward still traced, and the
    gradients of h and of the routing weights those of autograd's traced ops ("inductor") on fp32 inputs: equal in
    fp32, within bf16's rounding from bf16 inputs (the kernel computes in fp32 and rounds once). (On an H200 with
    torch 2.11 the fp32 gradients were zero while the forward's output was a no-op `.to` of the product.)"""
    from moetune.model import experts, grouped_gemm_tiles

    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(grouped_gemm_tiles, "KERNEL_ON_CPU", device == "cpu")
    calls = []
    real = experts.weighted_swiglu_bwd
    monkeypatch.setattr(experts, "weighted_swiglu_bwd",
                        lambda *a, **kw: calls.append(kw.get("use_kernel")) or real(*a, **kw))
    g = torch.Generator().manual_seed(0)
    N, I = 21, 40
    # values bf16 holds exactly, and scalings by 2: the fp32 reference sees the bf16 run's very inputs
    h0 = (torch.randn(N, 2 * I, generator=g) * 2).bfloat16().float().to(device)
    w0 = torch.rand(N, generator=g).to(device)
    out_grad = torch.randn(N, I, generator=g).bfloat16().float().to(device)

    def run(mode, dtype):
        monkeypatch.setattr(experts, "SWIGLU_BACKWARD", mode)
        torch._dynamo.reset()
        h, w = h0.to(dtype, copy=True).requires_grad_(), w0.clone().requires_grad_()
        y = torch.compile(lambda a, b: experts.weighted_swiglu(a * 2, b * 2), backend=backend,
                          fullgraph=True)(h, w)
        y.backward(out_grad.to(dtype))
        return y.detach().float(), h.grad.float(), w.grad

    want = run("inductor", torch.float32)
    assert not calls
    got = run("kernel", dtype)
    assert calls == [True]  # once, at run time: the opaque op (a traced eager call would pass no use_kernel)
    # bf16: the output and h's gradient rounded once (the traced forward rounds silu(gate)·up once more)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-5}
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
    assert got[1].abs().sum() > 0 and got[2].abs().sum() > 0


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n_in, n_out, rows", [(12, 20, 5), (8, 96, 16)], ids=["in_place", "along_k"])
def test_lora_linear_ops_pass_opcheck(bias, n_in, n_out, rows):
    """The LoRA linear's two custom ops as torch.library.opcheck sees them, their branch added in place and along the
    GEMM's reduction: schema (no input mutated or aliased), autograd registration, fake kernels against the real ones,
    and AOTAutograd with dynamic shapes."""
    from moetune.model import lora

    g = torch.Generator().manual_seed(0)
    f64 = dict(dtype=torch.float64)
    x = torch.randn(2, rows, n_in, generator=g, **f64).requires_grad_()
    W, b = torch.randn(n_out, n_in, generator=g, **f64), torch.randn(n_out, generator=g, **f64)
    A = torch.randn(4, n_in, generator=g, **f64).requires_grad_()
    B = torch.randn(n_out, 4, generator=g, **f64).requires_grad_()
    assert lora._wide_output(2 * rows, W, A.shape[0]) == (n_out == 96)
    torch.library.opcheck(torch.ops.moetune.lora_linear.default,
                          (x, [W], [None], [b if bias else None], [None], [A], [B], [2.0]))
    grad, h = torch.randn(2, rows, n_out, generator=g, **f64), torch.randn(2 * rows, 4, generator=g, **f64)
    for input_grad in (True, False):
        torch.library.opcheck(torch.ops.moetune.lora_linear_bwd.default,
                              ([grad], x.detach(), h, [W], [None], [None], [A.detach()], [B.detach()], [2.0],
                               input_grad))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("transposed", [False, True], ids=["copy_made", "copy_kept"])
def test_lora_linear_fp8_ops_pass_opcheck(bias, transposed):
    """The LoRA linear's two ops on an fp8 weight as torch.library.opcheck sees them (fp32 activations, an fp8 weight
    with row scales, its kept transposed copy or none): autograd registration, fake kernels against the real ones,
    AOTAutograd with dynamic shapes. Its schema check cannot compare fp8 tensors on the CPU (no fp8 multiply there):
    that no input is mutated is checked bit for bit instead. On a GPU (its twin) on CUDA tensors: torch 2.11's CPU
    _scaled_mm takes per-tensor scales only."""
    from moetune.model import lora  # noqa: F401  (registers the ops)
    from moetune.model.quant.fp8 import quantize_rows

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 32, generator=g).to(device).requires_grad_()  # 16 rows: cuBLAS's fp8 GEMM wants 16s
    w8, scale = quantize_rows(torch.randn(48, 32, generator=g).to(device))
    b = torch.randn(48, generator=g).to(device) if bias else None
    copy = w8.t().contiguous() if transposed else None
    A = torch.randn(4, 32, generator=g).to(device).requires_grad_()
    B = torch.randn(48, 4, generator=g).to(device).requires_grad_()
    checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    grad, h = torch.randn(2, 8, 48, generator=g).to(device), torch.randn(16, 4, generator=g).to(device)
    calls = [(torch.ops.moetune.lora_linear.default, (x, [w8], [scale], [b], [copy], [A], [B], [2.0]))]
    calls += [(torch.ops.moetune.lora_linear_bwd.default,
               ([grad], x.detach(), h, [w8], [scale], [copy], [A.detach()], [B.detach()], [2.0], input_grad))
              for input_grad in (True, False)]
    for op, args in calls:
        torch.library.opcheck(op, args, test_utils=checks)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        before = [t.detach().clone() for t in tensors]
        op(*args)
        assert all(torch.equal(t.view(torch.uint8), c.view(torch.uint8)) if t.dtype == w8.dtype else torch.equal(t, c)
                   for t, c in zip(tensors, before))


def test_lora_linear_kernels_benchmark_rehearses_on_the_cpu(tmp_path):
    """benchmarks/lora_linear_kernels.py's CPU rehearsal runs against today's op and reports what the GPU run's table
    rests on: the wide shape takes a bf16 weight's LoRA branch along K and the narrow one in place, the bf16 forms'
    outputs (in place, along K, the branch first) within bf16's rounding of each other, the fp8 forms' (torch's fp8
    GEMM either way on the CPU) finite and equal (a NaN fails the comparison); EVERY_SHAPE=1 takes it along K on
    both."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "lora_linear_kernels.py"
    for every in ("0", "1"):
        env = dict(os.environ, BENCH_CPU="1", OUT=str(tmp_path), EVERY_SHAPE=every, OMP_NUM_THREADS="1")
        p = subprocess.run([sys.executable, str(bench)], env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
        rows = json.loads((tmp_path / "lora_linear_kernels.json").read_text())["results"]
        along = {r["shape"]: r["along_k"] for r in rows if r["setting"] == "along_k"}
        assert along == {"tiny_wide": True, "tiny_narrow": every == "1"}
        assert {(r["base"], r["setting"]) for r in rows} == {
            ("bf16", "in_place"), ("bf16", "along_k"), ("bf16", "first"), ("fp8", "in_place"), ("fp8", "epilogue")}
        for r in rows:
            tol = 1e-2 if r["base"] == "bf16" else 5e-2
            assert r["y_err_vs_other"] < tol and r["dx_err_vs_other"] < tol, r
        assert not any(r["along_k"] for r in rows if r["setting"] == "in_place")
