"""The run's data: tokenizer, packed train/eval sets, the data-parallel loader. The embedded demo writes its
synthetic dataset into the run directory first (rank 0 writes, the others wait)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from moetune.data import PackedLoader, build_packs, data_options, eval_batches, load_tokenizer
from moetune.parallel import Dist

log = logging.getLogger("moetune")


@dataclass
class RunData:
    tokenizer: object
    loader: PackedLoader
    eval_batches: list
    stats: dict


def resolve_data_paths(cfg, dist: Dist) -> tuple[str, str | None]:
    if cfg.data.train is not None:
        return cfg.data.train, cfg.data.eval
    from moetune.assets.demo_data import write_demo_dataset

    out = cfg.run_dir / "data"
    if dist.is_main:
        write_demo_dataset(out, seed=cfg.run.seed)
    dist.barrier()
    return str(out / "train.jsonl"), cfg.data.eval or str(out / "eval.jsonl")


def setup_data(cfg, dist: Dist) -> RunData:
    tok_src = cfg.data.tokenizer or cfg.model.path  # None for both: the embedded demo tokenizer
    tokenizer = load_tokenizer(tok_src)
    train_path, eval_path = resolve_data_paths(cfg, dist)
    kw = dict(data_options(cfg.data), dist=dist)
    packs, stats = build_packs(train_path, tokenizer, cfg.data.seq_len, **kw)
    if dist.is_main:
        log.info("train data %s: %s", train_path, stats)
    loader = PackedLoader(packs, cfg.train.micro_batch_size, dist.dp_rank, dist.dp_size, cfg.run.seed, cfg.data.shuffle)
    ev = []
    if eval_path:
        eval_packs, eval_stats = build_packs(eval_path, tokenizer, cfg.data.seq_len, **kw)
        ev = eval_batches(eval_packs, cfg.train.micro_batch_size, dist.dp_rank, dist.dp_size)
        if dist.is_main:
            log.info("eval data %s: %s", eval_path, eval_stats)
    return RunData(tokenizer, loader, ev, stats)
