"""What a person watching the run sees per step: a tqdm bar on a terminal, else (a batch job, stdout redirected, or
`logging.progress_bar: false`) one plain log line every `logging.every` steps: step, loss, lr, tokens/s, memory, ETA."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("moetune")


def progress(cfg, is_main: bool, first_step: int):
    if not is_main:
        return _Silent()
    if cfg.logging.progress_bar and sys.stdout.isatty() and sys.stderr.isatty():
        return _Bar(cfg.train.steps, first_step)
    return _Lines(cfg.train.steps, first_step, cfg.logging.every)


def format_eta(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class _Silent:
    def update(self, step: int, record: dict) -> None:
        pass

    def write(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass


class _Lines:
    def __init__(self, total: int, first_step: int, every: int):
        self.total, self.every, self.first = total, every, first_step
        self.t0 = time.perf_counter()

    def update(self, step: int, record: dict) -> None:
        if step % self.every and step != self.total:
            return
        done = step - self.first
        eta = (time.perf_counter() - self.t0) / max(done, 1) * (self.total - step)
        mem = record.get("mem_gib")
        log.info("step %d/%d | loss %.4f | lr %.3g | %s tok/s | mem %s | ETA %s", step, self.total, record["loss"],
                 record["lr"], f"{record['tokens_per_s']:,.0f}", f"{mem:.2f} GiB" if mem is not None else "n/a",
                 format_eta(eta))

    def write(self, s: str) -> None:
        log.info(s)

    def close(self) -> None:
        pass


class _Bar:
    def __init__(self, total: int, initial: int):
        from tqdm.auto import tqdm

        self.t = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True)

    def update(self, step: int, record: dict) -> None:
        self.t.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)
        self.t.update(step - self.t.n)

    def write(self, s: str) -> None:
        self.t.write(s)

    def close(self) -> None:
        self.t.close()
