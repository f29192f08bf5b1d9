"""Expert-load statistics against a hand-computed routing, the load alarms, and what MetricsWriter hands the trackers."""

import json
import logging
import math

import pytest
import torch

from moetune.config import load_config
from moetune.model.config import ModelConfig
from moetune.model.glm4_moe import MoE
from moetune.train.metrics import (ExpertLoadMonitor, MetricsWriter, expert_load_stats, load_heatmap_image,
                                   moe_layer_ids, tracker_scalars)


def routed_moe(router_weight, bias):
    """A MoE layer (4 experts, top-2, hidden 4) whose routing is set by hand."""
    cfg = ModelConfig.from_hf_dict(dict(hidden_size=4, moe_intermediate_size=8, n_routed_experts=4,
                                        num_experts_per_tok=2, n_shared_experts=1, num_attention_heads=1,
                                        num_key_value_heads=1, head_dim=4))
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.1)
        moe.gate.weight.copy_(router_weight)
        moe.gate.e_score_correction_bias.copy_(torch.tensor(bias))
    return moe


def test_expert_load_stats_match_a_hand_computed_routing():
    # Layer A: the router weight is the identity, so token t prefers the experts where x_t is large:
    #   t0 -> {0, 1}, t1 -> {0, 2}, t2 -> {2, 3}, t3 -> {3, 0}: counts [3, 1, 2, 2]
    # Layer B: a zero router (every score 0.5) and a bias for experts 1 and 2: every token -> {1, 2}: [0, 4, 4, 0]
    x = torch.tensor([[5.0, 4, -5, -5], [5, -5, 4, -5], [-5, -5, 5, 4], [4, -5, -5, 5]])
    layer_a = routed_moe(torch.eye(4), [0.0] * 4)
    layer_b = routed_moe(torch.zeros(4, 4), [0.0, 0.3, 0.2, 0.0])
    layer_a(x)
    layer_b(x)
    counts = torch.stack([layer_a.last_counts, layer_b.last_counts])
    assert counts.tolist() == [[3, 1, 2, 2], [0, 4, 4, 0]]
    s = expert_load_stats(counts)
    assert s["expert_counts"] == [[3, 1, 2, 2], [0, 4, 4, 0]]
    assert s["expert_max_over_mean"] == [1.5, 2.0]  # means 2 and 2
    assert s["expert_cv"] == pytest.approx([math.sqrt(0.5) / 2, 1.0], abs=1e-4)  # population std sqrt(.5) and 2
    assert s["expert_dead"] == [0, 2]
    h = -(3 / 8 * math.log(3 / 8) + 1 / 8 * math.log(1 / 8) + 2 * 2 / 8 * math.log(2 / 8)) / math.log(4)
    assert s["expert_load_entropy"] == pytest.approx([h, 0.5], abs=1e-4)  # two of four experts, evenly: log 2 / log 4
    assert json.loads(json.dumps(s)) == s  # plain JSON for metrics.jsonl


def record(step, counts):
    s = expert_load_stats(torch.tensor(counts))
    return {"step": step, **s}


def test_dead_expert_alarm_fires_once_after_n_intervals_and_rearms():
    mon = ExpertLoadMonitor(dead_intervals=3, max_over_mean=0, layer_ids=[1, 2])
    alive, dead = [[5, 5, 5, 5], [5, 5, 5, 5]], [[5, 5, 5, 5], [10, 0, 5, 5]]
    assert [mon.update(record(s, dead)) for s in (10, 20)] == [None, None]
    msg = mon.update(record(30, dead))
    assert msg == "experts with no token for 3 intervals: layer 2 [1]"
    assert mon.update(record(40, dead)) is None  # still dead: said once
    assert mon.update(record(50, alive)) is None
    assert [mon.update(record(s, dead)) for s in (60, 70)] == [None, None]
    assert mon.update(record(80, dead)) == msg


def test_imbalance_alarm_on_crossing_the_threshold():
    mon = ExpertLoadMonitor(dead_intervals=0, max_over_mean=2.5)
    assert mon.update(record(1, [[1, 1, 1, 1]])) is None
    msg = mon.update(record(2, [[12, 1, 1, 2]]))  # max/mean = 12 / 4 = 3
    assert msg == "busiest expert above 2.5x the mean load: MoE layer 0 (3.0x, expert 0)"
    assert mon.update(record(3, [[12, 1, 1, 2]])) is None
    assert mon.update(record(4, [[1, 1, 1, 1]])) is None
    assert mon.update(record(5, [[1, 1, 14, 0]])).endswith("(3.5x, expert 2)")


def cfg_for(tmp_path, *over):
    return load_config(None, ["--run.output_dir", str(tmp_path), "--model.num_hidden_layers", "3", *over])


def test_metrics_writer_logs_the_alarm(tmp_path, caplog):
    cfg = cfg_for(tmp_path, "--logging.report_to", "[]", "--logging.alarm_dead_intervals", "1")
    w = MetricsWriter(tmp_path / "metrics.jsonl", True, cfg=cfg)
    with caplog.at_level(logging.WARNING, logger="moetune"):
        w.write(record(10, [[4, 0, 4, 4], [4, 4, 4, 4]]))
    w.close()
    # tiny: layer 0 is dense, so MoE row 0 is decoder layer 1
    assert "step 10: expert load: experts with no token for 1 intervals: layer 1 [1]" in caplog.text
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["expert_dead"] == [1, 0]


