"""Causal attention with document boundaries, by the best kernel the device has.

One document per row: SDPA's causal kernel (flash on GPU; FlashAttention-4's under `varlen_fa4`). Packed rows
(several documents, found where position_ids restart at 0): FlexAttention with a document-causal block mask on CUDA
(only the blocks on the diagonal of each document are computed), or a variable-length kernel over the documents of
the flattened rows: (`varlen`) FlashAttention-2's (torch.nn.attention.varlen) or (`varlen_fa4`) FlashAttention-4's
(CuTe DSL kernels for Hopper and Blackwell, with flash-attn-4 installed: model/flash_attention_4.py); SDPA with a dense
boolean mask elsewhere (their CPU-testable twin).
Decoding (KVCache): the new positions attend to every cached one, and causally among themselves.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn

from moetune.errors import ConfigError
from moetune.model import flash_attention_4 as fa4  # registers moetune::fa4_varlen, which attend_varlen calls
from moetune.model.step_inputs import unstaged

# torch 2.13's varlen_attn refuses fewer key/value heads than query heads unless told enable_gqa (2.11 has no such
# argument: FlashAttention-2 groups the heads either way)
VARLEN_TAKES_GQA = "enable_gqa" in inspect.signature(varlen_attn).parameters

# a BlockMask's tensors (torch.nn.attention.flex_attention.BlockMask._TENSOR_ATTRS; those a version lacks are skipped)
BLOCK_MASK_TENSORS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                      "q_indices", "full_q_num_blocks", "full_q_indices", "dq_write_order", "dq_write_order_full",
                      "dq_kv_order")

# The document mask's blocks by create_block_mask under torch.compile (a few kernels) instead of its eager vmap over
# the mask function, hundreds of small launches issued while the GPU waits at the start of each step (~12 ms of the
# idle GPU on one EP-8 rank of Air in the seventh session's trace). GLM-4.7-Flash through the trainer's step on packed
# demo rows: 20,707 tokens/s against 19,751 eager, one EP-8 rank of Air +0.7%, the same losses (thirty-second session;
# harness rows `_ebm`: the eager mask).
COMPILED_BLOCK_MASK = True

# model.attn_implementation -> the variable-length kernel for packed rows on a GPU
VARLEN_KERNELS = {"varlen": "fa2", "varlen_fa4": "fa4"}
# Where rows of one document each also go to the variable-length kernel rather than SDPA's causal kernel, so that the
# option means one kernel for every row: FlashAttention-4's costs nothing there (AIR-8's 4 × 1,024 rows −0.9% / +0.6%
# with CUDA graphs, GLM-4.7-Flash's one 4,096 row +1.6%, against cuDNN; thirty-second session). FlashAttention-2's
# varlen kernel took twice its own batched kernel's time on such rows (tenth session): `varlen` keeps SDPA for them.
ONE_DOCUMENT_KERNELS = ("varlen_fa4",)


@dataclass
class AttnMeta:
    dense_mask: torch.Tensor | None = None  # [B, 1, S, S] bool, SDPA path
    block_mask: object | None = None  # FlexAttention BlockMask
    cu_seqlens: torch.Tensor | None = None  # varlen path: int32 [documents + 1], their starts in the flattened rows
    max_len: int = 0  # varlen path: a bound on a document's length (the row's: one compiled graph for all batches)
    varlen_kernel: str = "fa2"  # varlen path: FlashAttention-2's kernel or FlashAttention-4's (VARLEN_KERNELS)


def document_ids(position_ids):
    return (position_ids == 0).cumsum(-1)


def dense_document_mask(position_ids):
    doc = document_ids(position_ids)
    S = position_ids.shape[-1]
    causal = torch.ones(S, S, dtype=torch.bool, device=position_ids.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal).unsqueeze(1)


def document_starts(position_ids) -> torch.Tensor:
    """FlashAttention's cu_seqlens for the rows flattened to [B·S]: int32 [documents + 1], each document's first
    position (where position_ids restart at 0, and every row's first), then B·S. One host sync (nonzero)."""
    B, S = position_ids.shape
    starts = position_ids == 0
    starts[:, 0] = True
    first = starts.reshape(-1).nonzero().reshape(-1)
    return torch.cat([first, first.new_full((1,), B * S)]).to(torch.int32)


def padded_document_starts(position_ids) -> torch.Tensor:
    """document_starts padded with empty documents (B·S repeated) to a power of two of them, at least 8: the layers
    are compiled with static shapes, and a batch's number of documents would otherwise recompile them for every
    new count (then fall back to eager at Dynamo's recompile limit); this way a few sizes serve every batch."""
    starts = document_starts(position_ids)
    documents = max(8, 1 << (starts.numel() - 2).bit_length())
    return torch.cat([starts, starts[-1:].expand(documents + 1 - starts.numel())])


def is_packed(position_ids) -> bool:
    # One host sync per step; a row holding one document needs only the causal kernel.
    return bool((position_ids[:, 1:] == 0).any())


def varlen_kernels_run(position_ids) -> bool:
    """Whether the variable-length kernels run where these rows are (a GPU; the CPU tests stand in for one here)."""
    return position_ids.is_cuda


def varlen_meta(position_ids, impl: str, stage=unstaged) -> AttnMeta:
    """The rows flattened for `impl`'s variable-length kernel: each document (a row of one document is one) causal."""
    return AttnMeta(cu_seqlens=stage("cu_seqlens", padded_document_starts(position_ids)),
                    max_len=position_ids.shape[-1], varlen_kernel=VARLEN_KERNELS[impl])


@functools.cache
def _compiled_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask, dynamic=False)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def check_attn_implementation(impl: str, device) -> None:
    """model.attn_implementation varlen_fa4 on a GPU that cannot run FlashAttention-4's kernels is a ConfigError naming
    why (off a GPU there is nothing to check: the CPU computes varlen_fa4 with the dense mask)."""
    device = torch.device(device)
    if impl != "varlen_fa4" or device.type != "cuda":
        return
    if torch.cuda.get_device_capability(device)[0] < 9:
        reason = f"FlashAttention-4 runs on Hopper or newer GPUs ({torch.cuda.get_device_name(device)} is not)"
    elif not fa4.flash_attention_4_installed():
        reason = 'FlashAttention-4 is not installed (pip install "moetune[fa4]")'
    elif problem := fa4.fa4_incompatibility():
        reason = problem
    else:
        return
    raise ConfigError(f"model.attn_implementation: varlen_fa4, but {reason}")


