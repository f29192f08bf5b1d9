"""train/memory_snapshot.py: replaying the CUDA allocator's history to its peak (what `logging.memory_snapshot_step`
writes beside the snapshot), on a synthetic history in the allocator's own format."""

from moetune.train.memory_snapshot import MemorySnapshot, live_at_peak, summarize


def _alloc(addr, size, where):
    return {"action": "alloc", "addr": addr, "size": size,
            "frames": [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
                       {"filename": f"/src/moetune/model/{where}.py", "line": 7, "name": "forward"}]}


def _free(addr):
    return {"action": "free_requested", "addr": addr}


def test_the_peak_and_what_is_live_there():
    # 100 + 50 = 150 live, 100 freed, then 30 + 40 + 20 → 140, 30 freed → peak 150 with blocks 100 and 50; a free of
    # a block allocated before the history began (addr 9) is ignored
    trace = [_alloc(1, 100, "a"), _alloc(2, 50, "b"), _free(9), _free(1), _alloc(3, 30, "c"), _alloc(4, 40, "c"),
             _alloc(5, 20, "a"), _free(3)]
    peak, blocks = live_at_peak({"device_traces": [trace]})
    assert peak == 150
    assert sorted(size for size, _ in blocks) == [50, 100]
    s = summarize({"device_traces": [trace]})
    assert [g["blocks"] for g in s["groups"]] == [1, 1]
    assert s["groups"][0]["where"].startswith("a.py:7 forward") and s["largest"][0]["bytes"] == 100


def test_a_later_higher_peak_wins_and_frees_before_it_count():
    trace = [_alloc(1, 100, "a"), _free(1), _alloc(2, 60, "b"), _alloc(3, 70, "c"), _free(2), _alloc(4, 200, "d")]
    peak, blocks = live_at_peak({"device_traces": [trace]})
    assert peak == 270 and sorted(size for size, _ in blocks) == [70, 200]


def test_off_the_gpu_or_at_step_zero_it_records_nothing(tmp_path):
    import torch

    snap = MemorySnapshot(torch.device("cpu"), 3, str(tmp_path / "m"), 0)
    snap.begin(3)
    snap.end(3)
    assert not (tmp_path / "m").exists()
    assert not MemorySnapshot(torch.device("cuda", 0), 0, str(tmp_path), 0).on


def test_a_profiled_step_writes_its_trace_and_changes_nothing(tmp_path):
    """logging.profile_step: the step's Chrome trace and its top operators land in the run directory's profile/;
    the run's losses equal those of the same run unprofiled (the profiler observes, it does not change the step)."""
    import gzip
    import json

    from helpers import run_inprocess, small_run_args, step_losses

    plain = run_inprocess(small_run_args(tmp_path, "plain", **{"train.steps": 3}))
    profiled = run_inprocess(small_run_args(tmp_path, "profiled", **{"train.steps": 3, "logging.profile_step": 2}))
    assert step_losses(profiled) == step_losses(plain)
    files = sorted(p.name for p in (profiled / "profile").iterdir())
    assert files == ["step2_rank0.json.gz", "step2_rank0_top.txt"]
    with gzip.open(profiled / "profile" / "step2_rank0.json.gz") as f:
        events = json.load(f)["traceEvents"]
    assert any("aten::" in e.get("name", "") for e in events)  # the step's operators, not an empty trace
    top = (profiled / "profile" / "step2_rank0_top.txt").read_text()
    assert "Self CPU" in top
    # the step's phases, each once (one micro-batch), forward and backward first by their host time on the CPU
    phases = {line.split()[0]: line.split()[1:] for line in top.split("\n\n")[0].splitlines()[1:]}
    assert set(phases) == {"forward", "backward", "grad_norm", "guard_snapshot", "optimizer", "guard_check",
                           "guard_record"}
    assert all(calls == "1" for calls, *_ in phases.values())
    assert float(phases["backward"][1]) > float(phases["guard_record"][1])


def test_a_recorded_step_past_the_last_is_refused_before_the_model_is_built(tmp_path, monkeypatch, capsys):
    """logging.profile_step / memory_snapshot_step past train.steps would record nothing: a ConfigError naming the key
    before the model is built (no minutes of loading for a silent no-op); a step a resumed run has already taken is
    a warning, and the run goes on."""
    import pytest
    from helpers import run_inprocess, small_run_args

    import moetune.train.trainer as trainer
    from moetune.errors import ConfigError

    built = []
    real_setup = trainer.setup_model
    monkeypatch.setattr(trainer, "setup_model", lambda *a, **k: built.append(1) or real_setup(*a, **k))
    for key in ("profile_step", "memory_snapshot_step"):
        with pytest.raises(ConfigError, match=rf"logging.{key}: step 4 is past the run's last step \(train.steps 3\)"):
            run_inprocess(small_run_args(tmp_path, key, **{"train.steps": 3, f"logging.{key}": 4}))
    assert not built
    run_inprocess(small_run_args(tmp_path, "resumed", **{"train.steps": 2}))
    capsys.readouterr()
    run = run_inprocess(small_run_args(tmp_path, "resumed", **{"train.steps": 3, "resume": "auto",
                                                                "logging.profile_step": 1}))
    assert "logging.profile_step: step 1 was taken before this run resumed at step 2" in capsys.readouterr().err
    assert not (run / "profile").exists()


def test_a_failing_profiled_step_still_ends_the_profiler(tmp_path, monkeypatch):
    """The profiler and the memory recorder end with their step even when it raises (an out-of-memory step's history
    is the one to look at): the trace is written and no profiler stays on after the run."""
    import pytest
    import torch
    from helpers import run_inprocess, small_run_args

    import moetune.train.trainer as trainer

    def boom(self, *a, **k):
        raise RuntimeError("step failed")

    monkeypatch.setattr(trainer.Trainer, "_compute", boom)
    with pytest.raises(RuntimeError, match="step failed"):
        run_inprocess(small_run_args(tmp_path, "failing", **{"train.steps": 3, "logging.profile_step": 1}))
    assert (tmp_path / "runs" / "failing" / "profile" / "step1_rank0_top.txt").exists()
    assert torch.autograd.profiler._is_profiler_enabled is False


def test_the_phase_table_merges_a_phases_host_and_device_ranges():
    """On a GPU a phase appears twice among torch.profiler's averages: its host range (host time, the kernels it
    launched) and its range on the device's timeline (no host time; the span, idle time included). One row each."""
    from types import SimpleNamespace as E

    from moetune.train.step_profile import phase_table

    events = [E(key="moetune.forward", cpu_time_total=359_800.0, device_time_total=207_200.0, count=1),
              E(key="moetune.forward", cpu_time_total=0.0, device_time_total=370_400.0, count=1),
              E(key="moetune.guard_record", cpu_time_total=202_900.0, device_time_total=296_400.0, count=1),
              E(key="aten::mm", cpu_time_total=5.0, device_time_total=9.0, count=3)]
    rows = [line.split() for line in phase_table(events).splitlines()]
    assert rows[0] == ["phase", "calls", "host", "ms", "kernels", "ms", "GPU", "span", "ms"]
    assert rows[1:] == [["forward", "1", "359.8", "207.2", "370.4"], ["guard_record", "1", "202.9", "296.4", "0.0"]]
