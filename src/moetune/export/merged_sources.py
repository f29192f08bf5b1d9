"""Merged HF checkpoints straight from training state, not from a base + adapter pair of files:

    export_merged_from_checkpoint("runs/x", "out/merged")      # a full fine-tuning run's DCP checkpoint, offline
    export_merged_from_model(model, "out/merged")              # inside a running job: EVERY rank calls it

Both stream by unit (the embeddings, then each decoder layer, then the final norm + lm_head): a unit's tensors
are loaded from DCP (a state dict of just those keys: DCP reads subsets) or gathered from the sharded model
(DTensor.full_tensor, a collective), LoRA is merged one expert at a time (merged.py's math), every tensor is
converted to the hub's per-expert names, cast and written by the shard writer merged.py uses, and the unit is
freed before the next one. Peak host memory is about one layer, whatever the model's size.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path

import torch

from moetune.export.adapter import ExportError, check_out_dir, output_errors
from moetune.export.merged import _KEEP_DTYPE, _copy_side_files, _order_key, lora_delta, write_config_dict
from moetune.export.safetensors_io import Reader, ShardedWriter
from moetune.model.hf_io import as_dtype
from moetune.model.config import model_config_for
from moetune.names import FUSED_EXPERT_RE as _FUSED_RE, LAYER_RE as _LAYER_RE
from moetune.output_dir import atomic_output_dir
from moetune.checkpoint_reading import dcp_load, read_dcp_index
from moetune.run_dir import METADATA, latest_checkpoint, verify_checkpoint



def _unit_key(name: str) -> tuple[int, int]:
    m = _LAYER_RE.match(name)
    if m:
        return 1, int(m.group(1))
    return (0, 0) if name.startswith("model.embed_tokens") else (2, 0)


def units(names) -> list[list[str]]:
    """Our tensor names grouped into what is streamed together, in writing order (HF's: embeddings, layers,
    final norm and lm_head). Deterministic: under a job every rank gathers in this order."""
    groups: dict = {}
    for n in names:
        groups.setdefault(_unit_key(n), []).append(n)
    return [sorted(groups[k], key=_order_key) for k in sorted(groups)]


def hf_tensors(state: dict, scalings: dict[str, float]):
    """(HF name, tensor) for the base tensors of one unit's `state` (our names, LoRA tensors included when
    there are any), LoRA merged in fp32. Lazy and one expert at a time, so an expert stack never exists in fp32.
    `scalings`: {LoRA module ("…q_proj", "…mlp.experts.lora"): scaling}. Works on meta tensors (the plan)."""
    for name in sorted((k for k in state if ".lora" not in k), key=_order_key):
        W = state[name]
        fused = _FUSED_RE.match(name)
        if fused:
            prefix, which = fused.groups()
            short = "gate_up" if which == "gate_up_proj" else "down"
            A, B = state.get(f"{prefix}.lora.{short}_A"), state.get(f"{prefix}.lora.{short}_B")
            for e in range(W.shape[0]):
                We = W[e] if A is None else W[e].float() + lora_delta(A[e], B[e], scalings[f"{prefix}.lora"])
                if which == "down_proj":
                    yield f"{prefix}.{e}.down_proj.weight", We
                else:  # gate rows first, then up (our fused layout)
                    I = We.shape[0] // 2
                    yield f"{prefix}.{e}.gate_proj.weight", We[:I]
                    yield f"{prefix}.{e}.up_proj.weight", We[I:]
            continue
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module is not None and f"{module}.lora_A" in state:
            W = W.float() + lora_delta(state[f"{module}.lora_A"], state[f"{module}.lora_B"], scalings[module])
        yield name, W


def _out_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    if name.endswith(_KEEP_DTYPE):
        return torch.float32  # the router's correction bias: a buffer the hub checkpoints keep in fp32
    return dtype if t.is_floating_point() else t.dtype


class _UnitWriter:
    """Plans the whole output up front from shapes alone (hf_tensors on meta tensors), then writes unit by unit."""

    def __init__(self, out_dir: str, shapes: dict[str, tuple], dtype: torch.dtype, scalings: dict,
                 max_shard_bytes: float):
        self.dtype, self.scalings = dtype, scalings
        self.units = units(shapes)
        meta = {n: torch.empty(s, dtype=d, device="meta") for n, (s, d) in shapes.items()}
        plan = [(n, tuple(t.shape), _out_dtype(n, t, dtype)) for n, t in hf_tensors(meta, scalings)]
        self.out_dtype = {n: d for n, _, d in plan}
        self.writer = ShardedWriter(out_dir, plan, max_shard_bytes)
        self.tensors = len(plan)

    def write_unit(self, state: dict) -> None:
        for name, t in hf_tensors(state, self.scalings):
            self.writer.write(name, t.detach().to("cpu", self.out_dtype[name]))
            del t

    def report(self, out_dir: str, copied: list[str], **extra) -> dict:
        return {"out_dir": out_dir, "shards": len(self.writer.shards), "tensors": self.tensors,
                "bytes": self.writer.total, "copied": copied, "verify": None, **extra}


def _check_dtype(dtype) -> torch.dtype:
    try:
        t = as_dtype(dtype)
    except KeyError:
        t = None
    if t is None or not t.is_floating_point:
        raise ExportError(f"dtype {dtype!r}: choose float32, bfloat16 or float16")
    return t


# ------------------------------------------------------------------------------------------ offline: DCP
def full_checkpoint(path: str) -> str | None:
    """The DCP checkpoint dir of a full fine-tuning run that `path` (a checkpoint or a run dir) names, else None
    (a LoRA run, an adapter dir, ...: those merge from base + adapter)."""
    import yaml

    path = os.fspath(path)
    ckpt = path if os.path.isfile(os.path.join(path, ".metadata")) else None
    if ckpt is None and os.path.isdir(os.path.join(path, "checkpoints")):
        newest = latest_checkpoint(Path(path) / "checkpoints")
        ckpt = str(newest) if newest is not None else None
    if ckpt is None or not os.path.isfile(os.path.join(ckpt, "config.yaml")):
        return None
    with open(os.path.join(ckpt, "config.yaml")) as f:
        mode = ((yaml.safe_load(f) or {}).get("finetune") or {}).get("mode", "lora")
    return ckpt if mode == "full" else None


def _dcp_load(ckpt: str, shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Just these model tensors of a DCP checkpoint, whole, on CPU, without a process group."""
    state = {f"model.{n}": torch.empty(s, dtype=d) for n, (s, d) in shapes.items()}
    dcp_load(state, ckpt)
    return {k.removeprefix("model."): v for k, v in state.items()}


