"""FSDP2 CPU offload of an fp8 frozen base on a GPU: the same short LoRA run over an FP8 checkpoint with and without
`parallel.cpu_offload`, losses and gradient norms compared, and the memory each takes.

    python benchmarks/fp8_offload_check.py                 # 1 GPU: < 60 s on an H200
    NPROC=2 python benchmarks/fp8_offload_check.py         # 2 GPUs: FSDP over both either way; the offloaded gradient
                                                           # norm is reduced over the CPU backend (gloo) beside NCCL
    BENCH_CPU=1 python benchmarks/fp8_offload_check.py     # a CPU rehearsal (gloo, tiny shapes, no pinned memory)
    PINNED_THRESHOLD_MB=1 python benchmarks/fp8_offload_check.py   # + a third run, offloaded with
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,pinned_max_round_threshold_mb:1: whether torch's pinned
        allocator then stops rounding the shards up to powers of two (reported, not asserted)

The base is a random model written as an FP8 release (compressed-tensors: fp8 e4m3 weights, `weight_scale` per row)
that both runs read as stored: in the offloaded run every rank reads its shards straight into host memory. Both runs
go through `torch.distributed.run` and `moetune`'s Trainer (layout manual: one GPU without offload holds the model
whole; with offload FSDP2 over a mesh of one brings each layer in). What is checked:
  - the offloaded run's parameters are FSDP2 shards in host memory, pinned (on a GPU), the fp8 weights still
    float8_e4m3fn and their scales fp32 (nothing cast), the router's buffers on the GPU;
  - step 1's loss equal within rel 1e-4 (the same weights, the same forward), every step's loss and gradient norm
    within rel 1e-3 (the optimizer runs on the CPU when offloaded, on the GPU otherwise: rounding differs), and the
    loss falls (the updates matter);
  - reported, not asserted: each run's peak GPU memory (torch.cuda.max_memory_allocated) beside the layout's
    estimate, and the offloaded run's pinned host memory (torch.cuda.host_memory_stats) beside estimate.host_bytes.
Prints one line `OFFLOAD_CHECK ok|FAIL {json}`; writes $OUT/fp8_offload_check.json.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "src")
sys.path.insert(0, SRC)

CPU = bool(os.environ.get("BENCH_CPU"))
NPROC = int(os.environ.get("NPROC", "1"))
OUT = os.environ.get("OUT", "/tmp")
WORK = os.path.join(OUT, "fp8_offload_check")
STEPS = 6
LOSS_RTOL, FIRST_RTOL = 1e-3, 1e-4
# GLM-4.5 shapes scaled down: 6 layers (1 dense + 5 MoE of 16 experts, top-4), ~0.3 B parameters, so that what the
# offload moves off the GPU shows in its peak; the CPU rehearsal uses the tiny test shapes
SHAPES = (dict(vocab_size=160, hidden_size=128, intermediate_size=384, moe_intermediate_size=96, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=8, num_experts_per_tok=2)
          if CPU else
          dict(vocab_size=16384, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=1024,
               num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, head_dim=128, n_routed_experts=16,
               num_experts_per_tok=4))


def write_fp8_release(path: str) -> str:
    """A random GLM-4.5-shaped model saved as the hub's compressed-tensors FP8 releases are: every decoder-layer
    projection (experts one by one, shared experts, attention) in fp8 with a row scale, the router, norms,
    embeddings and lm_head in bf16."""
    import torch
    from safetensors.torch import load_file, save_file

    from moetune.export.merged_sources import write_model
    from moetune.model.config import BUILTIN, ModelConfig
    from moetune.model.hf_io import build_model, init_weights
    from moetune.model.quant.checkpoint import fp8_config
    from moetune.model.quant.fp8 import ROWWISE

    plain = os.path.join(path, "plain")
    os.makedirs(plain, exist_ok=True)
    model = build_model(ModelConfig.from_hf_dict(dict(BUILTIN["tiny"], **SHAPES)), "cpu")
    with torch.no_grad():
        init_weights(model, 0.02, seed=0)
    write_model(model, plain, "bfloat16")
    fp8_dir = os.path.join(path, "fp8")
    os.makedirs(fp8_dir, exist_ok=True)
    tensors = {}
    for f in sorted(os.listdir(plain)):
        if not f.endswith(".safetensors"):
            continue
        for k, v in load_file(os.path.join(plain, f)).items():
            if k.startswith("model.layers.") and k.endswith("_proj.weight"):
                q, s = ROWWISE.quantize(v.float())
                tensors[k], tensors[k[: -len("weight")] + "weight_scale"] = q, s
            else:
                tensors[k] = v
    save_file(tensors, os.path.join(fp8_dir, "model.safetensors"))
    with open(os.path.join(plain, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(fp8_dir, "config.json"), "w") as f:
        json.dump(dict(cfg, quantization_config=fp8_config(ROWWISE)), f)
    shutil.rmtree(plain)
    return fp8_dir


def run_args(name: str, base: str, offload: bool) -> list[str]:
    from moetune.data import DEMO_TOKENIZER_DIR

    args = {"run.output_dir": os.path.join(WORK, "runs"), "run.name": name, "model.path": base,
            "data.tokenizer": str(DEMO_TOKENIZER_DIR), "data.train": None, "data.eval": None,
            "data.seq_len": 256 if CPU else 1024, "train.micro_batch_size": 2, "train.grad_accum": 1,
            "train.steps": STEPS, "train.compile": "false", "optim.lr": 5e-3, "optim.warmup_steps": 0,
            "eval.every": 0, "checkpoint.every": STEPS // 2, "logging.progress_bar": "false",
            "logging.expert_stats_every": 0, "lora.targets": "[q_proj,k_proj,v_proj,o_proj,shared_experts,experts]",
            "parallel.layout": "manual", "parallel.ep": 1, "parallel.dp_shard": -1,
            "train.activation_checkpointing": "none", "parallel.cpu_offload": str(offload).lower(),
            "resume": "none"}
    if CPU and offload:
        args["parallel.gpu_memory_gib"] = 80  # the layout refuses offload on a CPU run: state a GPU's memory
    out = []
    for k, v in args.items():
        out += [f"--{k}", "null" if v is None else str(v)]
    return out


# ------------------------------------------------------------------------------------------------ one run
def placement(model, device) -> dict:
    """Where the offloaded run keeps what: every parameter an FSDP2 shard in host memory (pinned on a GPU), the fp8
    weights fp8 and their scales fp32 as stored, the buffers on the compute device."""
    import torch
    from torch.distributed.tensor import DTensor

    from moetune.model.quant.modules import fp8_parameters

    params = dict(model.named_parameters())
    fp8 = fp8_parameters(model)
    scales = {id(s) for s, _ in fp8.values()}
    local = {n: (p.to_local() if isinstance(p, DTensor) else p) for n, p in params.items()}
    return {
        "params": len(params),
        "sharded": sum(isinstance(p, DTensor) for p in params.values()),
        "on_host": sum(t.device.type == "cpu" for t in local.values()),
        "pinned": sum(t.is_pinned() for t in local.values()) if device.type == "cuda" else None,
        "fp8_weights": len(fp8),
        "fp8_as_stored": sum(local[n].dtype == torch.float8_e4m3fn for n in fp8),
        "scales_fp32": sum(local[n].dtype == torch.float32 for n, p in params.items() if id(p) in scales),
        "buffers_on_device": all(b.device == device for b in model.buffers()),
    }


def child(name: str, args: list[str]) -> None:
    import torch

    from moetune.config import load_config
    from moetune.model.config import model_config_for
    from moetune.parallel.estimate import build_meta_model, count_params, host_bytes
    from moetune.train.trainer import Trainer

    cfg = load_config(None, args)
    with Trainer(cfg) as trainer:
        while trainer.state.step < cfg.train.steps and not trainer.stopped:
            trainer.step(trainer.next_batches())
        where = placement(trainer.model, trainer.dist.device)
        layout, is_main = trainer.layout, trainer.dist.is_main
    if not is_main:
        return
    cuda = torch.cuda.is_available()
    out = {"layout": layout.summary(), "placement": where, "estimate_gpu_gib": layout.estimate_gib,
           "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
    if layout.cpu_offload:
        counts = count_params(build_meta_model(cfg, model_config_for(cfg)))
        exact, allocated = host_bytes(counts, layout, 2 if cfg.model.dtype == "bfloat16" else 4)
        out["estimate_host_gib"] = {"exact": exact / 2**30, "allocated": allocated / 2**30}
        stats = torch.cuda.host_memory_stats() if cuda else {}
        out["pinned_host_gib"] = {k: stats[f"{k}.peak"] / 2**30 for k in ("allocated_bytes", "active_bytes")
                                  if f"{k}.peak" in stats} or None
    with open(os.path.join(WORK, f"{name}.json"), "w") as f:
        json.dump(out, f)


# ------------------------------------------------------------------------------------------------ the check
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(name: str, args: list[str], **extra_env) -> None:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1",
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1", **extra_env)
    if CPU:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(NPROC), "--master-port",
           str(free_port()), os.path.abspath(__file__), "--child", name] + args
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    with open(os.path.join(WORK, f"{name}.log"), "w") as f:
        f.write(p.stdout + p.stderr)
    if p.returncode != 0:
        tail = "\n".join((p.stdout + p.stderr).splitlines()[-40:])
        raise RuntimeError(f"run {name} failed (rc {p.returncode}):\n{tail}")


def metrics(name: str) -> list[dict]:
    with open(os.path.join(WORK, "runs", name, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def main() -> int:
    t0 = time.time()
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    result = {"nproc": NPROC, "device": "cpu" if CPU else "cuda", "steps": STEPS}
    ok = False
    try:
        base = write_fp8_release(os.path.join(WORK, "base"))
        result["prepare_s"] = round(time.time() - t0, 1)
        for name, offload in (("resident", False), ("offload", True)):
            t = time.time()
            launch(name, run_args(name, base, offload))
            result[f"{name}_s"] = round(time.time() - t, 1)
        threshold = os.environ.get("PINNED_THRESHOLD_MB")
        if threshold:
            t = time.time()
            conf = f"expandable_segments:True,pinned_max_round_threshold_mb:{threshold}"
            launch("offload_unrounded", run_args("offload_unrounded", base, True), PYTORCH_CUDA_ALLOC_CONF=conf)
            with open(os.path.join(WORK, "offload_unrounded.json")) as f:
                result["unrounded"] = {"conf": conf, "s": round(time.time() - t, 1),
                                       "pinned_host_gib": json.load(f).get("pinned_host_gib"),
                                       "losses": [r["loss"] for r in metrics("offload_unrounded")]}
        runs = {n: metrics(n) for n in ("resident", "offload")}
        info = {}
        for n in runs:
            with open(os.path.join(WORK, f"{n}.json")) as f:
                info[n] = json.load(f)
        la, lb = ([r["loss"] for r in runs[n]] for n in ("resident", "offload"))
        ga, gb = ([r["grad_norm"] for r in runs[n]] for n in ("resident", "offload"))
        result.update(
            losses={"resident": la, "offload": lb},
            loss_max_rel=max(map(rel, lb, la)), first_loss_rel=rel(lb[0], la[0]),
            grad_norm_max_rel=max(map(rel, gb, ga)),
            peak_gpu_gib={n: info[n]["peak_gpu_gib"] for n in info},
            estimate_gpu_gib={n: info[n]["estimate_gpu_gib"] for n in info},
            pinned_host_gib=info["offload"].get("pinned_host_gib"),
            estimate_host_gib=info["offload"].get("estimate_host_gib"),
            placement=info["offload"]["placement"], layouts={n: info[n]["layout"] for n in info})
        where = result["placement"]
        placed = (where["sharded"] == where["params"] == where["on_host"]
                  and where["pinned"] in (None, where["params"])
                  and where["fp8_as_stored"] == where["fp8_weights"] > 0
                  and where["scales_fp32"] == where["fp8_weights"] and where["buffers_on_device"])
        result["placement_ok"] = placed
        ok = (len(la) == len(lb) == STEPS and result["first_loss_rel"] <= FIRST_RTOL
              and result["loss_max_rel"] <= LOSS_RTOL and result["grad_norm_max_rel"] <= LOSS_RTOL
              and la[-1] < la[0] and placed)
    except Exception as e:  # noqa: BLE001 - the one line says what failed
        result["error"] = f"{type(e).__name__}: {e}"
    result["total_s"] = round(time.time() - t0, 1)
    with open(os.path.join(OUT, "fp8_offload_check.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"OFFLOAD_CHECK {'ok' if ok else 'FAIL'} {json.dumps(result)}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(main())
