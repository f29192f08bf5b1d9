"""`moetune plot RUN_DIR` on a real (tiny) run, including one whose last line is still being written."""

import importlib.util
import json

import pytest

from helpers import small_run_args

needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="moetune[viz] not installed")

PNGS = ("loss.png", "lr.png", "throughput.png", "memory.png", "expert_load.png")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    import moetune.train.loop as loop
    from moetune.config import load_config

    tmp = tmp_path_factory.mktemp("plot")
    cfg = load_config(None, small_run_args(tmp, "p", **{"train.steps": 12, "model.num_hidden_layers": 3,
                                                        "logging.expert_stats_every": 2, "eval.every": 4,
                                                        "train.aux_loss_coef": 0.01}))

    loop.train(cfg)  # the loop hands its config to MetricsWriter, which starts the trackers
    return cfg.run_dir


@needs_matplotlib
def test_plot_writes_every_png(run_dir, capsys):
    from moetune.cli import main

    assert main(["plot", str(run_dir)]) == 0
    printed = capsys.readouterr().out.split()
    for name in PNGS:
        path = run_dir / name
        assert str(path) in printed
        assert path.stat().st_size > 10_000, name  # a real figure, not an empty canvas
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_matplotlib
def test_plot_tolerates_a_partial_last_line_and_a_resumed_run(run_dir, tmp_path, capsys):
    from moetune.plot import plot_run, read_metrics, series

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    live = tmp_path / "live"
    live.mkdir()
    (live / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    # a resume re-logs step 11 with another loss; the last line is cut mid-write
    step11 = next(json.loads(x) for x in lines if json.loads(x).get("step") == 11 and "loss" in json.loads(x))
    redo = json.dumps({**step11, "loss": 0.123})
    (live / "metrics.jsonl").write_text("\n".join(lines + [redo, '{"step": 13, "loss": 1.2']))
    records, bad = read_metrics(live / "metrics.jsonl")
    assert bad == 1
    steps, loss = series(records, "loss")
    assert steps == list(range(1, 13)) and loss[10] == 0.123
    written, notes = plot_run(live, tmp_path / "out")
    assert sorted(p.name for p in written) == sorted(PNGS)
    assert any("unreadable" in n for n in notes)


@needs_matplotlib
def test_plot_early_run_leaves_out_what_has_no_data(tmp_path, capsys):
    from moetune.cli import main

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0, "lr": 1e-4, "tokens_per_s": 10.0}) + "\n")
    assert main(["plot", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "expert_load.png: no expert statistics" in err and "memory.png: no data yet" in err
    assert (tmp_path / "loss.png").exists() and not (tmp_path / "expert_load.png").exists()
    (tmp_path / "empty").mkdir()
    assert main(["plot", str(tmp_path / "empty")]) == 1


def test_run_wrote_tensorboard_and_expert_stats(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    expert = [r for r in rows if "expert_counts" in r]
    assert [r["step"] for r in expert] == [2, 4, 6, 8, 10, 12]
    assert len(expert[0]["expert_counts"]) == 2 and all("aux_loss" in r for r in rows if "loss" in r)
    if importlib.util.find_spec("tensorboard") is not None:  # logging.report_to auto: TensorBoard when installed
        assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_plot_without_matplotlib_says_which_extra_installs_it(tmp_path, capsys, monkeypatch):
    # it was a ModuleNotFoundError traceback
    import sys

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` finds when it is not installed
    from moetune.cli import main

    assert main(["plot", str(tmp_path)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "moetune: error: plotting needs matplotlib: pip install 'moetune[viz]'"]
    assert list(tmp_path.iterdir()) == [tmp_path / "metrics.jsonl"]


def test_plot_on_a_folder_without_metrics_is_one_line(tmp_path, capsys):
    from moetune.cli import main

    assert main(["plot", str(tmp_path)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"moetune: error: {tmp_path}: no metrics.jsonl (not a run directory, or a run that has not logged a step "
        "yet)"]


@needs_matplotlib
def test_plot_to_a_place_it_cannot_write_is_one_line(tmp_path, capsys):
    # --out naming a file was a FileExistsError traceback; a folder it cannot write into, a PermissionError one
    from moetune.cli import main

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    (tmp_path / "a_file").write_text("")
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "a_file")]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"moetune: error: --out {tmp_path / 'a_file'}: cannot make the folder (File exists)"]
    (tmp_path / "loss.png").mkdir()  # where the figure goes: savefig cannot write a file there
    assert main(["plot", str(tmp_path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"moetune: error: {tmp_path / 'loss.png'}: cannot write the figure"), err
