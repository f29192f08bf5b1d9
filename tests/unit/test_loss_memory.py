"""model/loss.py's chunked linear + cross-entropy holds one chunk's logits and gradient at a time: the previous
chunk's gradient is gone before the next chunk's logits are made: two [chunk, vocab] tensors at once, not three
(0.58 GiB at GLM-4.5-Air's vocabulary; parallel/estimate.py counts two since GLM-4.7-Flash on an H200 confirmed it)."""

import weakref

import torch

from moetune.model import loss as loss_mod


def test_the_previous_chunks_gradient_is_freed_before_the_next_chunk(monkeypatch):
    grads, alive_at_call = [], []
    real = loss_mod._ce_and_grad

    def spy(logits, labels, want_grad):
        alive_at_call.append(sum(r() is not None for r in grads))
        loss, g = real(logits, labels, want_grad)
        grads.append(weakref.ref(g))
        return loss, g

    monkeypatch.setattr(loss_mod, "_ce_and_grad", spy)
    torch.manual_seed(0)
    h = torch.randn(40, 8, requires_grad=True)
    w = torch.randn(30, 8, requires_grad=True)
    labels = torch.randint(0, 30, (40,))
    total = loss_mod.linear_cross_entropy(h, w, labels, chunk=16)  # chunks of 16, 16, 8
    total.backward()
    assert alive_at_call == [0, 0, 0]
    want = torch.nn.functional.cross_entropy(h.detach() @ w.detach().t(), labels, reduction="sum")
    torch.testing.assert_close(total.detach(), want)


def test_per_token_logprobs_hold_one_chunk_of_logits_in_backward(monkeypatch):
    """linear_logprobs' backward makes each chunk's logits again: the previous chunk's logit gradient is gone before
    the next chunk's logits are made, and the forward keeps no logits at all (a logsumexp per token)."""
    grads, alive_at_call = [], []
    real = loss_mod._logprobs_grad

    def spy(logits, labels, lse, grad):
        alive_at_call.append(sum(r() is not None for r in grads))
        g = real(logits, labels, lse, grad)
        grads.append(weakref.ref(g))
        return g

    monkeypatch.setattr(loss_mod, "_logprobs_grad", spy)
    torch.manual_seed(0)
    h = torch.randn(40, 8, requires_grad=True)
    w = torch.randn(30, 8, requires_grad=True)
    labels = torch.randint(0, 30, (40,))
    logprobs = loss_mod.linear_logprobs(h, w, labels, chunk=16)  # chunks of 16, 16, 8
    saved = [t.shape for t in logprobs.grad_fn.saved_tensors]
    assert sorted(saved) == sorted([(40, 8), (30, 8), (40,), (40,)]), saved  # h, W, labels, logsumexp: no logits
    logprobs.sum().backward()
    assert alive_at_call == [0, 0, 0]
