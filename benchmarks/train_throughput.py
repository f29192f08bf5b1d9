"""Training throughput: moetune vs the HF transformers + PEFT reference, side by side in one GPU call.

    python benchmarks/train_throughput.py                      # the default variant list, 1 GPU
    python benchmarks/train_throughput.py --variants ours_qkvo_4x1024 hf_qkvo_4x1024
    python benchmarks/train_throughput.py --two-gpu            # adds FSDP2 on 2 GPUs (torchrun)
    python benchmarks/train_throughput.py --variants hf_flash_mla_1x4096 ours_flash_mla_1x4096 \
        hf_flash_mlaexperts_1x4096 ours_flash_mlaexperts_1x4096   # full-size GLM-4.7-Flash, 1 GPU

Each variant runs in its own process (peak memory is honest), warms up 3 steps and times 8 (median,
synchronised wall clock around forward + backward + optimizer). The AIR-8 proxy: GLM-4.5-Air shapes with 8
decoder layers, random bf16 N(0, 0.02) weights, random token ids. MFU₄ₚ = 4 × 2.72e9 × tokens/s / 989e12.
A step-time breakdown comes from one profiled step, kernels bucketed by name.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]
# name: (stack, batch, seq, lora targets, extra)
VARIANTS = {
    "hf_qkvo_4x1024": ("hf", 4, 1024, QKVO, {}),
    "ours_qkvo_4x1024": ("ours", 4, 1024, QKVO, {}),
    "ours_qkvo_4x1024_ac": ("ours", 4, 1024, QKVO, {"ac": "full"}),
    "ours_qkvo_4x1024_sac": ("ours", 4, 1024, QKVO, {"ac": "selective"}),
    "ours_qkvo_4x1024_eager": ("ours", 4, 1024, QKVO, {"compile": False}),
    "ours_qkvo_4x1024_skew": ("ours", 4, 1024, QKVO, {"skew": 1.2}),
    "hf_qkvo_1x4096": ("hf", 1, 4096, QKVO, {}),
    "ours_qkvo_1x4096": ("ours", 1, 4096, QKVO, {}),
    "ours_qkvo_2x8192_packed": ("ours", 2, 8192, QKVO, {"docs": 4}),
    "ours_qkvo_1x4096_packed": ("ours", 1, 4096, QKVO, {"docs": 4}),  # the shape of `moetune train` on AIR-8
    "hf_experts_4x1024": ("hf", 4, 1024, QKVO + ["experts"], {}),
    "ours_experts_4x1024": ("ours", 4, 1024, QKVO + ["experts"], {}),
    "ours_full_4x1024_2layers": ("ours", 4, 1024, None, {"layers": 2, "compile": True}),
    # local path, LoRA attention + experts: the trainer's step around the update; activation checkpointing
    "ours_experts_4x1024_guard": ("ours", 4, 1024, QKVO + ["experts"], {"guard": True}),
    "ours_experts_4x1024_ac": ("ours", 4, 1024, QKVO + ["experts"], {"ac": "full"}),
    "ours_experts_4x1024_acattn": ("ours", 4, 1024, QKVO + ["experts"], {"ac": "attention"}),
    "ours_experts_4x1024_acsplit": ("ours", 4, 1024, QKVO + ["experts"], {"ac": {"full": 4, "attention": 4}}),
    # 2 GPUs (torchrun), per-GPU batch 4x1024: FSDP2 over both, and expert parallelism EP=2
    "ours_fsdp2_qkvo_4x1024": ("ours", 4, 1024, QKVO, {"compile": True, "nproc": 2}),
    "ours_fsdp2_keep_qkvo_4x1024": ("ours", 4, 1024, QKVO, {"compile": True, "nproc": 2, "reshard": False}),
    "ours_hsdp2_qkvo_4x1024": ("ours", 4, 1024, QKVO, {"compile": True, "nproc": 2, "dp_shard": 1}),
    "ours_ep2_overlap_qkvo_4x1024": ("ours", 4, 1024, QKVO, {"compile": True, "nproc": 2, "ep": 2, "chunks": 2}),
    "ours_ep2_qkvo_4x1024": ("ours", 4, 1024, QKVO, {"compile": True, "nproc": 2, "ep": 2}),
    "ours_ep2_eager_qkvo_4x1024": ("ours", 4, 1024, QKVO, {"compile": False, "nproc": 2, "ep": 2}),
    "ours_ep2_skew_qkvo_4x1024": ("ours", 4, 1024, QKVO, {"compile": True, "nproc": 2, "ep": 2, "skew": 1.2}),
    "ours_ep2_experts_4x1024": ("ours", 4, 1024, QKVO + ["experts"], {"compile": True, "nproc": 2, "ep": 2}),
    "ours_hsdp2_experts_4x1024": ("ours", 4, 1024, QKVO + ["experts"], {"compile": True, "nproc": 2, "dp_shard": 1}),
    # full fine-tuning, 2 layers, FSDP2 over 2 GPUs, without and with CPU offload (fp32 master + AdamW on the host)
    "ours_fsdp2_full_4x1024_2layers": ("ours", 4, 1024, None, {"layers": 2, "compile": True, "nproc": 2}),
    "ours_fsdp2_full_offload_4x1024_2layers": ("ours", 4, 1024, None, {"layers": 2, "compile": True, "nproc": 2,
                                                                         "offload": True}),
    # one rank of EP=8 over full-size Air, on one GPU: 46 layers, 16 local experts, each token's 8 rows among
    # them (as many rows per rank as EP=8 delivers under balanced routing); the exchange is costed separately
    "ours_ep8rank_qkvo_1x4096": ("ours", 1, 4096, QKVO, {"layers": 46, "experts": 16, "compile": True}),
    "ours_ep8rank_qkvo_2x4096": ("ours", 2, 4096, QKVO, {"layers": 46, "experts": 16, "compile": True}),
    "ours_ep8rank_experts_1x4096": ("ours", 1, 4096, QKVO + ["experts"], {"layers": 46, "experts": 16,
                                                                          "compile": True}),
    # the same rank on packed rows (4 documents of 1,024 tokens per 4,096-token row, FlexAttention document masks),
    # the shape of a packed fine-tuning run: the causal attention work is a quarter of one 4,096-token document's
    "ours_ep8rank_qkvo_1x4096_packed": ("ours", 1, 4096, QKVO, {"layers": 46, "experts": 16, "compile": True,
                                                                "docs": 4}),
    # the expert-parallel dispatcher on a world of ONE GPU (torchrun, NCCL): every row goes to itself, so against
    # ours_qkvo_4x1024 this is what the dispatcher costs besides the network (graph break, eager work, host sync)
    "ours_ep1_qkvo_4x1024": ("ours", 4, 1024, QKVO, {"compile": True, "dispatch": True}),
    "ours_ep1_experts_4x1024": ("ours", 4, 1024, QKVO + ["experts"], {"compile": True, "dispatch": True}),
    # one EP-8 rank of full-size Air (as ours_ep8rank_qkvo_1x4096_packed) through the dispatcher on a world of one: the
    # rank's compute as a real EP rank runs it (the exchange's plan, gathers and graph break; not the network, and a
    # token travels as one row, not ~5.3), where the 8-GPU projection adds the dispatcher's cost measured on AIR-8
    "ours_ep8rank_qkvo_1x4096_packed_dispatch": ("ours", 1, 4096, QKVO, {"layers": 46, "experts": 16, "compile": True,
                                                                         "docs": 4, "dispatch": True}),
    "ours_ep1_experts_4x1024_ac": ("ours", 4, 1024, QKVO + ["experts"], {"compile": True, "dispatch": True,
                                                                          "ac": "full"}),
    "ours_ep1_experts_4x1024_acattn": ("ours", 4, 1024, QKVO + ["experts"], {"compile": True, "dispatch": True,
                                                                              "ac": "attention"}),
    # one rank of EP=2 over full-size Air, through the dispatcher on a world of one GPU: 46 layers, 64 local experts
    # (its weights: the same 106 GiB), 4 packed documents of 1,024 tokens, LoRA as the full-size 2-GPU run; what
    # that run costs besides the network, and its memory (a world of one receives each token once, EP 2 twice)
    **{f"ours_ep2rank_{name}_1x4096_packed{suffix}": (
        "ours", 1, 4096, targets, {"layers": 46, "experts": 64, "compile": True, "dispatch": True, "docs": 4, "ac": ac})
       for name, targets in (("qkvo", QKVO), ("experts", QKVO + ["shared_experts", "experts"]))
       for suffix, ac in (("", "none"), ("_ac", "full"), ("_acattn", "attention"),
                          ("_acsplit", {"full": 17, "attention": 29}))},  # the split auto picks on 2 × H200
}
# GLM-4.7-Flash (glm4_moe_lite, MLA) at FULL size (47 layers, 64 experts, bf16 base 56 GiB) on one GPU, seq 4096: LoRA
# on every MLA projection, and on them + the routed experts; against transformers' Glm4MoeLiteForCausalLM + PEFT
FLASH_MLA = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
FLASH_VARIANTS = {
    "hf_flash_mla_1x4096": ("hf", 1, 4096, FLASH_MLA, {"model": "glm47-flash"}),
    "ours_flash_mla_1x4096": ("ours", 1, 4096, FLASH_MLA, {"model": "glm47-flash"}),
    "ours_flash_mla_1x4096_eager": ("ours", 1, 4096, FLASH_MLA, {"model": "glm47-flash", "compile": False}),
    "hf_flash_mlaexperts_1x4096": ("hf", 1, 4096, FLASH_MLA + ["experts"], {"model": "glm47-flash"}),
    "ours_flash_mlaexperts_1x4096": ("ours", 1, 4096, FLASH_MLA + ["experts"], {"model": "glm47-flash"}),
    # the shape of `moetune train` (packed rows: FlexAttention with document masks)
    "ours_flash_mla_1x4096_packed": ("ours", 1, 4096, FLASH_MLA, {"model": "glm47-flash", "docs": 4}),
    # the demo data's shape (~23-token documents, 4,096-token packs): what `moetune train` without data.train runs
    "ours_flash_mla_1x4096_demo": ("ours", 1, 4096, FLASH_MLA, {"model": "glm47-flash", "docs": 128}),
    # with what `moetune train`'s step adds around the update (clipping, the bad-step guard's checks and copy)
    "ours_flash_mla_1x4096_demo_guard": ("ours", 1, 4096, FLASH_MLA, {"model": "glm47-flash", "docs": 128,
                                                                      "guard": True}),
    # the whole step of the step API (Trainer.step: built by the trainer's own setup, batch checks, clipping, the
    # guard, metrics) on the harness's batch: what `moetune train` adds beyond it is its data and loop
    "trainer_flash_mla_1x4096_demo": ("trainer", 1, 4096, FLASH_MLA, {"model": "glm47-flash", "docs": 128}),
    "trainer_flash_mla_1x4096": ("trainer", 1, 4096, FLASH_MLA, {"model": "glm47-flash"}),
    "trainer_fp8_flash_mla_1x4096": ("trainer", 1, 4096, FLASH_MLA, {"model": "glm47-flash", "quantize": "fp8"}),
}
VARIANTS.update(FLASH_VARIANTS)
# an fp8 frozen base (model.quantize): AIR-8 against the bf16 rows above, full-size Air on ONE GPU, Flash
FP8_VARIANTS = {
    "ours_fp8_qkvo_4x1024": ("ours", 4, 1024, QKVO, {"quantize": "fp8"}),
    # Trainer.step on AIR-8 (its setup resolves parallel.fp8_transposed_copies auto: kept where they fit)
    "trainer_qkvo_4x1024": ("trainer", 4, 1024, QKVO, {}),
    "trainer_fp8_qkvo_4x1024": ("trainer", 4, 1024, QKVO, {"quantize": "fp8"}),
    "ours_fp8_experts_4x1024": ("ours", 4, 1024, QKVO + ["experts"], {"quantize": "fp8"}),
    "ours_fp8block_qkvo_4x1024": ("ours", 4, 1024, QKVO, {"quantize": "fp8_block"}),
    "ours_fp8_qkvo_4x1024_eager": ("ours", 4, 1024, QKVO, {"quantize": "fp8", "compile": False}),
    "ours_fp8fast_qkvo_4x1024": ("ours", 4, 1024, QKVO, {"quantize": "fp8", "fast_accum_dgrad": True}),
    "ours_fp8_qkvo_1x4096_packed": ("ours", 1, 4096, QKVO, {"quantize": "fp8", "docs": 4}),
    **{f"ours_fp8_air_{name}_1x4096_packed{suffix}": (
        "ours", 1, 4096, targets, {"layers": 46, "quantize": "fp8", "docs": 4, "ac": ac})
       for name, targets in (("qkvo", QKVO), ("experts", QKVO + ["shared_experts", "experts"]))
       for suffix, ac in (("", "none"), ("_ac", "full"), ("_acattn", "attention"))},
    "ours_fp8_flash_mla_1x4096": ("ours", 1, 4096, FLASH_MLA, {"model": "glm47-flash", "quantize": "fp8"}),
    # one EP-8 rank of full-size Air (16 local experts, ~2,048 rows each) on an fp8 base: the large groups where the
    # fp8 grouped GEMM has room to beat bf16
    "ours_fp8_ep8rank_qkvo_1x4096_packed": ("ours", 1, 4096, QKVO, {"layers": 46, "experts": 16, "compile": True,
                                                                    "docs": 4, "quantize": "fp8"}),
    # the same rank through the expert-parallel dispatcher on a world of one (as the bf16 rank's _dispatch row)
    "ours_fp8_ep8rank_qkvo_1x4096_packed_dispatch": ("ours", 1, 4096, QKVO, {"layers": 46, "experts": 16,
                                                                             "compile": True, "docs": 4,
                                                                             "quantize": "fp8", "dispatch": True}),
    "ours_fp8_flash_mlaexperts_1x4096": ("ours", 1, 4096, FLASH_MLA + ["experts"],
                                         {"model": "glm47-flash", "quantize": "fp8"}),
}
VARIANTS.update(FP8_VARIANTS)
# packed rows through FlashAttention-2's variable-length kernel (model.attn_implementation varlen) instead of
# FlexAttention's document mask: each against the row it derives from, same call
for _base in ("ours_ep8rank_qkvo_1x4096_packed", "ours_fp8_ep8rank_qkvo_1x4096_packed", "ours_flash_mla_1x4096_packed",
              "ours_flash_mla_1x4096_demo", "ours_fp8_air_qkvo_1x4096_packed", "ours_fp8_air_experts_1x4096_packed_ac",
              "ours_fp8_qkvo_1x4096_packed"):
    _s, _b, _t, _tg, _x = VARIANTS[_base]
    VARIANTS[f"{_base}_varlen"] = (_s, _b, _t, _tg, {**_x, "attn": "varlen"})
# candidates of issue 21, each against the row it derives from (same call): SDPA forced to one kernel
# ("sdpa": cudnn | flash | efficient), torch.compile with CUDA graphs ("compile_mode": reduce-overhead)
for _base in ("ours_qkvo_4x1024", "ours_experts_4x1024", "ours_flash_mla_1x4096", "ours_flash_mlaexperts_1x4096",
              "ours_ep8rank_qkvo_1x4096", "ours_flash_mla_1x4096_demo", "ours_experts_4x1024_ac",
              "ours_ep8rank_qkvo_1x4096_packed", "ours_flash_mla_1x4096_packed"):
    _s, _b, _t, _tg, _x = VARIANTS[_base]
    VARIANTS[f"{_base}_cudnn"] = (_s, _b, _t, _tg, {**_x, "sdpa": "cudnn"})
    VARIANTS[f"{_base}_fa2"] = (_s, _b, _t, _tg, {**_x, "sdpa": "flash"})
    VARIANTS[f"{_base}_cg"] = (_s, _b, _t, _tg, {**_x, "compile_mode": "reduce-overhead"})
# Inductor's options against host-bound steps (Flash's demo rows: the GPU idles while the host launches): kernels
# launched from a C++ wrapper instead of Python (_cppw), independent kernels combined into one launch (_combo)
for _base in ("ours_flash_mla_1x4096", "ours_flash_mla_1x4096_demo", "ours_qkvo_4x1024",
              "ours_ep8rank_qkvo_1x4096_packed"):
    _s, _b, _t, _tg, _x = VARIANTS[_base]
    VARIANTS[f"{_base}_cppw"] = (_s, _b, _t, _tg, {**_x, "inductor": {"cpp_wrapper": True}})
    VARIANTS[f"{_base}_combo"] = (_s, _b, _t, _tg, {**_x, "inductor": {"combo_kernels": True}})
# the expert-parallel exchange's local work (plans, expert MLP, shared expert) compiled on its own (the dispatcher's
# `compiled`, the default where the layers are compiled: _epcompile as its base), and eager (_epeager)
for _base in ("ours_ep1_qkvo_4x1024", "ours_ep1_experts_4x1024", "ours_ep8rank_qkvo_1x4096_packed_dispatch",
              "ours_fp8_ep8rank_qkvo_1x4096_packed_dispatch", "ours_ep1_experts_4x1024_ac"):
    _s, _b, _t, _tg, _x = VARIANTS[_base]
    VARIANTS[f"{_base}_epcompile"] = (_s, _b, _t, _tg, {**_x, "ep_compile": True})
    VARIANTS[f"{_base}_epeager"] = (_s, _b, _t, _tg, {**_x, "ep_compile": False})
# an fp8 base's operands quantised in eager code op by op (quant.matmul.EAGER_QUANT "torch"; the default compiles
# each quantisation): the exchange's local work, an eager model
for _base in ("ours_fp8_ep8rank_qkvo_1x4096_packed_dispatch", "ours_fp8_qkvo_4x1024_eager"):
    _s, _b, _t, _tg, _x = VARIANTS[_base]
    VARIANTS[f"{_base}_tq"] = (_s, _b, _t, _tg, {**_x, "eager_quant": "torch"})
# the trainer's step with its layers replayed as CUDA graphs: on these rows the harness gained 37% from them,
# `moetune train` nothing (BENCHMARKS.md, issue 21's call 3); this row tells the step from the loop around it
VARIANTS["trainer_flash_mla_1x4096_demo_cg"] = (*VARIANTS["trainer_flash_mla_1x4096_demo"][:4],
                                                {**VARIANTS["trainer_flash_mla_1x4096_demo"][4],
                                                 "compile_mode": "reduce-overhead"})
# GLM-4.7-Flash's step through the trainer on an fp8 base within 50 GiB (no transposed copies kept: issue 20's
# target) and on the bf16 base, each also with its layers replayed as CUDA graphs (the fp8 step waits on the host)
VARIANTS["trainer_fp8_flash_mla_1x4096_nc"] = (*VARIANTS["trainer_fp8_flash_mla_1x4096"][:4],
                                               {**VARIANTS["trainer_fp8_flash_mla_1x4096"][4], "fp8_copies": False})
for _base in ("trainer_fp8_flash_mla_1x4096_nc", "trainer_flash_mla_1x4096", "trainer_fp8_flash_mla_1x4096"):
    VARIANTS[f"{_base}_cg"] = (*VARIANTS[_base][:4], {**VARIANTS[_base][4], "compile_mode": "reduce-overhead"})
# the frozen bf16 stacks' grouped GEMMs (experts.GROUPED_GEMM): the Triton TMA kernel (_tg, the default since the
# twenty-third session) or torch's _grouped_mm (_gt), with CUDA graphs too
for _base in ("ours_qkvo_4x1024", "ours_experts_4x1024", "ours_flash_mla_1x4096", "ours_flash_mlaexperts_1x4096",
              "ours_ep8rank_qkvo_1x4096", "ours_flash_mla_1x4096_cg", "ours_qkvo_4x1024_cg",
              "ours_ep8rank_qkvo_1x4096_cg"):
    _s, _b, _t, _tg, _x = VARIANTS[_base]
    VARIANTS[f"{_base}_tg"] = (_s, _b, _t, _tg, {**_x, "ggemm": "triton"})
    VARIANTS[f"{_base}_gt"] = (_s, _b, _t, _tg, {**_x, "ggemm": "torch"})
    # the TMA kernel a program a tile (before grouped_gemm_tma.TMA_PERSISTENT)
    VARIANTS[f"{_base}_tg1"] = (_s, _b, _t, _tg, {**_x, "ggemm": "triton", "tma_persistent": False})
# the fp8 base's expert stacks through the Triton kernels (model/quant/matmul.py): the input gradient W8A16 from the
# stack as stored (_gd), and the forward fp8 x fp8 too (_gdf)
for _base in ("ours_fp8_qkvo_4x1024", "ours_fp8_experts_4x1024", "ours_fp8_flash_mla_1x4096",
              "ours_fp8_flash_mlaexperts_1x4096", "ours_fp8_air_qkvo_1x4096_packed_acattn",
              "ours_fp8_air_experts_1x4096_packed_ac", "ours_fp8_qkvo_1x4096_packed"):
    _s, _b, _t, _tg, _x = VARIANTS[_base]
    VARIANTS[f"{_base}_gd"] = (_s, _b, _t, _tg, {**_x, "grouped_dgrad": "w8a16"})
    VARIANTS[f"{_base}_gdf"] = (_s, _b, _t, _tg, {**_x, "grouped_dgrad": "w8a16", "grouped_forward": "triton"})
    VARIANTS[f"{_base}_gf"] = (_s, _b, _t, _tg, {**_x, "grouped_forward": "triton"})
    # the input gradient fp8 x fp8 from the stack as stored (_g8), and with the forward's Triton kernel (_g8f)
    VARIANTS[f"{_base}_g8"] = (_s, _b, _t, _tg, {**_x, "grouped_dgrad": "w8a8"})
    VARIANTS[f"{_base}_g8f"] = (_s, _b, _t, _tg, {**_x, "grouped_dgrad": "w8a8", "grouped_forward": "triton"})
# the fp8 stacks' grouped GEMMs both through the Triton TMA kernel (Hopper): the forward, and the input gradient on
# the K-major copy (_tt); bf16 stacks take it with "_tg" above
for _base in ("ours_fp8_qkvo_4x1024", "ours_fp8_experts_4x1024", "ours_fp8_flash_mla_1x4096",
              "ours_fp8_ep8rank_qkvo_1x4096_packed", "ours_fp8_ep8rank_qkvo_1x4096_packed_dispatch"):
    _s, _b, _t, _tg, _x = VARIANTS[_base]
    VARIANTS[f"{_base}_tt"] = (_s, _b, _t, _tg, {**_x, "grouped_dgrad": "tma", "grouped_forward": "tma",
                                                 "tma_launch": "custom_op"})
    # launched by torch.compile's own code (a triton_op), with the kept copies
    VARIANTS[f"{_base}_tto"] = (_s, _b, _t, _tg, {**_x, "grouped_dgrad": "tma", "grouped_forward": "tma",
                                                  "tma_launch": "triton_op", "fp8_copies": True})
    # the fp8 weights' transposed copies kept for the run: with torch's kernels (_km) and the TMA kernel (_ttkm)
    VARIANTS[f"{_base}_km"] = (_s, _b, _t, _tg, {**_x, "fp8_copies": True})
    VARIANTS[f"{_base}_ttkm"] = (_s, _b, _t, _tg, {**_x, "grouped_dgrad": "tma", "grouped_forward": "tma",
                                                   "tma_launch": "custom_op", "fp8_copies": True})
    # no copies kept, each backward's K-major copy made by Inductor's transpose called through Dynamo (before the
    # copy kernel, quant.matmul.K_MAJOR_COPY)
    VARIANTS[f"{_base}_kc"] = (_s, _b, _t, _tg, {**_x, "k_major_copy": "compiled"})
    # the layers replayed as CUDA graphs (the fp8 base's Flash step waits on the host: BENCHMARKS.md, sixteenth
    # session), without and with the kept copies
    VARIANTS[f"{_base}_cg"] = (_s, _b, _t, _tg, {**_x, "compile_mode": "reduce-overhead"})
    VARIANTS[f"{_base}_kmcg"] = (_s, _b, _t, _tg, {**_x, "compile_mode": "reduce-overhead", "fp8_copies": True})
    # the input gradient fp8 x fp8 on the stacks as stored (no K-major copies: the TMA kernel's transposed product),
    # without and with the layers as CUDA graphs
    VARIANTS.setdefault(f"{_base}_g8", (_s, _b, _t, _tg, {**_x, "grouped_dgrad": "w8a8"}))
    VARIANTS[f"{_base}_g8cg"] = (_s, _b, _t, _tg, {**_x, "grouped_dgrad": "w8a8", "compile_mode": "reduce-overhead"})
    # every input gradient without a kept copy on a copy made in its backward (before quant.matmul's
    # STORED_DGRAD_MAX_ROWS), without and with the layers as CUDA graphs
    VARIANTS[f"{_base}_gc"] = (_s, _b, _t, _tg, {**_x, "stored_dgrad_max_rows": 0})
    VARIANTS[f"{_base}_gccg"] = (_s, _b, _t, _tg, {**_x, "stored_dgrad_max_rows": 0,
                                                  "compile_mode": "reduce-overhead"})
    # the stacks as stored moved byte by byte (before grouped_gemm_tma.TMA_SWAP_PAIRS), with the layers as CUDA graphs
    VARIANTS[f"{_base}_sbcg"] = (_s, _b, _t, _tg, {**_x, "swap_pairs": False, "compile_mode": "reduce-overhead"})
    # the TMA kernel a program a tile (before grouped_gemm_tma.TMA_PERSISTENT), without and with layers as CUDA graphs
    VARIANTS[f"{_base}_t1"] = (_s, _b, _t, _tg, {**_x, "tma_persistent": False})
    VARIANTS[f"{_base}_t1cg"] = (_s, _b, _t, _tg, {**_x, "tma_persistent": False, "compile_mode": "reduce-overhead"})
for _base in ("ours_ep8rank_qkvo_1x4096_packed", "ours_ep8rank_qkvo_1x4096_packed_dispatch"):
    _s, _b, _t, _tg, _x = VARIANTS[_base]
    VARIANTS[f"{_base}_tg"] = (_s, _b, _t, _tg, {**_x, "ggemm": "triton"})
# the twenty-fourth session's three changes undone (_pre24) or one at a time (_r32: the router's fp32 GEMM; _s64: the
# sort on int64 keys; _lsum: LoRA's product written, then added), each against its row, same call
_PRE24 = {"router_tensor_cores": False, "narrow_sort_keys": False, "lora_linear": "sum"}
for _base in ("ours_qkvo_4x1024", "ours_fp8_qkvo_4x1024", "ours_flash_mla_1x4096_cg", "ours_fp8_flash_mla_1x4096_cg",
              "ours_flash_mlaexperts_1x4096", "ours_experts_4x1024", "ours_ep8rank_qkvo_1x4096_packed",
              "ours_fp8_ep8rank_qkvo_1x4096_packed"):
    _s, _b, _t, _tg, _x = VARIANTS[_base]
    VARIANTS[f"{_base}_pre24"] = (_s, _b, _t, _tg, {**_x, **_PRE24})
    for _suffix, _key in (("_r32", "router_tensor_cores"), ("_s64", "narrow_sort_keys"), ("_lsum", "lora_linear")):
        VARIANTS[f"{_base}{_suffix}"] = (_s, _b, _t, _tg, {**_x, _key: _PRE24[_key]})
# a LoRA linear traced, its product added by an addmm (_ladd: lora.LORA_LINEAR "addmm", before the one op each way,
# "op"; on an fp8 base the op runs where the layers replay as CUDA graphs)
for _base in ("ours_qkvo_4x1024", "ours_flash_mla_1x4096_cg", "ours_flash_mla_1x4096", "ours_flash_mla_1x4096_demo_cg",
              "ours_ep8rank_qkvo_1x4096_packed", "ours_flash_mlaexperts_1x4096_cg", "ours_fp8_flash_mla_1x4096_cg"):
    _s, _b, _t, _tg, _x = VARIANTS[_base]
    VARIANTS[f"{_base}_ladd"] = (_s, _b, _t, _tg, {**_x, "lora_linear": "addmm"})
# the one op's branch always added in place (_lak0: lora.LORA_ALONG_K False), before it ran along the GEMM's reduction
# where the output is much wider than the input (MLA's q_b and kv_b)
for _base in ("ours_flash_mla_1x4096_cg", "ours_flash_mla_1x4096", "ours_flash_mla_1x4096_demo_cg",
              "ours_flash_mlaexperts_1x4096_cg"):
    _s, _b, _t, _tg, _x = VARIANTS[_base]
    VARIANTS[f"{_base}_lak0"] = (_s, _b, _t, _tg, {**_x, "lora_along_k": False})
# LoRA's branch on an fp8 weight added by cuBLAS's fp8 GEMM + an in-place add (_le0: quant.matmul.FP8_LORA_EPILOGUE
# False), before the TMA kernel made the whole product as one group with the branch in its epilogue (where the LoRA op
# runs: the _cg rows)
for _base in ("ours_fp8_flash_mla_1x4096_cg", "ours_fp8_qkvo_4x1024_cg"):
    _s, _b, _t, _tg, _x = VARIANTS[_base]
    VARIANTS[f"{_base}_le0"] = (_s, _b, _t, _tg, {**_x, "fp8_lora_epilogue": False})
# an fp8 base's dense GEMM operands quantised by the one-pass row kernel (_rq: quant.matmul.DENSE_QUANT "kernel") or
# by Inductor in the kernels producing them (_iq: "inductor"; the default "auto" takes the kernel where the layers
# replay as CUDA graphs, the _cg rows)
for _base in ("ours_fp8_qkvo_4x1024", "ours_fp8_flash_mla_1x4096_cg", "ours_fp8_flash_mla_1x4096",
              "ours_fp8_ep8rank_qkvo_1x4096_packed", "ours_fp8_qkvo_4x1024_ttkm"):
    _s, _b, _t, _tg, _x = VARIANTS[_base]
    VARIANTS[f"{_base}_rq"] = (_s, _b, _t, _tg, {**_x, "dense_quant": "kernel"})
    VARIANTS[f"{_base}_iq"] = (_s, _b, _t, _tg, {**_x, "dense_quant": "inductor"})
# expert LoRA written out and added (_xl0: experts.LORA_IN_EPILOGUE False), before its product in the TMA kernel's
# epilogue
for _base in ("ours_flash_mlaexperts_1x4096", "ours_flash_mlaexperts_1x4096_cg", "ours_experts_4x1024"):
    _s, _b, _t, _tg, _x = VARIANTS[_base]
    VARIANTS[f"{_base}_xl0"] = (_s, _b, _t, _tg, {**_x, "expert_lora_epilogue": False})
    # LoRA's thin products by torch's grouped GEMMs (_lk0: grouped_lora_kernels.LORA_KERNELS False)
    VARIANTS[f"{_base}_lk0"] = (_s, _b, _t, _tg, {**_x, "lora_kernels": False})
# the compiled SwiGLU's backward as Inductor's traced ops (_sw0), before experts.SWIGLU_BACKWARD "kernel"
for _base in ("ours_qkvo_4x1024", "ours_flash_mla_1x4096_cg", "ours_flash_mla_1x4096", "ours_flash_mlaexperts_1x4096",
              "ours_flash_mlaexperts_1x4096_cg", "ours_experts_4x1024", "ours_ep8rank_qkvo_1x4096_packed"):
    _s, _b, _t, _tg, _x = VARIANTS[_base]
    VARIANTS[f"{_base}_sw0"] = (_s, _b, _t, _tg, {**_x, "swiglu_backward": "inductor"})
# Inductor's reductions along rows (the fp8 quantisations, the norms): the looped and the one-pass form both generated
# and the faster picked at run time (_mk, Inductor's multi_kernel)
for _base in ("ours_qkvo_4x1024", "ours_fp8_qkvo_4x1024", "ours_fp8_qkvo_4x1024_ttkm", "ours_flash_mla_1x4096",
              "ours_fp8_flash_mla_1x4096", "ours_fp8_flash_mla_1x4096_ttkm", "ours_ep8rank_qkvo_1x4096_packed",
              "ours_fp8_ep8rank_qkvo_1x4096_packed", "ours_flash_mlaexperts_1x4096", "ours_experts_4x1024"):
    _s, _b, _t, _tg, _x = VARIANTS[_base]
    VARIANTS[f"{_base}_mk"] = (_s, _b, _t, _tg, {**_x, "inductor": {"triton.multi_kernel": 1}})
# an fp8 base's routed experts GEMM by GEMM, the SwiGLU and its quantisations compiled by Inductor between them (before
# quant.matmul.fp8_expert_mlp)
for _base in ("ours_fp8_qkvo_4x1024", "ours_fp8_qkvo_4x1024_ttkm", "ours_fp8_flash_mla_1x4096",
              "ours_fp8_flash_mla_1x4096_ttkm", "ours_fp8_ep8rank_qkvo_1x4096_packed",
              "ours_fp8_ep8rank_qkvo_1x4096_packed_tto", "ours_fp8_flash_mla_1x4096_cg"):
    _s, _b, _t, _tg, _x = VARIANTS[_base]
    VARIANTS[f"{_base}_nf"] = (_s, _b, _t, _tg, {**_x, "fused_expert_mlp": False})
# every row through FlashAttention-4's variable-length kernels (model.attn_implementation varlen_fa4; flash-attn-4
# installed, benchmarks/fa4_carry.sh) instead of FlexAttention's document mask (packed rows) or SDPA's causal kernel
# (rows of one document), each against its row
for _base in ("ours_ep8rank_qkvo_1x4096_packed", "ours_ep8rank_qkvo_1x4096_packed_cg", "ours_flash_mla_1x4096_packed",
              "ours_fp8_ep8rank_qkvo_1x4096_packed", "ours_ep8rank_qkvo_1x4096_packed_dispatch", "ours_qkvo_4x1024",
              "ours_qkvo_4x1024_cg", "ours_experts_4x1024", "ours_flash_mla_1x4096_cg", "ours_fp8_qkvo_4x1024",
              "ours_flash_mla_1x4096_packed_cg"):
    _s, _b, _t, _tg, _x = VARIANTS[_base]
    VARIANTS[f"{_base}_fa4"] = (_s, _b, _t, _tg, {**_x, "attn": "varlen_fa4"})
# the document mask made eagerly at the start of each step (_ebm), before create_block_mask under torch.compile
# (attention.COMPILED_BLOCK_MASK, the default), each against its row
for _base in ("ours_ep8rank_qkvo_1x4096_packed", "ours_ep8rank_qkvo_1x4096_packed_cg", "ours_flash_mla_1x4096_demo_cg",
              "trainer_flash_mla_1x4096_demo_cg"):
    _s, _b, _t, _tg, _x = VARIANTS[_base]
    VARIANTS[f"{_base}_ebm"] = (_s, _b, _t, _tg, {**_x, "compiled_block_mask": False})
# the permutation's gathers written out before the grouped GEMMs (_mg), against the default (experts.GATHER_IN_GEMM:
# frozen bf16 stacks read them in the kernels' loads, expert LoRA in the TMA kernel's epilogue or none; through the
# dispatcher, the expansion of the rows a rank received)
for _base in ("ours_ep8rank_qkvo_1x4096_packed_cg", "ours_ep8rank_qkvo_1x4096_packed_cg_fa4", "ours_qkvo_4x1024",
              "ours_qkvo_4x1024_cg", "ours_flash_mla_1x4096_cg", "ours_ep8rank_qkvo_1x4096_packed_dispatch",
              "ours_experts_4x1024", "ours_flash_mlaexperts_1x4096_cg"):
    _s, _b, _t, _tg, _x = VARIANTS[_base]
    VARIANTS[f"{_base}_mg"] = (_s, _b, _t, _tg, {**_x, "gather_in_gemm": False})
# each LoRA linear its own op, its branch added in place after the base GEMM (_sep: lora.JOINT_INPUTS and LORA_FIRST
# off, the form before the thirty-fifth session), against LoRA linears of one input as one op, branches written first
for _base in ("ours_ep8rank_qkvo_1x4096_packed_cg", "ours_ep8rank_qkvo_1x4096_packed_cg_fa4", "ours_qkvo_4x1024",
              "ours_qkvo_4x1024_cg", "ours_flash_mla_1x4096_cg", "ours_flash_mlaexperts_1x4096_cg",
              "ours_experts_4x1024", "ours_fp8_qkvo_4x1024_cg", "ours_fp8_flash_mla_1x4096_cg"):
    _s, _b, _t, _tg, _x = VARIANTS[_base]
    VARIANTS[f"{_base}_sep"] = (_s, _b, _t, _tg, {**_x, "joint_inputs": False, "lora_first": False})
# one EP-8 rank through the dispatcher with the compiled parts of its layers (before and after the exchange, a graph
# break) replayed as CUDA graphs, the exchange eager between them (_cg): on one GPU the dispatcher's step waits on the
# host (BENCHMARKS.md, thirty-sixth session)
for _base in ("ours_ep8rank_qkvo_1x4096_packed_dispatch", "ours_ep8rank_qkvo_1x4096_packed_dispatch_fa4",
              "ours_ep1_qkvo_4x1024"):
    _s, _b, _t, _tg, _x = VARIANTS[_base]
    VARIANTS[f"{_base}_cg"] = (_s, _b, _t, _tg, {**_x, "compile_mode": "reduce-overhead"})
    # and the exchange's local work compiled on its own (the default where the layers are compiled), and eager
    VARIANTS[f"{_base}_cg_epcompile"] = (_s, _b, _t, _tg, {**_x, "compile_mode": "reduce-overhead",
                                                          "ep_compile": True})
    VARIANTS[f"{_base}_cg_epeager"] = (_s, _b, _t, _tg, {**_x, "compile_mode": "reduce-overhead",
                                                        "ep_compile": False})
# transformers' best setting that fits: every HF variant also runs without gradient checkpointing (faster when it
# fits; an out-of-memory there is a result, and the table compares against the faster of the two that ran)
VARIANTS.update({f"{k}_nogc": (v[0], v[1], v[2], v[3], {**v[4], "gc": False})
                 for k, v in list(VARIANTS.items()) if v[0] == "hf"})
# the HF row each of them is compared with in the table
FAMILY_REFERENCE = {k: ("hf_flash_mlaexperts_1x4096" if "mlaexperts" in k else "hf_flash_mla_1x4096")
                    for k in FLASH_VARIANTS if k.startswith("ours_")}
# the CPU rehearsal's stand-in for GLM-4.7-Flash: its architecture (MLA with q_lora_rank, v = nope + rope) tiny
TINY_FLASH = dict(model_type="glm4_moe_lite", vocab_size=160, hidden_size=128, intermediate_size=384,
                  moe_intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                  n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=24,
                  qk_rope_head_dim=8, v_head_dim=32, pad_token_id=0, eos_token_id=0)
for _k, _v in list(VARIANTS.items()):
    if _v[0] == "ours" and "nproc" not in _v[4] and not _k.endswith("_compile"):
        _v[4].setdefault("compile", True)  # torch.compile per block is the default for our GPU numbers
DEFAULT = ["hf_qkvo_4x1024", "ours_qkvo_4x1024", "ours_qkvo_1x4096", "ours_qkvo_2x8192_packed",
           "hf_experts_4x1024", "ours_experts_4x1024", "ours_qkvo_4x1024_skew", "ours_full_4x1024_2layers"]
PEAK = 989e12


def air8(layers=8, experts=None) -> dict:
    from moetune.model.config import BUILTIN

    cfg = dict(BUILTIN["glm45-air"], num_hidden_layers=layers)
    if experts:
        cfg["n_routed_experts"] = experts
    return cfg


def active_params(cfg: dict) -> int:
    from moetune.model.config import ModelConfig
    from moetune.train.metrics import active_matmul_params

    return active_matmul_params(ModelConfig.from_hf_dict(cfg))


def make_batch(B, S, vocab, docs, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    if docs > 1:  # packed: `docs` documents of equal length per row, positions restart, no cross-doc targets
        L = S // docs
        pos = torch.arange(S) % L
        labels[:, L - 1 :: L] = -100
        pos = pos.expand(B, S).contiguous()
    else:
        pos = torch.arange(S).expand(B, S).contiguous()
    return ids.to(device), labels.to(device), pos.to(device)


# ------------------------------------------------------------------------------------------------- workers
def build_ours(cfg: dict, targets, extra, device):
    from moetune.model.config import ModelConfig
    from moetune.model.hf_io import build_model, cast_model, init_weights
    from moetune.model.lora import apply_lora
    from moetune.parallel.apply import apply_ac, apply_compile
    from moetune.train.setup import init_lora

    mcfg = ModelConfig.from_hf_dict(cfg)
    model = build_model(mcfg, "meta")
    full = targets is None
    # full fine-tuning under FSDP keeps fp32 master weights (bf16 compute), as `moetune train` does
    cast_model(model, torch.float32 if full and extra.get("nproc", 1) > 1 else torch.bfloat16)
    if extra.get("quantize"):  # an fp8 frozen base (model.quantize): the same random draw, quantised
        from moetune.model.quant.fp8 import scheme_named
        from moetune.model.quant.modules import quantize_model

        quantize_model(model, scheme_named(extra["quantize"]))
        if "fast_accum_dgrad" in extra:  # a candidate setting, measured against the default
            import moetune.model.quant.matmul as fp8_matmul

            fp8_matmul.FAST_ACCUM_DGRAD = extra["fast_accum_dgrad"]
        import moetune.model.quant.matmul as fp8_matmul

        fp8_matmul.GROUPED_DGRAD = extra.get("grouped_dgrad", fp8_matmul.GROUPED_DGRAD)
        fp8_matmul.STORED_DGRAD_MAX_ROWS = extra.get("stored_dgrad_max_rows", fp8_matmul.STORED_DGRAD_MAX_ROWS)
        fp8_matmul.EAGER_QUANT = extra.get("eager_quant", fp8_matmul.EAGER_QUANT)
        fp8_matmul.GROUPED_FORWARD = extra.get("grouped_forward", fp8_matmul.GROUPED_FORWARD)
        fp8_matmul.TMA_LAUNCH = extra.get("tma_launch", fp8_matmul.TMA_LAUNCH)
        fp8_matmul.K_MAJOR_COPY = extra.get("k_major_copy", fp8_matmul.K_MAJOR_COPY)
        fp8_matmul.FUSED_EXPERT_MLP = extra.get("fused_expert_mlp", fp8_matmul.FUSED_EXPERT_MLP)
        fp8_matmul.DENSE_QUANT = extra.get("dense_quant", fp8_matmul.DENSE_QUANT)
        fp8_matmul.FP8_LORA_EPILOGUE = extra.get("fp8_lora_epilogue", fp8_matmul.FP8_LORA_EPILOGUE)
    import moetune.model.experts as experts_module
    import moetune.model.glm4_moe as glm4_moe_module
    import moetune.model.grouped_gemm_tma as grouped_gemm_tma_module
    import moetune.model.grouped_lora_kernels as grouped_lora_kernels_module
    import moetune.model.lora as lora_module

    if extra.get("ggemm"):  # a candidate setting, measured against the default
        experts_module.GROUPED_GEMM = extra["ggemm"]
    if "swap_pairs" in extra:  # an fp8 stack as stored moved as int16 pairs (True, the default) or bytes
        grouped_gemm_tma_module.TMA_SWAP_PAIRS = extra["swap_pairs"]
    # the twenty-fourth session's (each True by default; False: the form before it): the router's logits on tensor
    # cores, the permutation's sort on narrow keys; and how a LoRA linear adds its product (lora.LORA_LINEAR)
    glm4_moe_module.ROUTER_TENSOR_CORES = extra.get("router_tensor_cores", glm4_moe_module.ROUTER_TENSOR_CORES)
    experts_module.NARROW_SORT_KEYS = extra.get("narrow_sort_keys", experts_module.NARROW_SORT_KEYS)
    lora_module.LORA_LINEAR = extra.get("lora_linear", lora_module.LORA_LINEAR)
    lora_module.LORA_ALONG_K = extra.get("lora_along_k", lora_module.LORA_ALONG_K)
    lora_module.LORA_FIRST = extra.get("lora_first", lora_module.LORA_FIRST)
    lora_module.JOINT_INPUTS = extra.get("joint_inputs", lora_module.JOINT_INPUTS)
    # the compiled SwiGLU's backward as one row kernel ("kernel", the default) or Inductor's traced ops
    experts_module.SWIGLU_BACKWARD = extra.get("swiglu_backward", experts_module.SWIGLU_BACKWARD)
    experts_module.LORA_IN_EPILOGUE = extra.get("expert_lora_epilogue", experts_module.LORA_IN_EPILOGUE)
    experts_module.GATHER_IN_GEMM = extra.get("gather_in_gemm", experts_module.GATHER_IN_GEMM)
    grouped_lora_kernels_module.LORA_KERNELS = extra.get("lora_kernels", grouped_lora_kernels_module.LORA_KERNELS)
    if "tma_persistent" in extra:  # the TMA kernel a program a tile (False) or an SM (True, the default)
        grouped_gemm_tma_module.TMA_PERSISTENT = extra["tma_persistent"]
    if not full:
        apply_lora(model, targets, 16, 32)
    model.attn_implementation = extra.get("attn", "auto")  # model.attn_implementation (packed rows: flex, varlen)
    apply_ac(model, extra.get("ac", "none"))
    if extra.get("compile"):
        import torch._inductor.config as inductor_config

        for option, value in extra.get("inductor", {}).items():  # a candidate: Inductor options for every graph
            setattr(inductor_config, option, value)
        apply_compile(model, mode=extra.get("compile_mode"))  # a candidate: another mode (reduce-overhead)
    if extra.get("nproc", 1) > 1 or extra.get("dispatch"):
        from moetune.parallel.apply import apply_ep, apply_fsdp
        from moetune.parallel.layout import make_layout
        from moetune.parallel.mesh import init_distributed, launch_world_size

        layout = make_layout(launch_world_size(), extra.get("ep", 1), extra.get("dp_shard", -1),
                             extra.get("ac", "none"), extra.get("offload", False), n_layers=mcfg.num_hidden_layers)
        dist = init_distributed(layout)
        # the exchange's local work compiled on its own where the layers are (the trainer's choice), or as the row says
        ep_compiled = extra.get("ep_compile", bool(extra.get("compile")))
        if extra.get("ep", 1) > 1:
            apply_ep(model, dist.mesh["ep"], overlap_chunks=extra.get("chunks", 1), compiled=ep_compiled)
        elif extra.get("dispatch"):
            from torch.distributed.device_mesh import init_device_mesh

            apply_ep(model, init_device_mesh(dist.device.type, (1,), mesh_dim_names=("ep",)), compiled=ep_compiled)
        if layout.fsdp:
            apply_fsdp(model, dist.mesh, param_dtype=torch.bfloat16, reshard_after_forward=extra.get("reshard", True),
                       cpu_offload=extra.get("offload", False))
        model.dist = dist  # the step all-reduces what FSDP does not manage (replicas, EP-only experts)
    model.to_empty(device="cpu" if extra.get("offload") else device)
    init_weights(model, 0.02, seed=0)
    init_lora(model, seed=0)
    if extra.get("offload"):
        from moetune.parallel.apply import place_buffers

        place_buffers(model, device)
    if extra.get("fp8_copies"):  # the fp8 weights' transposed copies kept for the run (Layout.fp8_copies)
        from moetune.model.quant.modules import keep_transposed_copies

        keep_transposed_copies(model)
    if extra.get("skew"):  # Zipf-distributed correction bias: a few experts take most tokens, as trained routers do
        E = mcfg.n_routed_experts
        zipf = 1.0 / torch.arange(1, E + 1, dtype=torch.float32) ** extra["skew"]
        with torch.no_grad():
            for moe in model.moe_layers():
                moe.gate.e_score_correction_bias.copy_((zipf[torch.randperm(E)] * 0.5).to(device))
    return model


def trainer_step_fn(cfg: dict, targets, B: int, S: int, dev, compile_mode: str | None = None,
                    quantize: str | None = None, fp8_copies: bool | None = None, overrides: list | None = None):
    """Trainer.step (the step API) on a model its own setup builds from `cfg` (random weights, compiled per layer
    on a GPU, layout manual: no recompute), no data: the harness's batch is passed in. compile_mode: a candidate
    (reduce-overhead: the layers replay as CUDA graphs), through the trainer's own compile; quantize: model.quantize
    (an fp8 base); fp8_copies: parallel.fp8_transposed_copies (None: auto, which keeps them where they fit);
    overrides: more of the CLI's `--key value` pairs, last."""
    import functools
    import tempfile

    import moetune.parallel.apply as parallel_apply
    from moetune.config.overrides import load_config
    from moetune.train.trainer import Trainer

    graphs = compile_mode == "reduce-overhead" and dev.type == "cuda"  # the trainer's own option (train.cuda_graphs)
    if compile_mode and not graphs:  # another mode: the trainer's setup compiles through parallel.apply.apply_compile
        parallel_apply.apply_compile = functools.partial(parallel_apply.apply_compile, mode=compile_mode)

    folder = tempfile.mkdtemp(prefix="bench_trainer_")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    run_cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "glm45-air-lora.yaml"), [
        "--model.path", "null", "--model.config", os.path.join(folder, "config.json"), "--model.init_std", "0.02",
        "--model.dtype", "bfloat16", "--data.train", "null", "--data.eval", "null", "--data.seq_len", str(S),
        "--lora.targets", "[" + ",".join(targets) + "]", "--train.micro_batch_size", str(B), "--train.grad_accum", "1",
        "--train.activation_checkpointing", "none", "--train.compile", str(dev.type == "cuda").lower(),
        "--train.steps", "1000", "--eval.every", "0", "--logging.progress_bar", "false", "--logging.report_to", "[]",
        "--checkpoint.every", "0", "--parallel.layout", "manual", "--run.output_dir", folder, "--resume", "none",
        *(["--model.quantize", quantize] if quantize else []), *(["--train.cuda_graphs", "true"] if graphs else []),
        *(["--parallel.fp8_transposed_copies", str(fp8_copies).lower()] if fp8_copies is not None else []),
        *(overrides or [])])
    trainer = Trainer(run_cfg, data=False).__enter__()

    def step(ids, labels, pos):
        batch = {"input_ids": ids, "labels": labels} | ({"position_ids": pos} if pos is not None else {})
        return torch.tensor(trainer.step(batch).loss)

    return trainer.model, step


