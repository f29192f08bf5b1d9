"""The step API driven by a caller's own loop, for test_step_api_fsdp.py: `python step_api_worker.py ARGS_JSON`
(under torchrun: each rank takes its share of the rows). Two steps of a REINFORCE loss with per-token weights and
per-sequence advantages on batches drawn from a fixed generator; prints `RESULT {"losses": [...]}` on rank 0."""

import json
import os
import sys

import torch

from moetune import Trainer, load_config


def batches(step):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(1, 90, (4, 10), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((4, 1), -100)], 1)
    labels[:, :3] = -100
    labels[2, 6:] = -100
    return {"input_ids": ids, "labels": labels, "weights": torch.rand(4, 10, generator=g) + 0.5,
            "advantages": torch.randn(4, generator=g)}


def main():
    a = json.loads(sys.argv[1])
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    losses = []
    with Trainer(load_config(None, a["args"]), data=False) as trainer:
        for step in range(2):
            b = batches(step)
            rows = slice(rank * 4 // world, (rank + 1) * 4 // world)  # this rank's share of the sequences
            out = trainer.step({k: v[rows] for k, v in b.items()},
                               loss_fn=lambda lp, w, b: -b["advantages"][:, None] * lp)
            losses.append(out.loss)
    if rank == 0:
        print("RESULT " + json.dumps({"losses": losses}), flush=True)


if __name__ == "__main__":
    main()
