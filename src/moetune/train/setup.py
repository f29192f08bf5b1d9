"""Build the model a run trains: meta → LoRA → EP → activation checkpointing → compile → FSDP2 → materialise →
weights."""

from __future__ import annotations

import logging

import torch

from moetune.errors import ConfigError
from moetune.model.config import model_config_for  # noqa: F401  (re-exported: inspect.py imports it from here)
from moetune.model.glm4_moe import Glm4MoeForCausalLM
from moetune.model.hf_io import (as_dtype, build_model, cast_model, checkpoint_reader, fill_seeded, init_weights,
                                 load_hf_weights)
from moetune.model.quant.checkpoint import prepare_fp8_base
from moetune.model.quant.modules import keep_transposed_copies
from moetune.model.trainable import prepare_trainable
from moetune.parallel.apply import check_cuda_graphs, parallelize, place_buffers
from moetune.parallel.layout import Layout
from moetune.parallel.mesh import Dist
from moetune.tensors import local_tensor

log = logging.getLogger("moetune")


def setup_model(cfg, dist: Dist, layout: Layout) -> Glm4MoeForCausalLM:
    """The model `cfg` trains, laid out as `layout` on `dist`'s mesh (init_distributed(layout))."""
    try:
        mcfg = model_config_for(cfg)
    except ValueError as e:  # an architecture we cannot build (ModelConfig.validate names the field)
        raise ConfigError(f"model.config / model.path: {e}") from None
    compute_dtype = as_dtype(cfg.model.dtype)
    full = cfg.finetune.mode == "full"
    model = build_model(mcfg, "meta")
    # LoRA mode: the frozen base is stored in the compute dtype, LoRA in fp32. Full mode: fp32 master weights.
    cast_model(model, torch.float32 if full else compute_dtype)
    reader = checkpoint_reader(cfg.model.path) if cfg.model.path else None
    if full and (cfg.model.quantize or (reader is not None and reader.fp8_scheme is not None)):
        raise ConfigError("finetune.mode full trains the base itself: it cannot be stored in fp8 (model.quantize, or "
                          f"the FP8 checkpoint at model.path {cfg.model.path}); use LoRA or a bf16 checkpoint")
    fp8 = not full and prepare_fp8_base(model, reader, cfg.model.quantize) is not None
    prepare_trainable(model, cfg)  # the estimate's meta model is marked by the same function
    for moe in model.moe_layers():  # what the MoE layers compute beyond their output, for the loss and the metrics
        moe.compute_aux_loss = cfg.train.aux_loss_coef > 0
        moe.track_router_entropy = cfg.logging.expert_stats_every > 0
    model.attn_implementation = cfg.model.attn_implementation
    if cfg.train.cuda_graphs:
        check_cuda_graphs(layout, cfg.train.compile, dist.device)
    # an fp8 base is gathered by FSDP as stored (fp8 weights, fp32 scales): a param_dtype would cast it to bf16
    parallelize(model, layout, dist.mesh, compile=cfg.train.compile, param_dtype=None if fp8 else compute_dtype,
                reshard_after_forward=cfg.parallel.reshard_after_forward, cuda_graphs=cfg.train.cuda_graphs)
    if full and not layout.fsdp and compute_dtype != torch.float32:
        cast_model(model, compute_dtype)  # no FSDP (one process, replicas): no separate master copy
    # with CPU offload FSDP2 keeps the sharded parameters in host memory and moves each unit in for its compute: each
    # rank reads (an FP8 checkpoint: as stored) or quantises (model.quantize) its own slices there, never on the GPU
    model.to_empty(device="cpu" if layout.cpu_offload else dist.device)
    with torch.no_grad():
        if cfg.model.path:
            load_hf_weights(model, cfg.model.path, reader=reader)
        else:
            init_weights(model, cfg.model.init_std, seed=cfg.run.seed)
        init_lora(model, seed=cfg.run.seed)
    if layout.cpu_offload:
        place_buffers(model, dist.device)
    if layout.fp8_copies:
        nbytes = keep_transposed_copies(model)
        log.info(f"fp8 base: transposed copies of its weights kept for the input gradient ({nbytes / 2**30:.2f} GiB)")
    return model


@torch.no_grad()
def init_lora(model, seed: int) -> None:
    """LoRA A from a generator seeded per tensor name, B = 0: the same adapter at any world size."""
    for name, p in model.named_parameters():
        if ".lora" not in name:
            continue
        if name.endswith("_B"):  # lora_B and the experts' gate_up_B / down_B
            local_tensor(p).zero_()
            continue
        bound = 1.0 / p.shape[-1] ** 0.5  # kaiming_uniform(a=√5) on [r, in], as PEFT
        fill_seeded(p, name, seed, lambda t, g: t.uniform_(-bound, bound, generator=g))


