"""FlashAttention-4's variable-length kernels (flash-attn-4, CuTe DSL kernels for Hopper and Blackwell) as the custom
ops moetune::fa4_varlen and its backward, which model.attn_implementation varlen_fa4 runs (model/attention.py), and
whether the installed flash-attn-4 can serve them."""

from __future__ import annotations

import inspect

import torch


def flash_attention_4_installed() -> bool:
    import importlib.util

    try:  # flash_attn may be FlashAttention-2's package, whose import can fail on its own extension
        return all(importlib.util.find_spec(name) is not None for name in ("flash_attn", "flash_attn.cute"))
    except ImportError:
        return False


# what moetune::fa4_varlen passes FlashAttention-4's forward and backward entry points (private functions: their
# signatures are checked before a run rather than trusted)
FA4_ARGUMENTS = (("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "causal", "return_lse"),
                 ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "causal"))


def fa4_incompatibility() -> str:
    """Why the installed flash-attn-4 cannot serve moetune::fa4_varlen, or "" where it can."""
    try:
        kernels = fa4_kernels()
    except (ImportError, OSError, RuntimeError) as e:  # installed, but its CuTe DSL or CUDA libraries do not load
        return f"flash-attn-4 does not import ({e})"
    missing = []
    for fn, names in zip(kernels, FA4_ARGUMENTS):
        params = inspect.signature(fn).parameters
        missing += [f"{fn.__name__}({name}=)" for name in names if name not in params]
    return (f"the installed flash-attn-4's entry points lack {', '.join(missing)} (moetune calls them as flash-attn-4 "
            f"4.0.0b40 defines them)") if missing else ""


def fa4_kernels():
    """FlashAttention-4's forward and backward entry points (flash_attn.cute.interface; tests replace this with
    reference stand-ins on the CPU)."""
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    return _flash_attn_fwd, _flash_attn_bwd


# FlashAttention-4's own autograd.Function is opaque to torch.compile; as custom ops the compiled layers call its
# kernels as they call any extern kernel, and a shape function lets Inductor plan around them.
@torch.library.custom_op("moetune::fa4_varlen", mutates_args=())
def fa4_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
               max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k/v [T, Hkv, D], cu_seqlens int32 [documents + 1] -> (out [T, Hq, Dv], lse fp32 [Hq, T]):
    causal attention within each document."""
    forward, _ = fa4_kernels()
    out, lse = forward(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_len,
                       max_seqlen_k=max_len, causal=True, return_lse=True)[:2]
    return out, lse


@fa4_varlen.register_fake
def _(q, k, v, cu_seqlens, max_len):
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


@torch.library.custom_op("moetune::fa4_varlen_backward", mutates_args=())
def fa4_varlen_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, cu_seqlens: torch.Tensor,
                        max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, backward = fa4_kernels()
    dq, dk, dv = backward(q, k, v, out, grad.contiguous(), lse, causal=True, cu_seqlens_q=cu_seqlens,
                          cu_seqlens_k=cu_seqlens, max_seqlen_q=max_len, max_seqlen_k=max_len)[:3]
    return dq, dk, dv


@fa4_varlen_backward.register_fake
def _(grad, q, k, v, out, lse, cu_seqlens, max_len):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fa4_varlen_setup(ctx, inputs, output):
    q, k, v, cu_seqlens, ctx.max_len = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_seqlens)


def _fa4_varlen_grad(ctx, grad, _grad_lse):  # lse is an output for the backward's sake only: no gradient flows in
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = torch.ops.moetune.fa4_varlen_backward(grad, q, k, v, out, lse, cu_seqlens, ctx.max_len)
    return dq, dk, dv, None, None


fa4_varlen.register_autograd(_fa4_varlen_grad, setup_context=_fa4_varlen_setup)
