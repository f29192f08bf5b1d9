"""What a LoRA checkpoint of full-size GLM-4.5-Air costs: the real Checkpointer, on the CPU.

The base never needs memory here: the model is built on the meta device and only the LoRA tensors (and their
AdamW moments) are materialised — exactly the state a LoRA checkpoint holds — so this runs on a laptop.

    python benchmarks/lora_checkpoint_cost.py [--targets q_proj,k_proj,v_proj,o_proj] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from moetune.config import load_config
from moetune.model.config import resolve_model_config
from moetune.model.hf_io import build_model, cast_model
from moetune.model.lora import apply_lora
from moetune.parallel.mesh import Dist
from moetune.train.checkpoint import Checkpointer
from moetune.train.loop import TrainState
from moetune.train.optim import build_optimizer, build_scheduler


class _Loader:
    def state_dict(self):
        return {"epoch": 0, "offset": 0}

    def load_state_dict(self, sd):
        pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    ap.add_argument("--model", default="glm45-air")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp()
    cfg = load_config(None, ["--model.config", a.model, "--model.dtype", "bfloat16", "--run.output_dir", out,
                             "--run.name", "ckpt", "--lora.targets", f"[{a.targets}]", "--logging.report_to", "[]"])
    model = build_model(resolve_model_config(None, a.model), "meta")
    cast_model(model, torch.bfloat16)
    apply_lora(model, cfg.lora.targets, cfg.lora.rank, cfg.lora.alpha)
    for mod in model.modules():  # materialise the LoRA tensors only
        for name, p in list(mod.named_parameters(recurse=False)):
            if p.requires_grad:
                setattr(mod, name, torch.nn.Parameter(torch.randn(p.shape, dtype=torch.float32) * 0.01))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(params, cfg.optim, torch.device("cpu"))
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()  # AdamW moments exist, as in a real checkpoint
    ck = Checkpointer(cfg, Dist(), model, opt, build_scheduler(opt, cfg.optim, 10), _Loader())
    os.makedirs(cfg.run_dir, exist_ok=True)
    times = []
    for step in (1, 2, 3):
        t = time.perf_counter()
        path = ck.save(TrainState(step=step))
        times.append(time.perf_counter() - t)
    nbytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    n = sum(p.numel() for p in params)
    print(json.dumps({"model": a.model, "targets": a.targets, "lora_params": n, "checkpoint_bytes": nbytes,
                      "save_s": [round(x, 3) for x in times], "path": str(path)}))


if __name__ == "__main__":
    main()
