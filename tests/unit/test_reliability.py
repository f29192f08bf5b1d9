"""Issue 13's bugs, one test (or more) each: every bad input a clear MoetuneError naming what is at fault, nothing
lost, nothing non-finite ever written. Subprocess scenarios (signals, the CLI's one-line errors) are in
tests/e2e/test_cli_errors.py."""

import json
import logging
import math
import os
import resource

import pytest
import torch
from safetensors.torch import load_file, save_file

import moetune
from helpers import hf_model, random_adapter, read_metrics, run_inprocess, save_hf, small_run_args, step_losses
from moetune.config import load_config
from moetune.errors import (CheckpointError, ConfigError, DataError, ExportError, MoetuneError, NumericalFault,
                            OutputError, RunDirInUse)
from moetune.export import export_adapter
from moetune.run_dir import RunLock, complete_checkpoints, load_model_state
from moetune.train import loop, trainer

CONSTANT = {"optim.scheduler": "constant"}


def _ckpt(run, step):
    return run / "checkpoints" / f"step_{step:06d}"


# ------------------------------------------------------------------------------------------ 1: NaN never verifies
def test_verify_comparison_fails_on_nan():
    from moetune.export.verify import _check

    assert _check({"a": 1e-6}, 1e-4, "peft") == {"a": 1e-6}
    for bad in (float("nan"), float("inf"), 1e-3):
        with pytest.raises(ExportError, match="differ beyond"):
            _check({"a": 1e-6, "b": bad}, 1e-4, "peft")


