"""Shared helpers for tests: tiny random GLM-4.5 configs and checkpoints written by transformers itself."""

import torch

TINY_HF = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
    norm_topk_prob=True, use_qk_norm=False, attention_bias=True, partial_rotary_factor=0.5,
    rms_norm_eps=1e-5, max_position_embeddings=512, tie_word_embeddings=False,
)


def hf_model(seed=0, **overrides):
    """A transformers Glm4MoeForCausalLM with random weights (router bias random too, so it matters)."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    kw = dict(TINY_HF, **overrides)
    prf = kw.pop("partial_rotary_factor")
    cfg = Glm4MoeConfig(**kw, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": prf})
    torch.manual_seed(seed)
    return randomize_weights(Glm4MoeForCausalLM(cfg).float().eval())


def randomize_weights(m, seed=None):
    """Random weights for any transformers GLM model (GLM-4.5, GLM-4.7-Flash, GLM-5): norms near 1, biases and the
    router's correction bias small and random (so they matter), the rest N(0, 0.08). Seeded here when seed is given,
    else from the current RNG state."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
        for layer in m.model.layers:
            if hasattr(layer.mlp, "gate"):
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(0.05 * torch.randn(bias.shape))
    return m


def save_hf(model, path, max_shard_size=None):
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kw)
    return str(path)


# ------------------------------------------------------------------------------------------ training runs
import json
import os
import random
import subprocess
import sys


def rewrite_checkpoint(path, fn):
    """Apply fn to the tensors of the single-file checkpoint at `path` (model.safetensors) in place: a damaged or odd
    checkpoint made from a good one."""
    from safetensors.torch import load_file, save_file

    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    fn(sd)
    save_file(sd, f)


def write_chat_jsonl(path, n=48, seed=0, min_len=3, max_len=12):
    """A small chat dataset with answers of unequal length (so a mean of means would differ)."""
    r = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            s = "".join(r.choice("abcdefgh") for _ in range(r.randint(min_len, max_len)))
            f.write(json.dumps({"messages": [{"role": "user", "content": "reverse: " + s},
                                             {"role": "assistant", "content": s[::-1]}]}) + "\n")
    return str(path)


def small_run_args(tmp_path, name, **over):
    """CLI overrides for a fast tiny run on CPU (2 layers, short sequences)."""
    data = tmp_path / "data.jsonl"
    if not data.exists():
        write_chat_jsonl(data)
    args = {
        "run.output_dir": str(tmp_path / "runs"), "run.name": name, "data.train": str(data), "data.eval": str(data),
        "data.seq_len": 64, "model.num_hidden_layers": 2, "train.steps": 5, "train.micro_batch_size": 2,
        "optim.warmup_steps": 0, "optim.lr": 1e-2, "model.init_std": 0.02, "eval.every": 0,
        "logging.progress_bar": False,
        "logging.expert_stats_every": 0, "lora.targets": "[q_proj,k_proj,v_proj,o_proj,shared_experts,experts]",
        # the layout as written (FSDP over the processes unless a test says otherwise): `auto` on the CPU would
        # replicate, and these runs are about FSDP/EP equivalence
        "parallel.layout": "manual",
    }
    args.update(over)
    out = []
    for k, v in args.items():
        out += [f"--{k}", str(v)]
    return out


def run_inprocess(args):
    from moetune.config import load_config
    from moetune.train.loop import train

    cfg = load_config(None, args)
    train(cfg)
    return cfg.run_dir


def run_torchrun(args, nproc=2, extra=None, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    cmd = extra or [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                    "--master-port", str(free_port())]
    p = subprocess.run(cmd + ["-m", "moetune", "train"] + args, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p


_held_ports = []


def free_port():
    """A TCP port on 127.0.0.1 that no other process can take before the test uses it: the port is bound here (with
    SO_REUSEADDR, not listening) and held until the test ends (conftest releases it). torch's TCPStore (c10d's and
    torchrun's rendezvous, moetune.sync.connect) binds with SO_REUSEADDR too, so it can serve on the held port, while
    the kernel hands the port to no one else. A port merely found free and closed could be taken first (EADDRINUSE,
    then a client waiting out its timeout: seen in test_sync_fsdp)."""
    import socket

    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    _held_ports.append(s)
    return s.getsockname()[1]


def release_ports():
    while _held_ports:
        _held_ports.pop().close()


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def step_losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def eval_losses(run_dir):
    return [r["eval_loss"] for r in read_metrics(run_dir) if "eval_loss" in r]


def randomize_lora(model, seed, scale=0.1):
    """Nonzero A and B everywhere, so every LoRA tensor shapes the output (a merge matters) and gets a gradient."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def random_adapter(base_path, adapter_dir, targets, rank=4, alpha=8.0, rslora=False, seed=0, scale=0.1):
    """A moetune adapter dir with random nonzero A and B on `targets` for the checkpoint at base_path;
    returns our model (fp32) holding it."""
    import moetune
    from moetune.model.adapter_io import save_adapter
    from moetune.model.lora import apply_lora, lora_state_dict

    model = moetune.load_model(str(base_path), dtype="float32")
    apply_lora(model, targets, rank, alpha, 0.0, rslora)
    randomize_lora(model, seed, scale)
    save_adapter(lora_state_dict(model), str(adapter_dir),
                 dict(rank=rank, alpha=alpha, dropout=0.0, rslora=rslora, targets=list(targets)), base_model=str(base_path))
    return model


def trained_text(tokenizer, ids, mask):
    """The trained tokens of a tokenised conversation, each run of consecutive trained tokens as one string."""
    runs, current = [], []
    for tok, trained in zip(ids, mask):
        if trained:
            current.append(tok)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def vllm_adapter_table(cfg: dict, r: int, targets, attn: dict, dense_layers: int) -> dict:
    """{key: shape} of the LoRA adapter vLLM reads for a model of `cfg` with rank r on `targets`: `attn` gives the
    (in, out) of each attention projection vLLM names (the architecture's), the MLPs and experts are common."""
    H, E, Ie, Id = cfg["hidden_size"], cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["intermediate_size"]
    table = {}

    def lin(prefix, fan_in, fan_out):
        table[f"base_model.model.{prefix}.lora_A.weight"] = (r, fan_in)
        table[f"base_model.model.{prefix}.lora_B.weight"] = (fan_out, r)

    mlp = {"gate_proj": (H, None), "up_proj": (H, None), "down_proj": (None, H)}
    for n in range(cfg["num_hidden_layers"]):
        for name, (i, o) in attn.items():
            if name in targets:
                lin(f"model.layers.{n}.self_attn.{name}", i, o)
        dense = n < dense_layers
        if dense and "dense_mlp" in targets:
            for name, (i, o) in mlp.items():
                lin(f"model.layers.{n}.mlp.{name}", i or Id, o or Id)
        if not dense and "shared_experts" in targets:
            for name, (i, o) in mlp.items():
                lin(f"model.layers.{n}.mlp.shared_experts.{name}", i or Ie, o or Ie)
        if not dense and "experts" in targets:
            for e in range(E):
                for name, (i, o) in mlp.items():
                    lin(f"model.layers.{n}.mlp.experts.{e}.{name}", i or Ie, o or Ie)
    return table
