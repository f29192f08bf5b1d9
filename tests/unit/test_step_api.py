"""The step API (train/trainer.py): `moetune train` is one user of it, a custom loss another.

- driven from outside, the step API gives `moetune train`'s run: bitwise on the default path, to fp32 rounding
  through the generic (logprobs + loss_fn) path;
- a custom loss (importance-weighted policy gradient with clipping and a KL term to the base) gets the gradients
  of the same loss written out by hand on a plain forward of the same model;
- the base without the adapter is the model with every LoRA B set to zero;
- bad input: a loss that is NaN (the guard undoes the step, then stops the run), shapes that disagree.
"""

import threading

import pytest
import torch
from safetensors.torch import load_file

from helpers import read_metrics, run_inprocess, small_run_args, step_losses
from moetune.config import load_config
from moetune.errors import DataError, NumericalFault
from moetune.train import trainer as trainer_mod
from moetune.train.trainer import Trainer

STEPS = 3


def _adapter(run_dir):
    return load_file(run_dir / "adapter" / "adapter_model.safetensors")


def _lora_state(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("step_api")
    return tmp, run_inprocess(small_run_args(tmp, "cli", **{"train.steps": STEPS, "train.grad_accum": 2}))


@pytest.mark.parametrize("path", ["default", "generic"])
def test_the_step_api_equals_moetune_train(reference, path):
    tmp, cli = reference
    cfg = load_config(None, small_run_args(tmp, f"api_{path}", **{"train.steps": STEPS, "train.grad_accum": 2}))
    losses = []
    with Trainer(cfg) as trainer:
        for _ in range(STEPS):
            batches = trainer.next_batches()
            if path == "default":  # the fused cross-entropy, as `moetune train` runs it
                out = trainer.step(batches)
                assert out.logprobs is None
            else:  # logprobs with their graph, weights given, the cross-entropy written as a loss_fn
                batches = [dict(b, weights=torch.ones(b["input_ids"].shape)) for b in batches]
                out = trainer.step(batches, loss_fn=lambda lp, w, b: -lp)
                assert len(out.logprobs) == 2 and out.logprobs[0].shape == batches[0]["input_ids"].shape
            assert out.good and out.metrics["step"] == out.step
            losses.append(out.loss)
    want, got_adapter = step_losses(cli), _adapter(cfg.run_dir)
    if path == "default":
        assert [round(x, 6) for x in losses] == want
        assert all(torch.equal(got_adapter[k], v) for k, v in _adapter(cli).items())
    else:
        assert losses == pytest.approx(want, rel=1e-5)
        for k, v in _adapter(cli).items():
            # AdamW divides each gradient element by its own size: where one is near 0, the two cross-entropies' fp32
            # roundings move that element's update (lr 1e-2) visibly; the tensor as a whole agrees to 1e-4
            assert (got_adapter[k] - v).norm() <= 1e-4 * v.norm(), k


def _rl_batches(trainer, n=2, seed=0):
    """Micro-batches of an RL step: prompt tokens are not targets; advantages per sequence, behaviour logprobs per
    token (the current policy's, perturbed so the importance ratios differ from 1 and some get clipped)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(1, 90, (2, 12), generator=g)
        labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
        labels[:, :4] = -100  # the prompt
        labels[1, 9:] = -100  # a shorter completion
        b = {"input_ids": ids, "labels": labels, "weights": torch.rand(2, 12, generator=g) + 0.5,
             "advantages": torch.randn(2, generator=g)}
        b["behaviour_logprobs"] = trainer.logprobs(b) + 0.3 * torch.randn(2, 12, generator=g)
        b["ref_logprobs"] = trainer.reference_logprobs(b)
        out.append(b)
    return out


EPS, BETA = 0.2, 0.1


def pg_kl_loss(lp, w, b):
    """Importance-weighted policy gradient with PPO clipping, plus the k3 KL estimate to the base."""
    ratio = torch.exp(lp - b["behaviour_logprobs"])
    adv = b["advantages"][:, None]
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - EPS, 1 + EPS) * adv)
    d = b["ref_logprobs"] - lp
    kl = torch.exp(d) - d - 1
    return pg + BETA * kl, {"kl": kl, "clipped": ((ratio - 1).abs() > EPS).float()}


def test_a_custom_loss_gets_the_gradients_of_the_loss_written_by_hand(tmp_path, monkeypatch):
    cfg = load_config(None, small_run_args(tmp_path, "pg", **{"train.steps": 4, "train.max_grad_norm": 0}))
    with Trainer(cfg, data=False) as trainer:
        trainer.step(_rl_batches(trainer, seed=1), loss_fn=pg_kl_loss)  # B ≠ 0: the adapter matters
        batches = _rl_batches(trainer, seed=2)
        model = trainer.model
        params = [p for p in model.parameters() if p.requires_grad]

        # by hand: one plain forward per micro-batch, log_softmax, the loss over both micro-batches' tokens
        num, den, clipped = 0.0, 0.0, []
        for b in batches:
            logp = torch.log_softmax(model(b["input_ids"]).float(), -1)
            mask = b["labels"] != -100
            lp = logp.gather(-1, b["labels"].clamp(min=0)[..., None]).squeeze(-1)
            ratio = torch.exp(lp - b["behaviour_logprobs"])
            adv = b["advantages"][:, None].expand_as(lp)
            pg = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - EPS, 1 + EPS) * adv)
            kl = torch.exp(b["ref_logprobs"] - lp) - (b["ref_logprobs"] - lp) - 1
            num = num + ((pg + BETA * kl) * b["weights"])[mask].sum()
            den = den + b["weights"][mask].sum()
            clipped.append(((ratio - 1).abs() > EPS)[mask])
        want = torch.autograd.grad(num / den, params)
        assert torch.cat(clipped).any() and not torch.cat(clipped).all()  # both branches of the clip are taken

        got = {}
        real = trainer_mod.clip_grad_norm

        def capture(ps, max_norm):  # the gradients as the optimizer will see them
            got.update({id(p): p.grad.detach().clone() for p in ps})
            return real(ps, max_norm)

        monkeypatch.setattr(trainer_mod, "clip_grad_norm", capture)
        out = trainer.step(batches, loss_fn=pg_kl_loss)
    assert out.good and out.loss == pytest.approx((num / den).item(), rel=1e-5)
    assert 0 < out.metrics["clipped"] < 1 and out.metrics["kl"] > 0
    assert sum(w.abs().sum() for w in want) > 0
    for p, w in zip(params, want):
        torch.testing.assert_close(got[id(p)], w, rtol=1e-4, atol=1e-7)


def test_reference_logprobs_are_the_base_without_the_adapter(tmp_path):
    cfg = load_config(None, small_run_args(tmp_path, "ref", **{"train.steps": 4}))
    with Trainer(cfg, data=False) as trainer:
        for seed in range(2):
            trainer.step(_rl_batches(trainer, seed=seed), loss_fn=pg_kl_loss)
        b = _rl_batches(trainer, n=1, seed=5)[0]
        ref, policy = trainer.reference_logprobs(b), trainer.logprobs(b)
        assert (ref - policy).abs().max() > 1e-4  # the adapter has learnt something
        saved = _lora_state(trainer)
        with torch.no_grad():
            for n, p in trainer.model.named_parameters():
                if n.endswith(("lora_B", "_B")):
                    p.zero_()
        torch.testing.assert_close(trainer.logprobs(b), ref, rtol=0, atol=0)
        with torch.no_grad():
            for n, p in trainer.model.named_parameters():
                if n in saved:
                    p.copy_(saved[n])
        assert torch.equal(trainer.logprobs(b), policy)  # the LoRA scaling is back


def _tensorboard_writer_threads():
    return {t for t in threading.enumerate() if type(t).__name__ == "_AsyncWriterThread"}


def test_a_nan_loss_changes_nothing_and_too_many_stop_the_run(tmp_path):
    cfg = load_config(None, small_run_args(tmp_path, "nan", **{"train.steps": 10, "checkpoint.max_bad_steps": 2}))
    writers = _tensorboard_writer_threads()
    trainer = Trainer(cfg, data=False)
    with pytest.raises(NumericalFault, match="2 bad steps"), trainer:
        initial = _lora_state(trainer)
        assert trainer.step(_rl_batches(trainer), loss_fn=pg_kl_loss).good
        out = trainer.step(_rl_batches(trainer, seed=3), loss_fn=lambda lp, w, b: lp * float("nan"))
        assert not out.good and out.metrics["loss"] != out.metrics["loss"]
        assert trainer.state.skipped_steps == 1
        # a bad step applies no update and undoes the one before it (whose weights gave the NaN, as far as the
        # guard can tell): the weights are those before step 1
        after = _lora_state(trainer)
        assert all(torch.equal(initial[k], after[k]) for k in initial)
        trainer.step(_rl_batches(trainer, seed=4), loss_fn=lambda lp, w, b: lp * float("nan"))
    saved = sorted((cfg.run_dir / "checkpoints").iterdir())
    assert [p.name for p in saved] == ["step_000003"]  # the last good weights, saved for a resume
    # the failed run's trackers are closed as it ends (its TensorBoard writer thread no longer writes into the run
    # directory, nor outlives the run in a caller's process), with every step it logged, the bad ones included
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert _tensorboard_writer_threads() <= writers
    logged = [r["step"] for r in read_metrics(cfg.run_dir) if "loss" in r]
    events = EventAccumulator(str(cfg.run_dir / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    assert len(logged) >= 2 and [e.step for e in events.Scalars("train/loss")] == logged


def test_batches_whose_shapes_disagree_are_named(tmp_path):
    cfg = load_config(None, small_run_args(tmp_path, "bad", **{"train.steps": 4}))
    with Trainer(cfg, data=False) as trainer:
        ids = torch.randint(1, 90, (2, 8))
        good = {"input_ids": ids, "labels": ids.roll(-1, 1)}
        cases = [
            ({**good, "weights": torch.ones(2, 7)}, r"batch\['weights'\] has shape \[2, 7\] but input_ids has \[2, 8\]"),
            ({**good, "labels": ids[:1]}, r"batch\['labels'\] has shape \[1, 8\]"),
            ([good, {**good, "advantages": torch.ones(3)}], r"batch\[1\]\['advantages'\] has shape \[3\].*batch size"),
            ({"input_ids": ids}, r"batch has no 'labels'"),
            ({**good, "labels": torch.full((2, 8), 10**6)}, r"token id 1000000, outside the model's vocabulary"),
            ({"input_ids": ids.float(), "labels": ids}, r"input_ids'\] must be an integer tensor"),
        ]
        for batch, message in cases:
            with pytest.raises(DataError, match=message):
                trainer.step(batch)
        with pytest.raises(DataError, match=r"loss_fn returned \[2\]: it must return the per-token loss"):
            trainer.step(good, loss_fn=lambda lp, w, b: lp.sum(-1))
        assert trainer.state.step == 0  # nothing was trained
        assert trainer.step(good).good


def test_a_stop_signal_checkpoints_and_a_resume_continues_the_callers_loop(tmp_path):
    """An RL loop under a scheduler: SIGTERM during a step ends that step with a checkpoint and out.stop; a new
    Trainer with resume: auto continues at the next step with the same weights."""
    import signal

    args = small_run_args(tmp_path, "rl", **{"train.steps": 10, "checkpoint.every": 0})
    cfg = load_config(None, args)
    with Trainer(cfg, data=False) as trainer:
        assert not trainer.step(_rl_batches(trainer, seed=0), loss_fn=pg_kl_loss).stop

        sent = []

        def terminated(lp, w, b):
            if not sent:  # once (a second signal means "exit at once")
                sent.append(signal.SIGTERM)
                signal.raise_signal(signal.SIGTERM)  # what a scheduler sends; the trainer's handler records it
            return pg_kl_loss(lp, w, b)

        out = trainer.step(_rl_batches(trainer, seed=1), loss_fn=terminated)
        assert out.stop and out.good and trainer.stopped
        weights = _lora_state(trainer)
    assert [p.name for p in sorted((cfg.run_dir / "checkpoints").iterdir())] == ["step_000002"]
    with Trainer(load_config(None, args + ["--resume", "auto"]), data=False) as again:
        assert again.state.step == 2
        assert all(torch.equal(v, weights[k]) for k, v in _lora_state(again).items())
        assert again.step(_rl_batches(again, seed=2), loss_fn=pg_kl_loss).step == 3


def test_automatic_garbage_collection_is_off_while_training_and_back_after(tmp_path, monkeypatch):
    """train.gc_every (train/garbage.py): no automatic collection inside the steps; a young-generation collection at
    the start and after every gc_every-th step; Python's setting back when the trainer closes, and after a failed
    run too."""
    import gc

    young = []  # the young-generation collections asked for
    real_collect = gc.collect

    def collect(generation=2):
        if generation == 1:
            young.append(generation)
        return real_collect(generation)

    monkeypatch.setattr(gc, "collect", collect)
    assert gc.isenabled()
    cfg = load_config(None, small_run_args(tmp_path, "gc", **{"train.steps": 5, "train.gc_every": 2}))
    with Trainer(cfg) as trainer:
        assert not gc.isenabled() and len(young) == 1
        for step in range(1, 6):
            trainer.step(trainer.next_batches())
            assert not gc.isenabled() and len(young) == 1 + step // 2
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="boom"), Trainer(load_config(None, small_run_args(tmp_path, "gc2"))):
        assert not gc.isenabled()
        raise RuntimeError("boom")
    assert gc.isenabled()
    # 0: Python's own collection stays on
    with Trainer(load_config(None, small_run_args(tmp_path, "gc0", **{"train.gc_every": 0}))) as trainer:
        assert gc.isenabled()


_CYCLES = """
import gc, json, sys
import torch
from moetune.config import load_config
from moetune.train.trainer import Trainer

with Trainer(load_config(None, json.loads(sys.argv[1]))) as trainer:
    trainer.step(trainer.next_batches())
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds unreachable is kept in gc.garbage to look at
    for _ in range(2):
        trainer.step(trainer.next_batches())
    gc.collect()
    held = [o for o in gc.garbage if torch.is_tensor(o)]
    gc.set_debug(0)
    print("HELD", json.dumps([list(t.shape) for t in held]))
"""


@pytest.mark.parametrize("over", [{}, {"train.activation_checkpointing": "full"}, {"model.quantize": "fp8"},
                                  {"logging.expert_stats_every": 1}], ids=["default", "recompute", "fp8", "stats"])
def test_a_step_leaves_no_tensor_in_cyclic_garbage(tmp_path, over):
    """With automatic collection off (train.gc_every) a tensor that only a reference cycle keeps alive stays until the
    next collection, up to gc_every steps of activations on the GPU: the step must make no such cycle. In a process
    of its own: garbage that other tests' objects leave (caches let go of, compiled graphs' fake tensors) would show
    too."""
    import json
    import subprocess
    import sys

    args = small_run_args(tmp_path, "cycles", **{"train.steps": 5, "train.gc_every": 1000, **over})
    p = subprocess.run([sys.executable, "-c", _CYCLES, json.dumps(args)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    (line,) = [x for x in p.stdout.splitlines() if x.startswith("HELD ")]
    held = json.loads(line[5:])
    assert not held, f"{len(held)} tensors kept alive only by reference cycles, shapes {held[:8]}"