def test_adapter_with_a_nan_is_refused_before_anything_is_written(tmp_path):
    base = save_hf(hf_model(seed=3), tmp_path / "base")
    random_adapter(base, tmp_path / "run" / "adapter", ["q_proj", "experts"], rank=4)
    f = tmp_path / "run" / "adapter" / "adapter_model.safetensors"
    data = bytearray(f.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    name = "model.layers.0.self_attn.q_proj.lora_A"
    start = header + json.loads(data[8:header])[name]["data_offsets"][0]
    data[start:start + 4] = b"\xff\xff\xff\x7f"  # a NaN in the first element, as in the issue
    f.write_bytes(bytes(data))
    for fmt in ("peft", "vllm"):
        with pytest.raises(CheckpointError, match=rf"{name} holds non-finite"):
            export_adapter(tmp_path / "run", tmp_path / fmt, format=fmt, verify=True)
        assert not (tmp_path / fmt).exists()


# ------------------------------------------------------------------------------------------ 2: the weights kept are good
def test_a_huge_learning_rate_stops_with_weights_that_resume(tmp_path):
    """lr 1e30: step 1's update leaves finite but huge weights (|w| ~ 1e30) and step 2's loss is NaN. The bad step
    undoes that update, so what is saved is the initial state, and a resume with a sane lr trains."""
    kw = {"train.steps": 8, "checkpoint.max_bad_steps": 3, **CONSTANT}
    with pytest.raises(NumericalFault) as fault:
        run_inprocess(small_run_args(tmp_path, "hot", **kw, **{"optim.lr": 1e30}))
    run = tmp_path / "runs" / "hot"
    (saved,) = [p for _, p in complete_checkpoints(run / "checkpoints")]
    weights = load_model_state(saved)
    assert max(v.abs().max().item() for v in weights.values()) < 10  # not ~1e30
    assert "last good weights" in str(fault.value) and str(saved) in str(fault.value)
    run_inprocess(small_run_args(tmp_path, "hot", **kw, **{"optim.lr": 1e-2, "resume": "auto"}))
    after = [r["loss"] for r in read_metrics(run) if "loss" in r and r["step"] > int(saved.name[5:])]
    assert after and all(math.isfinite(x) for x in after)
    assert all(torch.isfinite(v).all() for v in load_file(run / "adapter" / "adapter_model.safetensors").values())


def test_an_update_that_makes_a_weight_nan_is_undone(tmp_path, monkeypatch):
    """Fewer bad steps than the limit: the run completes, and its adapter holds no NaN (it used to)."""
    real_step, calls = torch.optim.AdamW.step, []

    def step_poisoning_the_third(self, *a, **kw):
        out = real_step(self, *a, **kw)
        calls.append(1)
        if len(calls) == 3:
            self.param_groups[0]["params"][0].data.view(-1)[0] = float("nan")
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", step_poisoning_the_third)
    cfg = load_config(None, small_run_args(tmp_path, "p", **{"train.steps": 5, **CONSTANT}))
    state = loop.train(cfg)
    assert state.step == 5 and state.skipped_steps == 1
    adapter = load_file(cfg.run_dir / "adapter" / "adapter_model.safetensors")
    assert all(torch.isfinite(v).all() for v in adapter.values())


def test_no_checkpoint_or_adapter_is_written_with_a_non_finite_value(tmp_path):
    from moetune.model.adapter_io import save_adapter

    with pytest.raises(NumericalFault, match="lora_A holds non-finite"):
        save_adapter({"x.lora_A": torch.tensor([1.0, float("inf")])}, str(tmp_path / "a"), {"rank": 1})
    assert not (tmp_path / "a").exists()


# ------------------------------------------------------------------------------------------ 3: one trainer per run dir
def test_a_second_trainer_on_the_same_run_is_refused(tmp_path, capsys):
    args = small_run_args(tmp_path, "busy", **{"train.steps": 2, "resume": "auto"})
    run = tmp_path / "runs" / "busy"
    holder = RunLock(run).acquire()  # another trainer (a separate open file: flock conflicts as across processes)
    unfinished = run / "checkpoints" / "step_000004.tmp"
    unfinished.mkdir(parents=True)
    try:
        with pytest.raises(RunDirInUse, match=rf"in use by another trainer \(host .*, pid {os.getpid()}"):
            run_inprocess(args)
        assert unfinished.is_dir()  # the other trainer's save in progress is left alone
    finally:
        holder.release()
    # a lock file whose holder is gone (a killed trainer) is stale: named in the log and taken over
    (run / ".lock").write_text(json.dumps({"host": "node7", "pid": 424242, "started": "earlier"}))
    capsys.readouterr()
    run_inprocess(args)  # the loop logs to stderr
    err = capsys.readouterr().err
    assert "stale lock" in err and "node7" in err and "424242" in err


# ------------------------------------------------------------------------------------------ 4: token ids vs vocabulary
def test_token_ids_outside_the_vocabulary_are_refused_before_the_run_starts(tmp_path, monkeypatch):
    small_vocab = ("{vocab_size: 64, hidden_size: 64, intermediate_size: 96, moe_intermediate_size: 32, "
                   "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16, "
                   "n_routed_experts: 4, num_experts_per_tok: 2, pad_token_id: 0, eos_token_id: 0}")
    monkeypatch.setattr(trainer, "setup_model", lambda *a: pytest.fail("the model must not be built"))
    with pytest.raises(DataError, match=r"token id \d+ is outside the model's vocabulary \(vocab_size 64\); the "
                                        r"tokenizer has \d+ tokens"):
        run_inprocess(small_run_args(tmp_path, "v", **{"model.config": small_vocab}))
    assert not (tmp_path / "runs" / "v" / "config.yaml").exists()


# ------------------------------------------------------------------------------------------ 5: export validates
@pytest.mark.parametrize("damage,message", [
    ("shape", r"has shape \[4, 48\], the base model with rank 4 needs \[4, 64\]"),
    ("missing", r"tensor model\.layers\.1\.self_attn\.q_proj\.lora_B is missing"),
    ("rank", r"lora_A has shape \[4, 64\], the base model with rank 8 needs \[8, 64\]"),
    ("config", r"adapter_config.json: cannot read it"),
])
def test_export_validates_the_adapter_and_leaves_nothing_on_failure(tmp_path, damage, message):
    base = save_hf(hf_model(seed=3), tmp_path / "base")
    adapter = tmp_path / "run" / "adapter"
    random_adapter(base, adapter, ["q_proj"], rank=4)
    f = adapter / "adapter_model.safetensors"
    state = load_file(f)
    if damage == "shape":
        name = "model.layers.0.self_attn.q_proj.lora_A"
        state[name] = state[name][:, :48].contiguous()
    elif damage == "missing":
        del state["model.layers.1.self_attn.q_proj.lora_B"]
    save_file(state, f)
    meta = json.loads((adapter / "adapter_config.json").read_text())
    if damage == "rank":
        (adapter / "adapter_config.json").write_text(json.dumps(dict(meta, rank=8)))
    if damage == "config":
        (adapter / "adapter_config.json").write_text(json.dumps(meta)[:40])
    (tmp_path / "out").mkdir()  # an earlier export of the same kind stays as it was
    (tmp_path / "out" / "adapter_config.json").write_text("{}")
    for verify in (False, True):
        with pytest.raises(MoetuneError, match=message):
            export_adapter(tmp_path / "run", tmp_path / "out", format="peft", verify=verify)
        assert os.listdir(tmp_path / "out") == ["adapter_config.json"]
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []  # no temporary left


def test_export_never_replaces_a_folder_holding_other_files(tmp_path):
    base = save_hf(hf_model(seed=3), tmp_path / "base")
    random_adapter(base, tmp_path / "run" / "adapter", ["q_proj"], rank=4)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(ExportError, match="holds other files"):
        export_adapter(tmp_path / "run", tmp_path / "mine", format="peft")
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]


