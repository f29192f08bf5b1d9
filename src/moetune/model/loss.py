"""Fused linear + cross-entropy: Σ CE(h·Wᵀ, labels) without ever holding [tokens, vocab] logits.

The loss is a sum, so d(loss)/d(logits) = softmax − onehot does not depend on anything that comes later:
forward computes it chunk by chunk, turns it at once into the gradients of h (and of W when W trains) and
drops the logits. Backward only scales those by the incoming scalar. Compared with checkpointing each chunk
this skips recomputing the lm_head GEMM (~20% of a LoRA step's FLOPs on GLM-4.5-Air's 151k vocabulary).

Per-token log-probabilities (`linear_logprobs`, what a custom loss of the step API reads) have a gradient that
depends on the loss made of them, known only in backward: forward keeps each token's logsumexp, backward makes
each chunk's logits again. Neither holds more than a chunk of [tokens, vocab].
"""

from __future__ import annotations

import functools

import torch

from moetune.names import IGNORE_INDEX, LOSS_CHUNK_TOKENS


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk: int):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = torch.zeros((), device=h.device, dtype=torch.float32)
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if need_w else None
        ce_chunk = _compiled(_ce_and_grad) if h.is_cuda else _ce_and_grad
        for s in range(0, h.shape[0], chunk):
            hs, ls = h[s : s + chunk], labels[s : s + chunk]
            loss, g = ce_chunk(hs @ weight.t(), ls, need_h or need_w)
            total += loss
            if g is not None:
                _add_chunk_grads(g, hs, weight, s, grad_h, grad_w)
            # unbound before the next chunk's logits and gradient are made: else three [chunk, vocab] tensors
            # live at once, not two (0.58 GiB more at the loss on GLM-4.5-Air's vocabulary)
            del g
        ctx.w_dtype = weight.dtype
        ctx.save_for_backward(grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
        gw = (grad_w * grad_out).to(ctx.w_dtype) if grad_w is not None else None
        return gh, gw, None, None


def _add_chunk_grads(g, hs, weight, start: int, grad_h, grad_w):
    """A chunk's d/dlogits g [c, V] into d/dh (rows start..start+c, set) and d/dW (fp32, summed); None: not wanted."""
    if grad_h is not None:
        grad_h[start : start + g.shape[0]] = g @ weight
    if grad_w is not None:
        grad_w += (g.t() @ hs).float()


def _logprobs(logits, labels):
    """(log p(labels) per row in fp32, 0 where labels is -100; each row's logsumexp)."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    target = logits.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    return torch.where(labels != IGNORE_INDEX, target - lse, 0.0), lse


def _logprobs_grad(logits, labels, lse, grad):
    """d(Σ grad·logprob)/dlogits = grad·(onehot − softmax) on valid rows, in the logits' dtype."""
    in_dtype = logits.dtype
    softmax = (logits.float() - lse[:, None]).exp()
    onehot = torch.nn.functional.one_hot(labels.clamp(min=0), logits.shape[-1]).to(softmax.dtype)
    return (torch.where(labels != IGNORE_INDEX, grad, 0.0)[:, None] * (onehot - softmax)).to(in_dtype)


def _ce_and_grad(logits, labels, want_grad: bool):
    """(Σ CE over valid rows, d/dlogits = softmax − onehot on valid rows in the logits' dtype, or None)."""
    logprobs, lse = _logprobs(logits, labels)
    if not want_grad:
        return -logprobs.sum(), None
    return -logprobs.sum(), _logprobs_grad(logits, labels, lse, -1.0)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int = LOSS_CHUNK_TOKENS):
    """Summed fp32 cross-entropy of logits h·Wᵀ against labels (-100 ignored). h [T, H], labels [T]."""
    return LinearCrossEntropy.apply(h, weight, labels, chunk)


class LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk: int):
        logprobs = torch.empty(h.shape[0], device=h.device, dtype=torch.float32)
        lse = torch.empty_like(logprobs)
        chunk_fn = _compiled(_logprobs) if h.is_cuda else _logprobs
        for s in range(0, h.shape[0], chunk):
            logprobs[s : s + chunk], lse[s : s + chunk] = chunk_fn(h[s : s + chunk] @ weight.t(), labels[s : s + chunk])
        ctx.chunk = chunk
        ctx.save_for_backward(h, weight, labels, lse)
        return logprobs

    @staticmethod
    def backward(ctx, grad_out):
        h, weight, labels, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if need_w else None
        grad_fn = _compiled(_logprobs_grad) if h.is_cuda else _logprobs_grad
        for s in range(0, h.shape[0], ctx.chunk):
            hs = h[s : s + ctx.chunk]
            g = grad_fn(hs @ weight.t(), labels[s : s + ctx.chunk], lse[s : s + ctx.chunk],
                        grad_out[s : s + ctx.chunk].float())
            _add_chunk_grads(g, hs, weight, s, grad_h, grad_w)
            del g  # before the next chunk's logits: two [chunk, vocab] tensors at once, not three
        return grad_h, grad_w.to(weight.dtype) if grad_w is not None else None, None, None


@functools.cache
def _compiled(fn):
    """On CUDA a chunk's elementwise part (fp32 cast, logsumexp, exp, one-hot) is fused into a few kernels."""
    return torch.compile(fn, dynamic=False)


def linear_logprobs(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int = LOSS_CHUNK_TOKENS):
    """log p(labels) [T] in fp32 under logits h·Wᵀ (0 where labels is -100), differentiable. h [T, H], labels [T]."""
    return LinearLogprobs.apply(h, weight, labels, chunk)
