"""Export from a checkpoint written by 2 FSDP processes equals export from 1 process of the same training."""

import torch
from safetensors.torch import load_file

from moetune.export import export_adapter
from helpers import run_inprocess, run_torchrun, small_run_args


def test_export_from_two_process_checkpoint_equals_one_process(tmp_path):
    over = {"train.steps": 4, "checkpoint.every": 2}
    one = run_inprocess(small_run_args(tmp_path, "one", **over, **{"train.micro_batch_size": 2}))
    run_torchrun(small_run_args(tmp_path, "two", **over, **{"train.micro_batch_size": 1}), nproc=2)
    two = tmp_path / "runs" / "two"
    exported = {}
    for name, run in (("one", one), ("two", two)):
        # a mid-run DCP checkpoint, the run dir (its final adapter/), both as PEFT adapters
        export_adapter(str(run / "checkpoints" / "step_000002"), str(tmp_path / f"{name}_ck2"), format="peft")
        export_adapter(str(run), str(tmp_path / f"{name}_final"), format="peft")
        exported[name] = {k: load_file(str(tmp_path / f"{name}_{k}" / "adapter_model.safetensors"))
                          for k in ("ck2", "final")}
    for which in ("ck2", "final"):
        a, b = exported["one"][which], exported["two"][which]
        assert a.keys() == b.keys() and any("experts" in k for k in a)
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-5, msg=k)
    # the step-2 checkpoint is not the final adapter: the export read the checkpoint, not adapter/
    assert any(not torch.equal(exported["one"]["ck2"][k], exported["one"]["final"][k]) for k in exported["one"]["ck2"])