def sdpa_context():
    """The SDPA kernel a variant forces (`sdpa` extra, via BENCH_SDPA), else no constraint."""
    import contextlib

    name = os.environ.get("BENCH_SDPA")
    if not name:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([{"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                         "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]])


def ours_step_fn(model, full: bool, offload: bool = False, guard: bool = False):
    """guard: around the update, what `moetune train`'s step adds (train/loop.py train_step): gradient clipping, the
    bad-step guard's checks and its copy of the LoRA state to host memory."""
    from types import SimpleNamespace

    from moetune.parallel.grads import clip_grad_norm
    from moetune.train.bad_steps import StepGuard
    from moetune.train.optim import build_optimizer

    params = [p for p in model.parameters() if p.requires_grad]
    # the trainer's AdamW (its param groups keep EP's DTensor experts apart from plain tensors); offload: on the host
    opt = build_optimizer(params, SimpleNamespace(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                                  fused=not (offload or CPU_DRY_RUN)), torch.device("cuda"))
    device = params[0].device
    guarded = StepGuard(params, opt, SimpleNamespace(device=device, all_reduce_sum=lambda t: t),
                        rollback=not full) if guard else None
    n = [0]

    def step(ids, labels, pos):
        with sdpa_context():
            return _step(ids, labels, pos)

    def _step(ids, labels, pos):
        loss = model(ids, pos, labels=labels) / (labels != -100).sum()
        if guard:
            guarded.start_copy()  # as the trainer: the rollback copy's transfer runs under the backward
        loss.backward()
        if hasattr(model, "dist"):
            from moetune.parallel.grads import sync_replicated_grads

            sync_replicated_grads(params, model.dist)
        if guard:
            n[0] += 1
            clip_grad_norm(params, 1.0)
            float(loss)
            guarded.before_update(n[0])
        opt.step()
        if guard:
            guarded.record(n[0], guarded.weights_finite(), True)
        opt.zero_grad(set_to_none=True)
        return loss

    return step