# ------------------------------------------------------------------------------------------ 6: errors, not tracebacks
def test_a_truncated_hf_checkpoint_is_named(tmp_path):
    path = save_hf(hf_model(seed=2), tmp_path / "base")
    f = tmp_path / "base" / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=rf"{f}: .*re-download or re-save"):
        moetune.load_model(path)


def test_damaged_checkpoint_files_are_named(tmp_path, capsys):
    kw = {"train.steps": 2, "checkpoint.every": 1, "checkpoint.keep_last": 3}
    run = run_inprocess(small_run_args(tmp_path, "c", **kw))
    resume = small_run_args(tmp_path, "c", **{**kw, "train.steps": 3, "resume": "auto"})
    state_file = _ckpt(run, 2) / "trainer_state.json"
    good_state = state_file.read_text()
    state_file.write_text(good_state[:30])
    with pytest.raises(CheckpointError, match=rf"{state_file}: cannot read"):
        run_inprocess(resume)
    state_file.write_text(good_state)
    cfg_file = _ckpt(run, 2) / "config.yaml"
    text = cfg_file.read_text()
    cfg_file.write_text(text[: text.index("lora:") + 12])  # cut mid-line: not YAML any more
    with pytest.raises(CheckpointError, match=rf"{cfg_file}: (cannot read|damaged)"):
        run_inprocess(resume)
    cfg_file.write_text(text[: text.index("lora:")])  # cut at a line boundary: still YAML, but incomplete
    with pytest.raises(CheckpointError, match=rf"{cfg_file}: damaged"):
        run_inprocess(resume)
    cfg_file.write_text(text)
    (_ckpt(run, 2) / ".metadata").unlink()
    capsys.readouterr()
    run_inprocess(resume)  # resumes from step 1, and says why not from step 2
    assert f"skips {_ckpt(run, 2)}: .metadata missing" in capsys.readouterr().err


def test_deeply_nested_json_is_a_data_error(tmp_path):
    from moetune.data.formats import read_records

    data = tmp_path / "deep.jsonl"
    data.write_text('{"text": "ok"}\n' + '{"text": ' + "[" * 100000 + "]" * 100000 + "}\n")
    with pytest.raises(DataError, match=rf"{data}:2: JSON nested too deeply"):
        read_records(str(data))
    assert read_records(str(data), skip_malformed=True) == ([{"text": "ok"}], 1)


def test_an_unusable_output_dir_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=rf"run directory {tmp_path / 'file'}/x: cannot create it"):
        run_inprocess(small_run_args(tmp_path, "x", **{"run.output_dir": str(tmp_path / "file")}))


def test_a_full_disk_while_writing_outputs_is_an_output_error(tmp_path):
    from moetune.model.adapter_io import save_adapter
    from moetune.train.metrics import MetricsWriter

    writer = MetricsWriter("/dev/full", True)
    with pytest.raises(OutputError, match="cannot write /dev/full"):
        writer.write({"step": 1, "loss": 1.0})
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # writes past 4 KiB fail as on a full disk
    try:
        with pytest.raises(OutputError, match="could not write the adapter"):
            save_adapter({"a.lora_A": torch.zeros(64, 64)}, str(tmp_path / "adapter"), {"rank": 64})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_missing_tokenizer_is_named_by_its_key(tmp_path):
    with pytest.raises(ConfigError, match=rf"data.tokenizer: {tmp_path}/nope does not exist"):
        run_inprocess(small_run_args(tmp_path, "t", **{"data.tokenizer": str(tmp_path / "nope")}))


