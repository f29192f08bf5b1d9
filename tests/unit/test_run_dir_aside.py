"""A run started over moves the earlier run aside: only a moetune run (recognised by its own files) is moved; a
project folder that happens to carry the run's name is refused with nothing moved; a run directory symlinked to
another file system is handled without EXDEV and a failed move is undone (no empty .earlier-* left behind)."""

import errno
import os

import pytest
import yaml

from helpers import run_inprocess, small_run_args
from moetune.errors import ConfigError
from moetune.run_dir import move_earlier_run_aside


def fake_run(path):
    (path / "checkpoints" / "step_000002").mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump({"run": {}, "model": {}, "data": {}, "train": {}}))
    (path / "metrics.jsonl").write_text('{"step": 1}\n')
    (path / ".lock").write_text("")
    return path


def tree(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_a_project_folder_with_the_runs_name_is_refused_and_nothing_moves(tmp_path):
    project = tmp_path / "runs" / "myproj"
    project.mkdir(parents=True)
    (project / "config.yaml").write_text("lr: 3\n")  # the project's own config, not a run's
    (project / "train.py").write_text("print('mine')\n")
    before = tree(project)
    with pytest.raises(ConfigError, match=r"holds what a moetune run does not write \(config.yaml \(not a moetune "
                                          r"run's config\), train.py\): nothing is moved"):
        move_earlier_run_aside(project)
    assert tree(project) == before and os.listdir(tmp_path / "runs") == ["myproj"]


def test_a_run_with_a_file_a_run_never_writes_is_refused(tmp_path):
    run = fake_run(tmp_path / "r")
    (run / "notes.md").write_text("mine")
    before = tree(run)
    with pytest.raises(ConfigError, match=r"\(notes.md\)"):
        move_earlier_run_aside(run)
    assert tree(run) == before and os.listdir(tmp_path) == ["r"]


def test_moetune_train_refuses_a_project_folder_before_any_work(tmp_path, monkeypatch):
    import moetune.train.trainer as trainer

    args = small_run_args(tmp_path, "proj", **{"train.steps": 1})
    project = tmp_path / "runs" / "proj"
    project.mkdir(parents=True)
    (project / "README.md").write_text("my project")
    monkeypatch.setattr(trainer, "setup_data", lambda *a: pytest.fail("data prepared for a refused run directory"))
    with pytest.raises(ConfigError, match=r"holds what a moetune run does not write \(README.md\)"):
        run_inprocess(args)
    assert os.listdir(project) == ["README.md"]  # not even a .lock
    assert os.listdir(tmp_path / "runs") == ["proj"]


def test_a_data_folder_that_is_not_the_demos_is_not_a_runs(tmp_path):
    run = fake_run(tmp_path / "r")
    (run / "data").mkdir()
    (run / "data" / "train.jsonl").write_text("")
    (run / "data" / "mine.csv").write_text("")  # the demo writes train.jsonl and eval.jsonl only
    with pytest.raises(ConfigError, match=r"\(data/ \(not the demo's data\)\)"):
        move_earlier_run_aside(run)
    (run / "data" / "mine.csv").unlink()
    assert move_earlier_run_aside(run) is not None


class TwoFileSystems:
    """os.rename/os.replace refuse (EXDEV) a move between tmp/fs1 and tmp/fs2, as between two mounts."""

    def __init__(self, tmp_path, monkeypatch):
        self.roots = [os.path.realpath(tmp_path / "fs1"), os.path.realpath(tmp_path / "fs2")]
        for r in self.roots:
            os.makedirs(r)
        for name in ("rename", "replace"):
            real = getattr(os, name)

            def move(src, dst, *a, _real=real, **k):
                if self.fs(src) != self.fs(os.path.join(os.path.realpath(os.path.dirname(dst)),
                                                        os.path.basename(dst))):
                    raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src), None, str(dst))
                return _real(src, dst, *a, **k)

            monkeypatch.setattr(os, name, move)

    def fs(self, path):
        path = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
        return next((r for r in self.roots if path.startswith(r + os.sep)), None)


def test_a_run_dir_symlinked_to_another_file_system_is_moved_beside_its_target(tmp_path, monkeypatch):
    fss = TwoFileSystems(tmp_path, monkeypatch)
    (tmp_path / "fs2" / "big").mkdir()
    target = fake_run(tmp_path / "fs2" / "big" / "demo")
    link = tmp_path / "fs1" / "demo"
    link.symlink_to(target)
    moved = move_earlier_run_aside(link)
    assert moved.parent == target.parent and moved.name.startswith("demo.earlier-")
    assert (moved / "checkpoints" / "step_000002").is_dir() and (moved / "metrics.jsonl").is_file()
    assert os.listdir(target) == [".lock"] and link.is_symlink()
    assert fss.fs(str(moved)) == fss.roots[1]


def test_a_move_that_fails_halfway_is_undone(tmp_path, monkeypatch):
    run = fake_run(tmp_path / "r")
    before = tree(run)
    real = os.rename
    calls = []

    def failing(src, dst, *a, **k):
        calls.append(src)
        if len(calls) == 2:
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(src))
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", failing)
    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(ConfigError, match="cannot move the earlier run aside .*nothing is moved"):
        move_earlier_run_aside(run)
    monkeypatch.undo()
    assert tree(run) == before and os.listdir(tmp_path) == ["r"]  # no empty .earlier-* left behind


def test_a_killed_adapter_writers_files_are_a_runs(tmp_path):
    run = fake_run(tmp_path / "r")
    (run / ".adapter.lock").write_text("123")  # a trainer killed while writing its adapter (moetune/output_dir.py)
    (run / ".adapter.tmp-x1y2").mkdir()
    moved = move_earlier_run_aside(run)
    assert (moved / ".adapter.tmp-x1y2").is_dir() and os.listdir(run) == [".lock"]
