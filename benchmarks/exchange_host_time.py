"""The host's time a call for the expert-parallel exchange's pieces, eager against compiled (the dispatcher's
`compiled`): one MoE layer through the dispatcher on a world of one (gloo), shapes small enough that the host's work,
not the kernels, is what is timed. A proxy for what the host spends between the exchange's collectives on a GPU.

    python benchmarks/exchange_host_time.py [--tokens 64] [--calls 200] [--fp8]

`--fp8`: the expert stacks frozen in fp8 (row scales) on the fp8 tensor-core path, as on a Hopper GPU: torch has no
CPU `_scaled_grouped_mm`, so one `torch._grouped_mm` on the operands dequantised stands in for it (a kernel launch
for a kernel launch); modes "eager_cq" (`quant.matmul.EAGER_QUANT = "compiled"`) and "compiled_cq" are added.
Each mode runs in its own process (a compile cache of its own); one line per piece: microseconds a call.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))


def _scaled_grouped_mm_stand_in(a, b, scale_a, scale_b, offs, out_dtype, **_):
    """One grouped GEMM in place of torch._scaled_grouped_mm (no CPU kernel): its launches, not its numerics."""
    return torch._grouped_mm(a.to(out_dtype), b.to(out_dtype), offs=offs)


def measure(mode: str, tokens: int, calls: int, fp8: bool) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import moetune.model.expert_parallel as ep
    from moetune.model.config import ModelConfig
    from moetune.model.glm4_moe import Experts
    from moetune.parallel.apply import shard_experts

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    E, k, H = 16, 8, 64
    ex = Experts(ModelConfig(hidden_size=H, moe_intermediate_size=32, n_routed_experts=E, num_experts_per_tok=k))
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, 0.02)
        ex.down_proj.normal_(0, 0.02)
    ex.to(torch.bfloat16).requires_grad_(False)
    if fp8:
        from moetune.model.quant import matmul
        from moetune.model.quant.fp8 import ROWWISE
        from moetune.model.quant.modules import _frozen, scale_name

        for name in ("gate_up_proj", "down_proj"):
            q, sc = ROWWISE.quantize(getattr(ex, name).data.float())
            setattr(ex, name, _frozen(q))
            setattr(ex, scale_name(name, ROWWISE), _frozen(sc, scale=True))
        ex.quant = ROWWISE
        matmul._fp8_kernels = lambda x, w8, scheme: x.dtype == torch.bfloat16
        torch._scaled_grouped_mm = _scaled_grouped_mm_stand_in
        matmul.EAGER_QUANT = "compiled" if mode.endswith("_cq") else "torch"
    compiled = mode.startswith("compiled")
    shard_experts(ex, mesh, compiled=compiled)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, H, generator=g).bfloat16().requires_grad_()
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, generator=g).requires_grad_()
    routing = torch.cat([w.detach(), idx.float()], 1)
    receive = ep._maybe_compiled(ep._receive_plan_tensors, compiled)

    def layer():
        y, _, side = ex(x, idx, w, side_work=lambda: x * 2)
        (y + side).float().sum().backward()

    pieces = (("send plan", lambda: ep._plan_send(idx, w, 1, E, 1, compiled)),
              ("receive plan (no grad, as inside the exchange)", lambda: receive(routing, k, E, torch.float32)),
              ("MoE layer forward + backward", layer))
    for name, fn in pieces:
        with torch.no_grad() if name.startswith("receive") else torch.enable_grad():
            for _ in range(5):  # compiles, and recompiles, before the clock
                fn()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
        print(f"{mode:9s} {name:48s} {(time.perf_counter() - t0) / calls * 1e6:8.0f} us", flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--mode", choices=["eager", "compiled", "eager_cq", "compiled_cq"])
    a = ap.parse_args()
    if a.mode:
        measure(a.mode, a.tokens, a.calls, a.fp8)
        return
    for mode in ("eager", "compiled") + (("eager_cq", "compiled_cq") if a.fp8 else ()):
        subprocess.run([sys.executable, __file__, "--mode", mode, "--tokens", str(a.tokens), "--calls", str(a.calls)]
                       + ["--fp8"] * a.fp8, check=True)


if __name__ == "__main__":
    main()