# ------------------------------------------------------------------------------------------ 7: finite numbers only
@pytest.mark.parametrize("key", ["optim.lr", "lora.alpha", "optim.eps", "model.init_std", "train.max_grad_norm",
                                 "optim.betas"])
def test_infinite_and_nan_values_are_refused(key):
    # inf/nan as a number field reads them; .inf/.nan (YAML's spelling) inside a list, or as a number field's text,
    # which is not a number: refused either way, naming the key
    for value in ("inf", "nan", ".inf", ".nan"):
        raw = f"[0.9, {value}]" if key == "optim.betas" else value
        with pytest.raises(ConfigError, match=rf"{key}.*(finite number|valid number)"):
            load_config(None, [f"--{key}", raw])


# ------------------------------------------------------------------------------------------ 8: refuse before building
def test_a_refused_resume_builds_nothing_and_writes_nothing(tmp_path, monkeypatch):
    run = run_inprocess(small_run_args(tmp_path, "r", **{"train.steps": 2}))
    before = (run / "config.yaml").read_text()
    monkeypatch.setattr(trainer, "setup_model", lambda *a: pytest.fail("the model must not be built"))
    monkeypatch.setattr(trainer, "setup_data", lambda *a: pytest.fail("the data must not be read"))
    with pytest.raises(CheckpointError, match=r"lora\.rank: 16 → 8"):
        run_inprocess(small_run_args(tmp_path, "r", **{"train.steps": 3, "lora.rank": 8, "resume": "auto"}))
    assert (run / "config.yaml").read_text() == before
    with pytest.raises(CheckpointError, match="nonexistent"):
        run_inprocess(small_run_args(tmp_path, "new", **{"resume": str(tmp_path / "nonexistent")}))
    assert not (tmp_path / "runs" / "new").exists()


# ------------------------------------------------------------------------------------------ 10: smaller ones
@pytest.mark.parametrize("name", ["../../x", "/abs/x", "..", "a/b"])
def test_run_name_stays_inside_output_dir(name):
    with pytest.raises(ConfigError, match="run.name.*one folder name"):
        load_config(None, ["--run.name", name])


def test_resume_unpickles_nothing_of_ours(tmp_path, monkeypatch):
    import pickle

    kw = {"train.steps": 2, "checkpoint.every": 1, "lora.dropout": 0.1, **CONSTANT}  # dropout: RNG state matters
    straight = run_inprocess(small_run_args(tmp_path, "straight", **{**kw, "train.steps": 3}))
    run_inprocess(small_run_args(tmp_path, "j", **kw))
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("pickle.loads on resume"))
    run = run_inprocess(small_run_args(tmp_path, "j", **{**kw, "train.steps": 3, "resume": "auto"}))
    assert step_losses(run) == step_losses(straight)  # scheduler, loader and RNG state came back exactly


def test_long_lines_are_not_tokenised(tmp_path):
    from moetune.data import build_packs, load_tokenizer

    tok = load_tokenizer(None)
    seen = []
    real = type(tok).__call__

    class Counting(type(tok)):
        def __call__(self, text, *a, **kw):
            seen.append(len(text))
            return real(self, text, *a, **kw)

    tok.__class__ = Counting
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "ab " * 10}) + "\n" + json.dumps({"text": "x" * 5_000_000}) + "\n")
    packs, stats = build_packs(str(data), tok, 64)
    assert stats["dropped_too_long"] == 1 and stats["documents"] == 1
    assert max(seen) < 1000  # the 5-million-character line was never handed to the tokenizer


def test_a_resume_with_a_different_global_batch_warns(tmp_path, capsys):
    run_inprocess(small_run_args(tmp_path, "gb", **{"train.steps": 2, "train.micro_batch_size": 2}))
    capsys.readouterr()
    run_inprocess(small_run_args(tmp_path, "gb", **{"train.steps": 3, "train.micro_batch_size": 1, "resume": "auto"}))
    err = capsys.readouterr().err
    assert "took 2 sequences per step, this one takes 1" in err and "grad_accum" in err