BUCKETS = [  # (bucket, substrings of CUDA kernel names), first match wins
    ("attention", ["flash", "fmha", "attention", "flex", "sdpa", "triton_tem_fused"]),
    # torch's grouped_mm is its own CUTLASS 3.x kernel (at::cuda::detail ... enable_3x_kernel_for_sm9x); dense
    # GEMMs come from cuBLAS (nvjet / xmma)
    ("experts_grouped_gemm", ["grouped", "group_gemm", "GroupedGemm", "gemm_grouped", "enable_3x_kernel_for_sm9x",
                              "4cuda6detail"]),
    ("optimizer", ["adam", "Adam", "multi_tensor"]),
    ("communication", ["nccl", "ncclDevKernel"]),
    ("loss_softmax", ["logsumexp", "softmax", "log_softmax", "nll", "cross_entropy"]),
    ("permutation_router", ["sort", "Sort", "radix", "bincount", "histogram", "index", "gather", "scatter", "topk",
                            "cumsum", "scan", "bitonic"]),
    ("dense_gemm", ["gemm", "Gemm", "cublas", "xmma", "cutlass", "sm90"]),
]


# Inductor's element-wise kernels are named after the ops they fuse ("triton_red_fused__to_copy_abs_amax_..._grouped_mm
# _fp8_..." is an fp8 quantisation next to a grouped GEMM): never a GEMM, whatever their names hold
INDUCTOR_ELEMENTWISE = ("triton_poi", "triton_red", "triton_per")
GEMM_BUCKETS = ("experts_grouped_gemm", "dense_gemm")


