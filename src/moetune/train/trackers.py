"""Experiment trackers fed by MetricsWriter: TensorBoard (the default when it is installed) and Weights & Biases.

Both are optional imports. `logging.report_to: auto` means TensorBoard if the `tensorboard` package imports, else
none (metrics.jsonl is always written); naming a tracker that is not installed is an error at the start of the run
rather than a silently missing dashboard. W&B honours its own environment (WANDB_MODE=offline works without a
network, WANDB_PROJECT, WANDB_ENTITY); the project defaults to "moetune".

Each tracker also records what produced the run: the resolved config.yaml and the versions of moetune, torch and
transformers (TensorBoard: a text summary; W&B: the run config).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from moetune.errors import TrackerError  # noqa: F401  (re-exported)

log = logging.getLogger("moetune")

WANDB_MISSING = ("logging.report_to includes wandb, but wandb is not installed: pip install wandb "
                 "(WANDB_MODE=offline logs without a network), or drop it from logging.report_to")
TENSORBOARD_MISSING = ("logging.report_to includes tensorboard, but tensorboard is not installed: "
                       "pip install tensorboard, or drop it from logging.report_to")




def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def resolve_report_to(report_to) -> list[str]:
    if report_to == "auto":
        return ["tensorboard"] if tensorboard_available() else []
    return list(report_to)


def check_trackers(cfg) -> list[str]:
    """The trackers this config will use; raises TrackerError for one that is asked for and missing. Cheap: call it
    before building the model, so a missing package fails the run in seconds rather than after loading weights."""
    names = resolve_report_to(cfg.logging.report_to)
    if "tensorboard" in names and not tensorboard_available():
        raise TrackerError(TENSORBOARD_MISSING)
    if "wandb" in names and importlib.util.find_spec("wandb") is None:
        raise TrackerError(WANDB_MISSING)
    return names


def run_description(cfg) -> dict:
    import torch

    from moetune.version import __version__
    from moetune.config import config_to_yaml

    try:
        import transformers

        tf = transformers.__version__
    except ImportError:  # pragma: no cover
        tf = None
    return {"moetune": __version__, "torch": torch.__version__, "transformers": tf, "config_yaml": config_to_yaml(cfg)}


def build_trackers(cfg, run_dir: Path, resume: bool, first_step: int) -> list:
    trackers = []
    for name in check_trackers(cfg):
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(Path(run_dir) / "tensorboard", purge_step=first_step if resume else None))
        elif name == "wandb":
            trackers.append(WandbTracker(cfg, Path(run_dir), resume))
    desc = run_description(cfg)
    for t in trackers:
        t.describe(desc)
    return trackers


FLUSH_SECONDS = 5


class TensorBoardTracker:
    def __init__(self, log_dir: Path, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run re-logs the steps after its last checkpoint; TensorBoard drops the old ones.
        # flush_secs: the writer's own thread writes the events to disk every few seconds, so a TensorBoard watching
        # a live run is at most that far behind; a flush per step cost ~1-5 ms of the step's host time, where the GPU
        # waits (metrics.jsonl, written every step, is the record a crash keeps)
        self.writer = SummaryWriter(str(log_dir), purge_step=purge_step, flush_secs=FLUSH_SECONDS)

    def describe(self, desc: dict) -> None:
        versions = ", ".join(f"{k} {v}" for k, v in desc.items() if k != "config_yaml" and v)
        self.writer.add_text("run/versions", versions, 0)
        # TensorBoard renders text as markdown: indent by 4 spaces so the YAML shows as a code block
        self.writer.add_text("run/config", "\n".join("    " + line for line in desc["config_yaml"].splitlines()), 0)

    def log(self, step: int, scalars: dict, images: dict | None = None) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)
        for k, img in (images or {}).items():
            self.writer.add_image(k, img, step, dataformats="HWC")

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, cfg, run_dir: Path, resume: bool):
        try:
            import wandb
        except ImportError:
            raise TrackerError(WANDB_MISSING) from None
        self.wandb = wandb
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if resume and id_file.exists() else wandb.util.generate_id()
        os.makedirs(run_dir, exist_ok=True)
        id_file.write_text(run_id)  # a resumed run continues the same W&B run instead of starting a new one
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "moetune"), name=cfg.run.name, id=run_id,
                              resume="allow", dir=str(run_dir), config=cfg.model_dump(mode="json"))

    def describe(self, desc: dict) -> None:
        self.run.config.update({k: v for k, v in desc.items() if k != "config_yaml"}, allow_val_change=True)

    def log(self, step: int, scalars: dict, images: dict | None = None) -> None:
        data = dict(scalars)
        for k, img in (images or {}).items():
            data[k] = self.wandb.Image(img)
        self.run.log(data, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)  # a run that ended in an error shows as failed, not finished
