"""One rule for the folders moetune writes whole (moetune/output_dir.py), used by every export, the run's adapter/
and the rebuilt base: a lock (a second writer fails at once, the first is unharmed), atomic (a killed export
leaves no half folder), a symlinked --out writes the directory it points to and keeps the link."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from safetensors.torch import load_file

from helpers import hf_model, random_adapter, save_hf
from moetune.errors import ExportError, OutputError
from moetune.export import export_adapter, export_merged
from moetune.model.adapter_io import save_adapter
from moetune.output_dir import atomic_output_dir


@pytest.fixture
def base(tmp_path):
    return save_hf(hf_model(seed=21), tmp_path / "base")


@pytest.fixture
def adapter(base, tmp_path):
    random_adapter(base, tmp_path / "adapter", ["q_proj"], rank=4)
    return tmp_path / "adapter"


def hidden(tmp_path, name):
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(f".{name}."))


@pytest.mark.parametrize("kind", ["merged", "adapter"])
def test_a_second_writer_of_one_folder_fails_at_once_and_the_first_is_unharmed(tmp_path, base, adapter, kind):
    out = tmp_path / "out"
    with atomic_output_dir(out, label="the first export") as first:
        (tmp_path / "first-was-here").write_text("")
        open(os.path.join(first, "config.json"), "w").write("{}")
        with pytest.raises(OutputError, match=rf"--out {out}: another process \(pid {os.getpid()}\) is writing it"):
            if kind == "merged":
                export_merged(base, adapter, out)
            else:
                export_adapter(adapter, out, format="peft")
        assert not out.exists() and os.listdir(first) == ["config.json"]  # the loser deleted nothing
    assert os.listdir(out) == ["config.json"]  # the winner's export is in place, whole
    assert hidden(tmp_path, "out") == []  # no temporary, no lock left


def test_a_killed_export_leaves_no_half_folder_and_the_next_one_cleans_up(tmp_path, base, adapter):
    out = tmp_path / "merged"
    script = textwrap.dedent(f"""
        import os, signal
        from moetune.export import safetensors_io
        from moetune.export import export_merged
        write = safetensors_io.ShardedWriter.write
        def write_then_die(self, name, t):
            write(self, name, t)
            if self._pos == 5:
                os.kill(os.getpid(), signal.SIGKILL)
        safetensors_io.ShardedWriter.write = write_then_die
        export_merged({str(base)!r}, {str(adapter)!r}, {str(out)!r}, max_shard_bytes=20000)
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert not out.exists()  # no config.json + .tmp shard without a marker: nothing at --out at all
    (debris,) = [n for n in hidden(tmp_path, "merged") if ".tmp-" in n]
    assert os.listdir(tmp_path / debris)  # the premise: it died halfway through
    export_merged(base, adapter, out)
    assert (out / "config.json").is_file() and load_file(out / "model.safetensors")
    assert hidden(tmp_path, "merged") == []  # the dead writer's temporary is gone


@pytest.mark.parametrize("kind", ["merged", "adapter"])
def test_a_symlinked_out_writes_the_directory_it_points_to_and_keeps_the_link(tmp_path, base, adapter, kind):
    target = tmp_path / "disk2" / "exports"
    (tmp_path / "disk2").mkdir()
    link = tmp_path / "out"
    link.symlink_to(target)  # dangling: the target is created
    for _ in range(2 if kind == "adapter" else 1):  # an adapter export replaces an earlier one through the link
        if kind == "merged":
            export_merged(base, adapter, link)
        else:
            export_adapter(adapter, link, format="peft")
        assert link.is_symlink() and os.readlink(link) == str(target)
        assert (target / ("config.json" if kind == "merged" else "adapter_config.json")).is_file()
    assert hidden(tmp_path / "disk2", "exports") == [] and hidden(tmp_path, "out") == []


def test_a_symlink_to_a_file_is_refused(tmp_path, adapter):
    (tmp_path / "f").write_text("mine")
    (tmp_path / "out").symlink_to(tmp_path / "f")
    with pytest.raises(ExportError, match="exists and is not a directory"):
        export_adapter(adapter, tmp_path / "out", format="peft")
    assert (tmp_path / "f").read_text() == "mine"


def test_the_runs_adapter_follows_the_rule(tmp_path):
    meta = dict(rank=2, alpha=4, dropout=0.0, rslora=False, targets=["q_proj"])
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="holds other files \\(notes.txt\\)"):
        save_adapter({}, str(out), meta)
    assert os.listdir(out) == ["notes.txt"]
    (out / "notes.txt").unlink()
    with atomic_output_dir(out):  # another writer holds it
        with pytest.raises(OutputError, match="is writing it now"):
            save_adapter({}, str(out), meta)
    save_adapter({}, str(out), meta)
    save_adapter({}, str(out), dict(meta, rank=3))  # an earlier adapter is replaced whole
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert '"rank": 3' in (out / "adapter_config.json").read_text()


@pytest.mark.parametrize("fmt", ["peft", "vllm"])
def test_an_adapter_export_on_a_full_disk_is_an_output_error_and_writes_nothing(tmp_path, adapter, fmt):
    import resource

    out = tmp_path / "out"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # writes past 4 KiB fail as on a full disk
    try:
        with pytest.raises(OutputError, match=rf"{out}: cannot write the export"):
            export_adapter(adapter, out, format=fmt)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert not out.exists() and hidden(tmp_path, "out") == []
