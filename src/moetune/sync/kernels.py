"""Fused expert kernels for the sender on CUDA (Triton): merge LoRA and cast to bf16, or (merge and) quantize to
block fp8, in one pass over the expert weights.

Why: with torch ops the merge is five passes over an fp32 copy of the experts (product, scale, add, cast, plus the
staging) and the quantization six more; on an H200 that takes longer than sending the result over NVLink, and the
sync would run at the speed of the packing. Here every weight element is read once (bf16) and written once (bf16 or
fp8), with no fp32 staging: on an H200 packing bf16 runs at ~3.4x the NVLink broadcast rate, fp8 at ~1.4x.

The arithmetic is the torch path's (sender.py, which the CPU tests hold bit-exact): x = W + scaling·(B·A) in fp32
then cast, or the block scale s = max|x|/448 and q = fp8(x / s) per 128×128 block. The rank-r product is summed in
another order and the add may fuse into an FMA, so x can differ from the torch path's by an fp32 rounding before
the final cast (benchmarks/weight_sync.py checks the two paths against each other on the GPU).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moetune.sync.fp8 import BLOCK, FP8_MAX


@triton.jit
def _merged_rows(W, B, a, row0, cols, R, C, scaling, sw_r, sw_c, sb_r, sb_k,
                 RANK: tl.constexpr, RANK_PAD: tl.constexpr, HAS_LORA: tl.constexpr, SUB: tl.constexpr):
    """x = W + scaling·B·A in fp32 for rows row0..row0+SUB of one expert (pointers already at that expert; `a` is
    the block's columns of A, [RANK_PAD, BLOCK], zero-padded past the rank)."""
    rows = row0 + tl.arange(0, SUB)
    rmask, cmask = rows < R, cols < C
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(W + rows[:, None] * sw_r + cols[None, :] * sw_c, mask=mask, other=0.0).to(tl.float32)
    if HAS_LORA:
        ks = tl.arange(0, RANK_PAD)
        b = tl.load(B + rows[:, None] * sb_r + ks[None, :] * sb_k, mask=rmask[:, None] & (ks < RANK)[None, :], other=0.0)
        # A dot reads the operands once per tile (a loop of rank-1 updates re-loads them for every k and was bound
        # on loads, 4x slower). "ieee": exact fp32 products, as the torch path (tf32x3 was slower here on an H200).
        x = x + tl.dot(b.to(tl.float32), a, input_precision="ieee") * scaling
    return x, rows, mask


@triton.autotune(configs=[triton.Config({"SUB": sub}, num_warps=w) for sub, w in
                          ((16, 4), (32, 4), (32, 8), (64, 8), (128, 8), (128, 16))],
                 key=["R", "C", "RANK", "HAS_LORA", "FP8"])
@triton.jit
def _expert_block(W, A, B, OUT, SCALE, R, C, scaling,
                  sw_e, sw_r, sw_c, sa_e, sa_k, sa_c, sb_e, sb_r, sb_k, so_e, so_r, so_c, ss_e, ss_r, ss_c,
                  RANK: tl.constexpr, RANK_PAD: tl.constexpr, HAS_LORA: tl.constexpr, FP8: tl.constexpr,
                  FP8_MAX: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr):
    """One BLOCK×BLOCK block of one expert (a quantization block for fp8), SUB rows at a time (a whole block of
    fp32 is 64 KiB of registers: it fits only with many warps, and autotune decides). fp8 with SUB < BLOCK takes
    two passes, one for the block's max, one to scale and store (re-reading the block from L2)."""
    pm, pn, e = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    W, B, OUT = W + e * sw_e, B + e * sb_e, OUT + e * so_e
    cols = pn * BLOCK + tl.arange(0, BLOCK)
    a = tl.zeros((RANK_PAD, BLOCK), dtype=tl.float32)
    if HAS_LORA:
        ks = tl.arange(0, RANK_PAD)
        a = tl.load(A + e * sa_e + ks[:, None] * sa_k + cols[None, :] * sa_c,
                    mask=(ks < RANK)[:, None] & (cols < C)[None, :], other=0.0).to(tl.float32)
    if FP8 and SUB == BLOCK:  # the whole block in registers: one pass
        x, rows, mask = _merged_rows(W, B, a, pm * BLOCK, cols, R, C, scaling, sw_r, sw_c, sb_r, sb_k,
                                     RANK, RANK_PAD, HAS_LORA, SUB)
        scale = tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0) / FP8_MAX, 1.1754943508222875e-38)
        tl.store(SCALE + e * ss_e + pm * ss_r + pn * ss_c, scale)
        x = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
        tl.store(OUT + rows[:, None] * so_r + cols[None, :] * so_c, x.to(OUT.dtype.element_ty), mask=mask)
        return
    if FP8:
        amax = 0.0
        for i in range(0, BLOCK // SUB):
            x, rows, mask = _merged_rows(W, B, a, pm * BLOCK + i * SUB, cols, R, C, scaling, sw_r, sw_c, sb_r, sb_k,
                                         RANK, RANK_PAD, HAS_LORA, SUB)
            amax = tl.maximum(amax, tl.max(tl.max(tl.abs(x), axis=1), axis=0))  # masked elements are 0
        scale = tl.maximum(amax / FP8_MAX, 1.1754943508222875e-38)
        tl.store(SCALE + e * ss_e + pm * ss_r + pn * ss_c, scale)
    for i in range(0, BLOCK // SUB):
        x, rows, mask = _merged_rows(W, B, a, pm * BLOCK + i * SUB, cols, R, C, scaling, sw_r, sw_c, sb_r, sb_k,
                                     RANK, RANK_PAD, HAS_LORA, SUB)
        if FP8:
            x = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
        tl.store(OUT + rows[:, None] * so_r + cols[None, :] * so_c, x.to(OUT.dtype.element_ty), mask=mask)


def merge_experts_(W: torch.Tensor, out: torch.Tensor, A: torch.Tensor | None = None, B: torch.Tensor | None = None,
                   scaling: float = 0.0, scale: torch.Tensor | None = None) -> None:
    """out[e] = cast(W[e] + scaling·B[e]·A[e]) for W, out [n, R, C] (views with any strides), A [n, r, C],
    B [n, R, r]; no LoRA when A is None. out bf16 (or any float), or fp8 with `scale` [n, ⌈R/128⌉, ⌈C/128⌉].
    The first call for each shape tries a few tile configurations (Triton's autotune) and keeps the fastest."""
    n, R, C = W.shape
    lora = A is not None
    A_, B_ = (A, B) if lora else (W, W)  # unused pointers when there is no LoRA
    rank = A.shape[1] if lora else 0
    ss = scale.stride() if scale is not None else (0, 0, 0)
    grid = (triton.cdiv(R, BLOCK), triton.cdiv(C, BLOCK), n)
    # Triton's CPU interpreter (the tests without a GPU) cannot time configurations: one fixed config there
    kernel, fixed = (_expert_block.fn, {"SUB": 32}) if os.environ.get("TRITON_INTERPRET") == "1" else (_expert_block, {})
    kernel[grid](W, A_, B_, out, scale if scale is not None else out, R, C, float(scaling),
                        *W.stride(), *A_.stride(), *B_.stride(), *out.stride(), *ss,
                        RANK=rank, RANK_PAD=max(16, triton.next_power_of_2(rank)), HAS_LORA=lora,
                        FP8=scale is not None, FP8_MAX=FP8_MAX,
                        BLOCK=BLOCK, **fixed)