# ------------------------------------------------------------------------------------------ issue 12.6: weights progress
def test_loading_weights_reports_progress(tmp_path, caplog):
    path = save_hf(hf_model(seed=2, num_hidden_layers=4), tmp_path / "base", max_shard_size="100KB")
    with caplog.at_level(logging.INFO, logger="moetune"):
        moetune.load_model(path)
    lines = [r.getMessage() for r in caplog.records if "loading weights" in r.getMessage()]
    assert len(lines) >= 3 and "100%" in lines[-1] and path in lines[0]


# On a GPU machine the CUDA twin runs too: pinned host buffers filled on a side stream under the next step.
@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_the_rollback_copy_is_the_state_before_the_last_applied_update(device):
    """StepGuard's double-buffered host copy: a bad loss after two good updates restores the state after the first
    (weights and AdamW moments); a bad update right after a rollback is undone too; the copies reuse their buffers."""
    from types import SimpleNamespace

    from moetune.train.bad_steps import StepGuard

    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0], device=device))
    opt = torch.optim.AdamW([p], lr=0.1)
    guard = StepGuard([p], opt, SimpleNamespace(device=torch.device(device), all_reduce_sum=lambda t: t),
                      rollback=True)

    def update(step):
        guard.before_update(step)
        p.grad = torch.tensor([0.5, -1.0, 2.0], device=device) * step
        opt.step()
        opt.zero_grad(set_to_none=True)

    def state():
        st = opt.state[p]
        return p.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()

    update(1)
    guard.record(1, True, True)
    after_1 = state()
    update(2)
    guard.record(2, True, True)
    assert not torch.equal(state()[0], after_1[0])
    buffers = {id(t) for t in guard._snapshot[0] + guard._next[0]}
    guard.record(3, False, False, "non-finite loss")  # the forward on step 2's weights failed: undo update 2
    for got, want in zip(state(), after_1):
        assert torch.equal(got, want)
    assert guard.good_step == 1
    update(4)  # after a rollback nothing was copied in flight: the snapshot is taken now
    with torch.no_grad():
        p.fill_(float("nan"))
    guard.record(4, False, True, "the update made a trainable weight non-finite")
    for got, want in zip(state(), after_1):
        assert torch.equal(got, want)
    update(5)
    guard.record(5, True, True)
    update(6)
    assert {id(t) for t in guard._snapshot[0] + guard._next[0]} == buffers  # no new copy per step


def test_the_rollback_copy_is_made_off_the_training_thread():
    """The copy of a good update's result starts when the next step's backward does (start_copy) and is made on a
    worker thread: on a GPU its launches (3,300 for expert LoRA of full-size Air) would otherwise keep the host
    from queuing work, and its transfer slows the host-bound forward; the next update waits for it, and a rollback
    restores exactly that state."""
    import threading
    from types import SimpleNamespace

    from moetune.train.bad_steps import StepGuard

    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    opt = torch.optim.AdamW([p], lr=0.1)
    guard = StepGuard([p], opt, SimpleNamespace(device=torch.device("cpu"), all_reduce_sum=lambda t: t),
                      rollback=True)

    def update(step):
        guard.before_update(step)
        p.grad = torch.tensor([0.5, -1.0, 2.0]) * step
        opt.step()
        opt.zero_grad(set_to_none=True)

    update(1)
    started, release = threading.Event(), threading.Event()
    real = guard._copy_state

    def held_copy(*args, **kwargs):
        started.set()
        assert release.wait(20), "the copy was made on the calling thread: record() waited for it"
        return real(*args, **kwargs)

    guard._copy_state = held_copy
    guard.record(1, True, True)
    assert not started.wait(0.2)  # the copy waits for the next step's backward to begin
    guard.start_copy()  # returns although the copy cannot finish yet
    assert started.wait(20) and not release.is_set()
    after_1 = (p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
    release.set()
    update(2)  # waits for the copy before changing the state it copies
    guard.record(3, False, False, "non-finite loss")
    for got, want in zip((p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]), after_1):
        assert torch.equal(got.detach(), want)