def build_attn_meta(position_ids, impl: str = "auto", stage=unstaged) -> AttnMeta:
    """stage(name, tensor): where the mask's tensors live (step_inputs.StepInputs: buffers that keep their addresses
    from step to step, for layers replayed as CUDA graphs)."""
    varlen_runs = varlen_kernels_run(position_ids)
    if impl in ONE_DOCUMENT_KERNELS and varlen_runs:  # every row, one document or several
        return varlen_meta(position_ids, impl, stage)
    if impl == "eager" or not is_packed(position_ids):
        return AttnMeta(dense_mask=stage("dense_mask", dense_document_mask(position_ids)) if impl == "eager" else None)
    if impl in VARLEN_KERNELS:  # their kernels run on a GPU only: the CPU takes the dense mask
        if not varlen_runs:
            return AttnMeta(dense_mask=stage("dense_mask", dense_document_mask(position_ids)))
        return varlen_meta(position_ids, impl, stage)
    use_flex = impl == "flex" or (impl == "auto" and position_ids.is_cuda)
    if not use_flex:
        return AttnMeta(dense_mask=stage("dense_mask", dense_document_mask(position_ids)))
    from torch.nn.attention.flex_attention import create_block_mask

    doc = stage("document_ids", document_ids(position_ids))  # what the mask function reads, forward and backward

    def doc_causal(b, h, q, kv):
        return (doc[b, q] == doc[b, kv]) & (q >= kv)

    B, S = position_ids.shape
    make = _compiled_create_block_mask() if COMPILED_BLOCK_MASK else create_block_mask
    mask = make(doc_causal, B, None, S, S, device=position_ids.device)
    for name in BLOCK_MASK_TENSORS:
        if getattr(mask, name, None) is not None:
            setattr(mask, name, stage(f"block_mask.{name}", getattr(mask, name)))
    return AttnMeta(block_mask=mask)


class KVCache:
    """What each attention module keeps of the positions already seen, so that a decoding step computes only its new
    positions. A module appends its per-position tensors with `extend` (keyed by the module itself: each GQA, MLA
    or indexer module decides what it keeps); the model's forward takes the step's mask from `attn_meta` and moves
    `length` on after its layers. Rows have one length (no padding)."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.length = 0  # positions cached by every layer
        self._buffers: dict[object, tuple[torch.Tensor, ...]] = {}

    def extend(self, owner, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Write `new` (each [B, S, ...], sequence second) at positions length..length+S of `owner`'s buffers
        (allocated for max_len positions on first use); return each buffer's positions 0..length+S."""
        end = self.length + new[0].shape[1]
        if end > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions; {end} asked")
        buffers = self._buffers.get(owner)
        if buffers is None:
            buffers = tuple(t.new_empty(t.shape[0], self.max_len, *t.shape[2:]) for t in new)
            self._buffers[owner] = buffers
        for buffer, t in zip(buffers, new):
            buffer[:, self.length:end] = t
        return tuple(buffer[:, :end] for buffer in buffers)

    def attn_meta(self, batch: int, new: int, device) -> AttnMeta:
        """New position i (absolute length + i) sees positions <= length + i: a dense mask, which sparse
        attention also reads as the keys its indexer may choose from."""
        start = self.length
        mask = torch.ones(batch, 1, new, start + new, dtype=torch.bool, device=device).tril_(diagonal=start)
        return AttnMeta(dense_mask=mask)


def attend(q, k, v, meta: AttnMeta):
    """q [B, Hq, S, D], k/v [B, Hkv, T, D] -> [B, Hq, S, D] (T > S only with a dense mask: a decoding step)."""
    if meta.block_mask is not None:
        return _compiled_flex()(q, k, v, block_mask=meta.block_mask, enable_gqa=True)
    if meta.cu_seqlens is not None:
        return attend_varlen(q, k, v, meta)
    if meta.dense_mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=meta.dense_mask, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def attend_varlen(q, k, v, meta: AttnMeta):
    """Document-causal attention over packed rows by a variable-length kernel (FlashAttention-2's or -4's): the rows
    flattened to [B·S, heads, D] (the layout the projections wrote: the transposes undo the callers'), one causal
    sequence per document. GQA as the kernels take it: fewer key/value heads, each shared by a group of query heads."""
    B, Hq, S, _ = q.shape

    def flat(t):
        return t.transpose(1, 2).reshape(B * S, t.shape[1], t.shape[-1])

    if meta.varlen_kernel == "fa4":
        o = torch.ops.moetune.fa4_varlen(flat(q), flat(k), flat(v), meta.cu_seqlens, meta.max_len)[0]
    else:
        gqa = {"enable_gqa": True} if VARLEN_TAKES_GQA and k.shape[1] != Hq else {}
        o = varlen_attn(flat(q), flat(k), flat(v), meta.cu_seqlens, meta.cu_seqlens, meta.max_len, meta.max_len,
                        window_size=(-1, 0), **gqa)
    return o.view(B, S, Hq, -1).transpose(1, 2)
