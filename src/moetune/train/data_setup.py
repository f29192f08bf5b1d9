"""The run's data: tokenizer, packed train/eval sets, the data-parallel loader. The embedded demo writes its
synthetic dataset into the run directory first (rank 0 writes, the others wait)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from moetune.config import train_steps_for_epochs
from moetune.data import PackedLoader, build_packs, data_options, eval_batches, load_tokenizer
from moetune.errors import ConfigError, DataError
from moetune.model.config import model_config_for
from moetune.parallel.mesh import Dist

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
    tokenizer = run_tokenizer(cfg)
    vocab_size = model_config_for(cfg).vocab_size
    train_path, eval_path = resolve_data_paths(cfg, dist)
    kw = dict(data_options(cfg.data, progress_bar=cfg.logging.progress_bar), dist=dist)
    packs, stats = build_packs(train_path, tokenizer, cfg.data.seq_len, **kw)
    check_token_ids(packs, vocab_size, tokenizer, train_path)
    if dist.is_main:
        log.info("train data %s: %s", train_path, stats)
    loader = PackedLoader(packs, cfg.train.micro_batch_size, dist.dp_rank, dist.dp_size, cfg.run.seed, cfg.data.shuffle)
    if cfg.train.epochs is not None:  # before the scheduler and config.yaml see train.steps
        cfg.train.steps = train_steps_for_epochs(cfg, loader.batches_per_epoch)
        if dist.is_main:
            log.info("train.epochs %g: %d steps of %d packs per epoch", cfg.train.epochs, cfg.train.steps, len(packs))
    ev = []
    if eval_path:
        eval_packs, eval_stats = build_packs(eval_path, tokenizer, cfg.data.seq_len, **kw)
        check_token_ids(eval_packs, vocab_size, tokenizer, eval_path)
        ev = eval_batches(eval_packs, cfg.train.micro_batch_size, dist.dp_rank, dist.dp_size)
        if dist.is_main:
            log.info("eval data %s: %s", eval_path, eval_stats)
    return RunData(tokenizer, loader, ev, stats)


def run_tokenizer(cfg):
    """data.tokenizer, else model.path's tokenizer, else (neither) the embedded demo tokenizer."""
    key, src = ("data.tokenizer", cfg.data.tokenizer) if cfg.data.tokenizer else ("model.path", cfg.model.path)
    if src is not None and not os.path.exists(src) and (os.path.isabs(src) or src.startswith((".", "~"))):
        raise ConfigError(f"{key}: {src} does not exist (a tokenizer directory or a hub name)")
    try:
        return load_tokenizer(src)
    except (OSError, ValueError) as e:  # not a tokenizer directory, or a hub name that cannot be fetched
        # transformers spreads the reason over several lines (what it looked for, then why): one line, all of it
        reason = " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
        raise ConfigError(f"{key}: cannot load a tokenizer from {src!r}: {reason}") from None


def check_token_ids(packs: list[dict], vocab_size: int, tokenizer, path: str) -> None:
    """Every token id must be a row of the model's embedding: a larger tokenizer would fail at step 1 with an
    IndexError (a device-side assert on a GPU), after the run directory is written."""
    top = max((max(p["input_ids"]) for p in packs if p["input_ids"]), default=-1)
    if top >= vocab_size:
        raise DataError(f"{path}: token id {top} is outside the model's vocabulary (vocab_size {vocab_size}); the "
                        f"tokenizer has {len(tokenizer)} tokens. Use the model's own tokenizer (data.tokenizer)")