def export_merged_from_checkpoint(checkpoint: str, out_dir: str, dtype="bfloat16", max_shard_bytes: float = 5e9) -> dict:
    """Write the weights of a full fine-tuning checkpoint (its dir, or a run dir: the newest complete one) as
    an HF checkpoint, one layer in memory at a time. config.json comes from the run's model config; generation
    config and tokenizer files from the base (model.path) when the run had one."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from moetune.config import load_config

    out_dir = os.fspath(out_dir)
    ckpt = full_checkpoint(checkpoint)
    if ckpt is None:
        raise ExportError(f"{checkpoint}: not a full fine-tuning checkpoint or run (LoRA runs merge from the base "
                          "and the adapter: export_merged)")
    torch_dtype = _check_dtype(dtype)
    verify_checkpoint(Path(ckpt))
    cfg = load_config(os.path.join(ckpt, "config.yaml"))
    model_cfg = model_config_for(cfg)
    base = cfg.model.path if cfg.model.path and os.path.isdir(cfg.model.path) else None
    md = read_dcp_index(Path(ckpt) / METADATA)
    shapes = {k.removeprefix("model."): (tuple(m.size), m.properties.dtype) for k, m in md.state_dict_metadata.items()
              if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    # The router's correction bias is a buffer; checkpoints save it (get_model_state_dict includes persistent
    # buffers), but one written without it gets the base's value, else zeros (what training starts from).
    missing_bias = [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in range(model_cfg.num_hidden_layers)
                    if model_cfg.is_moe_layer(i)]
    missing_bias = [n for n in missing_bias if n not in shapes]
    base_reader = Reader(base) if base and missing_bias else None
    notes = []
    for n in missing_bias:
        shapes[n] = ((model_cfg.n_routed_experts,), torch.float32)
    if missing_bias:
        notes.append(f"{len(missing_bias)} e_score_correction_bias not in the checkpoint: "
                     + (f"read from {base}" if base_reader is not None else "written as zeros"))

    if os.path.abspath(out_dir) == os.path.abspath(ckpt):
        raise ExportError("out_dir must differ from the checkpoint")
    check_out_dir(out_dir)  # before the work; checked again under the writer's lock
    with output_errors(out_dir), atomic_output_dir(out_dir, label=f"--out {out_dir}") as tmp:
        write_config_dict(model_cfg.to_hf_dict(), tmp, torch_dtype)
        uw = _UnitWriter(tmp, shapes, torch_dtype, {}, max_shard_bytes)
        for unit in uw.units:
            state = _dcp_load(ckpt, {n: shapes[n] for n in unit if n not in missing_bias})
            for n in unit:
                if n in missing_bias:
                    state[n] = (base_reader.read(n).float() if base_reader is not None and n in base_reader
                                else torch.zeros(shapes[n][0]))
            uw.write_unit(state)
            del state
        uw.writer.finish()
        copied = _copy_side_files(base, tmp) if base else []
    return uw.report(out_dir, copied, checkpoint=ckpt, notes=notes)


# ------------------------------------------------------------------------------------------ in a running job
def _lora_scalings(model) -> dict[str, float]:
    from moetune.model.lora import ExpertLoRA, LoRALinear

    return {name: m.scaling for name, m in model.named_modules() if isinstance(m, (LoRALinear, ExpertLoRA))}


def export_merged_from_model(model, out_dir: str, dtype="bfloat16", max_shard_bytes: float = 5e9,
                             base_path: str | None = None) -> dict | None:
    """Write `model` (LoRA merged when it has any) as an HF checkpoint from a running job. Collective: EVERY
    rank calls it, FSDP2/EP-sharded or not. Unit by unit each tensor is gathered whole (DTensor.full_tensor, in
    the same order on all ranks) and rank 0 merges and writes it; peak memory is one layer on every rank. The
    folder follows moetune/output_dir.py: it appears complete or not at all. base_path: where to copy
    tokenizer/generation files from. Returns the report on rank 0, None elsewhere."""
    import torch.distributed as dist

    rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    out_dir = os.fspath(out_dir)
    with ExitStack() as stack:
        tmp, error = None, None
        if rank0:
            try:
                tmp = stack.enter_context(atomic_output_dir(out_dir, label=f"out_dir {out_dir}"))
            except Exception as e:  # noqa: BLE001 - every rank must still take part in the gathers
                error = e
        report = write_model(model, tmp, dtype, max_shard_bytes, base_path, error)
        if report is not None:
            report["out_dir"] = out_dir
    return report


@torch.no_grad()
def write_model(model, out_dir: str | None, dtype="bfloat16", max_shard_bytes: float = 5e9,
                base_path: str | None = None, error: Exception | None = None) -> dict | None:
    """export_merged_from_model's writing, into the existing directory `out_dir` (rank 0; None elsewhere) as it is:
    for a caller that already stages its folder. `error`: rank 0 failed before (it still joins the gathers)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    distributed = dist.is_available() and dist.is_initialized()
    rank0 = not distributed or dist.get_rank() == 0
    torch_dtype = _check_dtype(dtype)
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    shapes = {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
    uw = None
    if rank0 and error is None:
        try:
            write_config_dict(model.config.to_hf_dict(), out_dir, torch_dtype)
            uw = _UnitWriter(out_dir, shapes, torch_dtype, _lora_scalings(model), max_shard_bytes)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = e
    for unit in units(shapes):
        state = {}
        for n in unit:
            t = tensors[n]
            full = t.full_tensor() if isinstance(t, DTensor) else t  # collective: every rank, same order
            if hasattr(full, "wait"):
                # an AsyncCollectiveTensor: wait on every rank, also where it is dropped unused (rank > 0); an
                # all-gather never waited on is left to die with its process (gloo aborts at exit)
                full = full.wait()
            if rank0:
                state[n] = full
            del full
        if rank0 and error is None:
            try:
                uw.write_unit(state)
            except Exception as e:  # noqa: BLE001
                error = e  # keep gathering: the other ranks are waiting in the next collective
        del state
    report = None
    if rank0 and error is None:
        try:
            uw.writer.finish()
            report = uw.report(out_dir, _copy_side_files(base_path, out_dir) if base_path else [])
        except Exception as e:  # noqa: BLE001
            error = e
    if distributed:  # every rank returns only once the files are complete, and every rank raises if rank 0 failed
        msg = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(msg, src=0)
        if msg[0] is not None and error is None:
            raise ExportError(f"merged export failed on rank 0: {msg[0]}")
    if error is not None:
        raise error
    return report
