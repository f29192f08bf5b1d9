"""What may be unpickled from a checkpoint is decided in one place (moetune/checkpoint_reading.py): DCP's
index may name only DCP's metadata classes, a non-tensor entry only plain data. A hostile or damaged index is a
CheckpointError naming the file, for training's resume and for export / generate, which read checkpoints too."""

import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from helpers import run_inprocess, small_run_args
from moetune.checkpoint_reading import dcp_load, read_dcp_index
from moetune.cli import main
from moetune.errors import CheckpointError
from moetune.export import export_adapter
from moetune.run_dir import load_model_state, verify_checkpoint


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("unpickling")
    run = run_inprocess(small_run_args(tmp, "r", **{"train.steps": 1, "checkpoint.every": 1}))
    shutil.rmtree(run / "adapter")  # export and generate then read the newest checkpoint
    return run


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # what a hostile index could do: call anything


@pytest.fixture
def hostile_copy(run, tmp_path):
    """A copy of the run whose checkpoint's .metadata is replaced by `payload`."""

    def make(payload):
        copy = tmp_path / "copy"
        shutil.copytree(run, copy)
        (copy / "checkpoints" / "step_000001" / ".metadata").write_bytes(pickle.dumps(payload))
        return copy

    return make


def test_an_index_that_would_run_code_is_refused_as_damaged(hostile_copy, tmp_path):
    marker = tmp_path / "ran"
    copy = hostile_copy(RunsCode(str(marker)))
    ckpt = copy / "checkpoints" / "step_000001"
    for read in (verify_checkpoint, load_model_state):
        with pytest.raises(CheckpointError, match=rf"checkpoint {ckpt} is damaged: cannot read {ckpt}/.metadata "
                                                  r"\(UnpicklingError: it names io.open, which is not part of a DCP index\)"):
            read(ckpt)
    with pytest.raises(CheckpointError, match="not part of a DCP index"):
        export_adapter(copy, tmp_path / "out", format="peft")
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("payload, message", [
    ({"state_dict_metadata": {}}, "holds a dict, not a DCP index"),  # was an AttributeError traceback
    ([1, 2], "holds a list, not a DCP index"),
])
def test_an_index_of_another_shape_is_damaged_not_a_traceback(hostile_copy, tmp_path, payload, message):
    ckpt = hostile_copy(payload) / "checkpoints" / "step_000001"
    with pytest.raises(CheckpointError, match=rf"is damaged: {ckpt}/.metadata {message}"):
        verify_checkpoint(ckpt)


def test_an_index_pointing_outside_its_directory_is_refused(run, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run / "checkpoints" / "step_000001", ckpt)
    md = read_dcp_index(ckpt / ".metadata")
    for info in md.storage_data.values():
        info.relative_path = "../../etc/passwd"
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(CheckpointError, match=r"points outside its directory \('../../etc/passwd'\)"):
        verify_checkpoint(ckpt)


def test_an_entry_that_is_not_plain_data_is_refused(tmp_path):
    from fractions import Fraction

    dcp.save({"w": torch.ones(2), "extra": Fraction(1, 3)}, checkpoint_id=str(tmp_path), no_dist=True)
    state = {"w": torch.zeros(2), "extra": None}
    with pytest.raises(Exception, match="entry extra is not plain data"):
        dcp_load(state, tmp_path)
    state = {"w": torch.zeros(2)}
    dcp_load(state, tmp_path)  # the premise: the rest of the checkpoint reads
    assert torch.equal(state["w"], torch.ones(2))


@pytest.mark.parametrize("command", [["export", "adapter", "--format", "peft"], ["export", "merged"]])
def test_the_cli_says_damaged_in_one_line(hostile_copy, tmp_path, capsys, command):
    copy = hostile_copy(RunsCode(str(tmp_path / "ran")))
    rc = main([*command, "--checkpoint", str(copy), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err and "is damaged" in err and "not part of a DCP index" in err, err
    assert not (tmp_path / "ran").exists()


def test_an_index_with_a_shape_that_is_not_one_is_damaged(run, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run / "checkpoints" / "step_000001", ckpt)
    md = read_dcp_index(ckpt / ".metadata")
    name = next(k for k in md.state_dict_metadata if k.startswith("model."))
    md.state_dict_metadata[name].size = [-1, "x"]
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(CheckpointError, match=rf"gives tensor {name} no valid shape and dtype"):
        load_model_state(ckpt)