def bucket(kernel: str) -> str:
    fused = kernel.startswith(INDUCTOR_ELEMENTWISE)
    return next((b for b, keys in BUCKETS if not (fused and b in GEMM_BUCKETS) and any(k in kernel for k in keys)),
                "elementwise_other")


class GraphRecordings:
    """CUDA graph trees (layers compiled with mode "reduce-overhead") over the timed steps: how many graphs they
    recorded (none once every layer replays) and the first reasons a recorded graph could not be replayed (its
    invariants: static inputs' addresses, memory the pool manages, what was alive at recording). A step that
    re-records each time runs ~10x slower than one without graphs (twenty-seventh session's EP-8 rank, 740 tokens/s)."""

    def __enter__(self):
        from torch._inductor import cudagraph_trees as trees

        self.recorded, self.reasons, self._saved = 0, [], []

        def counting(record):
            def f(manager, *args, **kwargs):
                self.recorded += 1
                return record(manager, *args, **kwargs)
            return f

        def noting(check):
            def f(node, *args, **kwargs):
                status, logger = check(node, *args, **kwargs)
                if status != trees.CheckInvariantStatus.SUCCESS and len(self.reasons) < 4:
                    try:
                        # the reason's first line and its innermost frames (the stack trace ends where the input
                        # was used)
                        text = f"{status}: {logger()}"
                        self.reasons.append(text if len(text) <= 1200 else f"{text[:300]} ... {text[-900:]}")
                    except Exception as e:  # the reason's text is a nice-to-have
                        self.reasons.append(f"{status} ({type(e).__name__} formatting it)")
                return status, logger
            return f

        for cls_name, name, wrap in (("CUDAGraphTreeManager", "record_function", counting),
                                     ("CUDAGraphNode", "check_invariants", noting)):
            cls = getattr(trees, cls_name, None)
            if cls is None or not hasattr(cls, name):  # another torch: the numbers without the count, not an error
                self.reasons.append(f"not counted: this torch has no {cls_name}.{name}")
                continue
            self._saved.append((cls, name, getattr(cls, name)))
            setattr(cls, name, wrap(getattr(cls, name)))
        return self

    def __exit__(self, *exc):
        for cls, name, original in self._saved:
            setattr(cls, name, original)