def test_old_constructor_writes_only_jsonl(tmp_path):
    w = MetricsWriter(tmp_path / "metrics.jsonl", True)
    w.write({"step": 1, "loss": 2.0})
    w.close()
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]
    MetricsWriter(tmp_path / "other.jsonl", False, cfg=cfg_for(tmp_path)).write({"step": 1})  # other ranks: nothing
    assert not (tmp_path / "other.jsonl").exists()


def test_tensorboard_gets_scalars_expert_stats_config_and_version(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from moetune import __version__

    cfg = cfg_for(tmp_path)  # report_to: auto -> tensorboard, since it is installed
    w = MetricsWriter(tmp_path / "metrics.jsonl", True, cfg=cfg)
    w.write({"step": 1, "loss": 3.0, "lr": 1e-3, "tokens_per_s": 100.0, "mem_gib": 0.5})
    w.write({**record(2, [[4, 0, 4, 4], [1, 2, 3, 6]]), "loss": 2.5, "aux_loss": 1.1})
    w.write({"step": 2, "eval_loss": 2.75})
    w.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0, "images": 0}).Reload()
    scalars = acc.Tags()["scalars"]
    assert {"train/loss", "train/lr", "perf/tokens_per_s", "perf/mem_gib", "eval/loss", "train/aux_loss",
            "experts/dead_total", "experts/max_over_mean_worst_layer", "experts_by_layer/cv/layer_02"} <= set(scalars)
    assert [e.value for e in acc.Scalars("train/loss")] == [3.0, 2.5]
    assert acc.Scalars("experts/dead_total")[0].value == 1
    assert acc.Tags()["images"] == ["experts/load_heatmap"]
    texts = {t: acc.Tensors(t)[0].tensor_proto.string_val[0].decode() for t in acc.Tags()["tensors"]}
    assert f"moetune {__version__}" in texts["run/versions/text_summary"]
    assert "expert_stats_every: 10" in texts["run/config/text_summary"]


def test_report_to_validation_and_missing_wandb(tmp_path):
    from moetune.train.trackers import TrackerError, resolve_report_to

    assert resolve_report_to("auto") == ["tensorboard"]
    assert load_config(None, ["--logging.report_to", "tensorboard"]).logging.report_to == ["tensorboard"]
    assert load_config(None, ["--logging.report_to", "[]"]).logging.report_to == []
    try:
        import wandb  # noqa: F401
    except ImportError:
        with pytest.raises(TrackerError, match="pip install wandb.*WANDB_MODE=offline"):
            MetricsWriter(tmp_path / "m.jsonl", True, cfg=cfg_for(tmp_path, "--logging.report_to", "[tensorboard, wandb]"))


def test_tracker_scalars_and_heatmap_shapes():
    rec = record(5, [[1, 2, 3, 0]])
    sc = tracker_scalars({**rec, "checkpoint_s": 1.5, "something_new": 2}, layer_ids=[7])
    assert sc["experts_by_layer/dead/layer_07"] == 1 and sc["checkpoint/seconds"] == 1.5 and sc["other/something_new"] == 2
    img = load_heatmap_image([[1, 2, 3, 0], [2, 2, 2, 2]])
    assert img.dtype.name == "uint8" and img.shape[2] == 3 and img.shape[1] == 512
    assert (img[0, -1] == 0).all()  # no token: black


def test_moe_layer_ids(tmp_path):
    assert moe_layer_ids(load_config(None)) == [1, 2, 3]
    assert moe_layer_ids(load_config(None, ["--model.path", str(tmp_path / "missing")])) is None


def test_a_step_is_timed_on_the_compute_stream_only(monkeypatch):
    """The throughput timer waits for the compute stream, not the whole device: the bad-step guard's host copy of the
    LoRA state runs on its own stream under the next step, and a device-wide synchronize exposed it (with LoRA on
    AIR-8's experts, 42 ms of a 119 ms step). CPU twin of the CUDA path: the torch.cuda calls are recorded."""
    from moetune.train.metrics import Throughput

    waited = []

    class Stream:
        def synchronize(self):
            waited.append("compute stream")

    def device_wide(*a, **k):
        raise AssertionError("a device-wide synchronize waits for the guard's copy stream too")

    monkeypatch.setattr(torch.cuda, "synchronize", device_wide)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    timer = Throughput()
    assert timer.lap(torch.device("cuda", 0)) >= 0 and waited == ["compute stream"]
    assert timer.lap(torch.device("cpu")) >= 0 and waited == ["compute stream"]  # nothing to wait for on the CPU


def test_allocator_retries_are_recorded_and_said_once(monkeypatch, caplog):
    """A CUDA run's records carry the allocator's retry count and the reserved peak; the first step with a retry
    warns (once): such a step waited on a synchronising cudaFree of the whole cache. A CPU run records neither."""
    import logging

    from moetune.train.metrics import AllocatorPressure

    assert AllocatorPressure(torch.device("cpu")).record(1) == {}
    retries = iter([0, 2, 5])
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"num_alloc_retries": next(retries)})
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 3 * 2**30)
    p = AllocatorPressure(torch.device("cuda", 0))
    with caplog.at_level(logging.WARNING, logger="moetune"):
        records = [p.record(s) for s in (1, 2, 3)]
    assert [r["alloc_retries"] for r in records] == [0, 2, 5]
    assert records[0]["mem_reserved_gib"] == 3.0
    warned = [r.message for r in caplog.records if "freed its cache" in r.message]
    assert len(warned) == 1 and "step 2" in warned[0]