def breakdown(step, batch):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    trace = os.environ.get("BENCH_TRACE")  # a folder: also record the host's ops, and write a Chrome trace there
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if trace else [])
    # BENCH_PROFILE_STEPS consecutive steps, each ended as the timed ones are (a step that differs from the next one,
    # e.g. timed steps alternating by ~10 ms, shows in the trace); the breakdown is a step's mean
    steps = int(os.environ.get("BENCH_PROFILE_STEPS", "1"))
    with profile(activities=activities) as prof:
        for i in range(steps):
            with torch.profiler.record_function(f"profiled step {i + 1}"):  # trace_gaps.py reads each step apart
                step(*batch)
                torch.cuda.current_stream().synchronize()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(os.path.join(trace, f"trace_{os.environ.get('BENCH_VARIANT', 'step')}.json"))
    totals, kernels = {}, {}
    for e in prof.key_averages():
        # kernels only: with the host's ops recorded too (BENCH_TRACE) an op carries its kernels' time as its own,
        # and Inductor's launcher of a Triton kernel has the kernel's very name, so one key held it twice
        if e.device_type.name != "CUDA":
            continue
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if not t:
            continue
        b = bucket(e.key)
        totals[b] = totals.get(b, 0.0) + t / 1e3 / steps
        kernels[e.key[:90]] = kernels.get(e.key[:90], 0.0) + t / 1e3 / steps
    if os.environ.get("BENCH_KERNELS"):
        for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:40]:
            print(f"KERNEL {v:8.2f} ms  {k}", flush=True)
    out = {k: round(v, 1) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
    out["gpu_busy_total"] = round(sum(totals.values()), 1)  # vs step_s: the rest is host overhead / launch gaps
    return out


CPU_DRY_RUN = bool(os.environ.get("BENCH_CPU"))  # the same code paths on the tiny model, gloo: a rehearsal


def worker(name: str) -> dict:
    os.environ["BENCH_VARIANT"] = name
    stack, B, S, targets, extra = VARIANTS[name]
    if extra.get("sdpa"):
        os.environ["BENCH_SDPA"] = extra["sdpa"]
    if CPU_DRY_RUN:
        from moetune.model.config import BUILTIN

        dev, B, S = torch.device("cpu"), 2, 64
        cfg = dict(BUILTIN["tiny"], num_hidden_layers=min(extra.get("layers", 3), 3))
        if "model" in extra:
            cfg = dict(TINY_FLASH)
        extra = {k: v for k, v in extra.items() if k not in ("compile", "offload")}
        if isinstance(extra.get("ac"), dict):  # a per-layer split, scaled to the rehearsal's layers
            extra["ac"] = {"full": 1, "attention": cfg["num_hidden_layers"] - 1}
        for f in ("synchronize", "reset_peak_memory_stats"):
            setattr(torch.cuda, f, lambda *a, **k: None)
        torch.cuda.max_memory_allocated = torch.cuda.max_memory_reserved = lambda *a, **k: 0
        torch.cuda.current_stream = lambda *a, **k: type("Stream", (), {"synchronize": lambda self: None})()
    else:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
        cfg = air8(extra.get("layers", 8), extra.get("experts"))
        if "model" in extra:  # a builtin shape at full size
            from moetune.model.config import BUILTIN

            cfg = dict(BUILTIN[extra["model"]])
    docs = min(extra.get("docs", 1), S // 8)  # the dry run's short rows keep documents of 8 tokens
    if "compiled_block_mask" in extra:  # any stack of ours: the model's own switch, read as each step builds its mask
        import moetune.model.attention as attention_module

        attention_module.COMPILED_BLOCK_MASK = extra["compiled_block_mask"]
    if stack == "hf":
        from hf_reference import build_hf, hf_step_fn

        model = build_hf(cfg, targets, device=dev, gradient_checkpointing=extra.get("gc", True))
        step = hf_step_fn(model)
    elif stack == "trainer":
        model, step = trainer_step_fn(cfg, targets, B, S, dev, extra.get("compile_mode"), extra.get("quantize"),
                                      extra.get("fp8_copies"),
                                      ["--model.attn_implementation", extra["attn"]] if "attn" in extra else None)
    else:
        model = build_ours(cfg, targets, extra, dev)
        step = ours_step_fn(model, targets is None, extra.get("offload", False), extra.get("guard", False))
    batch = make_batch(B, S, cfg["vocab_size"], docs, dev, seed=int(os.environ.get("RANK", 0)))  # own data per rank
    # Python's garbage collection as `moetune train` runs it (train.gc_every; Trainer.step does it); BENCH_PYTHON_GC=1:
    # Python's automatic collection, the comparison
    if stack == "ours" and not os.environ.get("BENCH_PYTHON_GC"):
        from moetune.train.garbage import GarbageCollection

        GarbageCollection(50)
    if stack == "hf":
        batch = (batch[0], torch.roll(batch[1], 1, 1), batch[2] if docs > 1 else None)  # HF shifts itself
    for _ in range(3):
        step(*batch)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    graphs = extra.get("compile_mode") == "reduce-overhead" and dev.type == "cuda"
    with GraphRecordings() if graphs else contextlib.nullcontext() as recordings:
        for _ in range(8):
            t = time.perf_counter()
            loss = step(*batch)
            # the compute stream, as `moetune train` times a step: the guard's host copy runs on its own stream under
            # the next step (a device-wide synchronize would expose it)
            torch.cuda.current_stream().synchronize()
            times.append(time.perf_counter() - t)
    st = statistics.median(times)
    tokens = B * S
    res = {
        "variant": name, "stack": stack, "batch": f"{B}x{S}", "layers": cfg["num_hidden_layers"],
        "settings": ({"gradient_checkpointing": extra.get("gc", True)} if stack == "hf" else {}),
        "gpus": extra.get("nproc", 1), "per_gpu": True,
        "step_s": round(st, 4), "tokens_per_s": round(tokens / st, 1),
        "step_times_s": [round(t, 4) for t in times],  # each timed step: a slow one is read apart from a slow median
        "mfu4p": round(4 * active_params(cfg) * tokens / st / PEAK, 4),
        "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
        "loss": round(float(loss), 4),
    }
    if recordings is not None:
        res["cuda_graphs_recorded"], res["cuda_graphs_rerecorded_because"] = recordings.recorded, recordings.reasons
    if targets is None:
        res["mfu6p"] = round(6 * active_params(cfg) * tokens / st / PEAK, 4)
    if extra.get("offload"):  # host-bound steps (AdamW on the CPU): a kernel breakdown says little and takes minutes
        return res
    try:
        res["breakdown_ms"] = breakdown(step, batch)
    except Exception as e:  # the profiler is a nice-to-have, never a reason to lose the numbers
        res["breakdown_ms"] = {"error": str(e)[:200]}
    return res


def run_variant(name: str, timeout: int) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t = time.time()
    extra = VARIANTS[name][4]
    nproc = extra.get("nproc", 1)
    launch = [sys.executable] + ([] if nproc == 1 and not extra.get("dispatch") else
                                 ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
                                  "29533"])
    try:
        p = subprocess.run(launch + [__file__, "--worker", name], capture_output=True, text=True, env=env,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return {"variant": name, "error": f"timeout after {timeout}s: {str(e.stderr)[-800:]}"}
    for line in p.stdout.splitlines():
        if line.startswith("KERNEL "):
            print(f"[{name}] {line}", flush=True)
    for line in p.stdout.splitlines()[::-1]:
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            r["wall_s"] = round(time.time() - t, 1)
            return r
    # the worker's own exception, not the launcher's summary that follows it
    cause = [line for line in (p.stderr or "").splitlines() if "Error" in line and "ChildFailedError" not in line]
    return {"variant": name, "error": " | ".join(cause[-4:])[-1500:] or (p.stderr or p.stdout)[-1500:]}


def best_references(results) -> dict:
    """{HF variant name without _nogc: the faster of it and its _nogc twin among those that ran (fitted)}."""
    best = {}
    for r in results:
        if r.get("stack") != "hf" or "error" in r:
            continue
        key = r["variant"].removesuffix("_nogc")
        if key not in best or r["tokens_per_s"] > best[key]["tokens_per_s"]:
            best[key] = r
    return best


def table(results):
    ref = best_references(results)
    lines = [f"{'variant':<30}{'tok/s':>10}{'MFU4p':>8}{'vs HF':>7}{'alloc GiB':>10}{'resv GiB':>9}{'step s':>8}"]
    for r in results:
        if "error" in r:
            lines.append(f"{r['variant']:<30} ERROR {r['error'][-300:]!r}")
            continue
        # the reference of the same LoRA targets and batch: hf_<targets>_<batch>
        parts = r["variant"].split("_")
        targets = "experts" if "experts" in parts else "qkvo"
        base = ref.get(FAMILY_REFERENCE.get(r["variant"], f"hf_{targets}_{r['batch']}"))
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base and r["stack"] != "hf" else ""
        if base and r["stack"] != "hf":
            ratio += "*" if base["variant"].endswith("_nogc") else ""
        lines.append(f"{r['variant']:<30}{r['tokens_per_s']:>10,.0f}{100 * r['mfu4p']:>7.1f}%{ratio:>7}"
                     f"{r['peak_alloc_gib']:>10.1f}{r['peak_reserved_gib']:>9.1f}{r['step_s']:>8.3f}")
    lines.append("vs HF: against transformers' faster setting that ran (* without gradient checkpointing, else with)")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--variants", nargs="*", default=DEFAULT)
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    a = ap.parse_args()
    if a.worker:
        r = worker(a.worker)
        if int(os.environ.get("RANK", 0)) == 0:
            print("RESULT " + json.dumps(r), flush=True)
        return
    results = []
    for v in a.variants:
        r = run_variant(v, a.timeout)
        results.append(r)
        print(json.dumps(r), flush=True)
        if a.out:  # after every variant, so a call cut short keeps what it measured
            with open(os.path.join(a.out, "train_throughput.json"), "w") as f:
                json.dump({"date": time.strftime("%Y-%m-%d"),
                           "device": "cpu (dry run)" if CPU_DRY_RUN else torch.cuda.get_device_name(0),
                           "torch": torch.__version__, "results": results}, f, indent=1)
    print(table(results))


if __name__ == "__main__":
    main()
