"""On-policy RL with moetune as the trainer and vLLM as the sampler: vLLM samples completions, a program scores
them, moetune takes a policy-gradient step through its step API, and the new weights go into vLLM through vLLM's
weight-transfer API (moetune's backend) after every step.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 python examples/rl_vllm.py --steps 30 \
        --set run.name rl_demo --set model.dtype float32

The task is the demo's upper-casing (`upper: hecjab` → `HECJAB`) on the demo's tiny random-init model (or any
config: --config run.yaml). The reward is programmatic and dense enough for a random policy to climb: half for the
share of answer characters that are letters of the word in upper case, half for those in their right place.
The loss is importance-weighted policy gradient with PPO clipping (the behaviour logprobs are vLLM's) and a k3 KL
term to the base (the model without its adapter, which costs no memory), advantages = (reward − the mean of the
prompt's group) / its standard deviation. Every step prints one JSON line: reward, the trainer-vs-vLLM logprob mismatch on the sampled
tokens right after the previous sync (mean |Δ| and KL), sync seconds and the sync's transient memory.

A stop signal (SIGTERM or SIGUSR1, as from a scheduler) checkpoints and ends the loop; run again with
`--set resume auto` to continue (tests/unit/test_step_api.py checks that a resume continues a caller's loop).
A failed vLLM request is retried once, then that step is skipped (logged); three such steps in a row end the run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # vLLM's engine in this process: syncs reach it here
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: vLLM-CPU's default takes most of the machine's memory

import torch  # noqa: E402

from moetune import Trainer, load_config  # noqa: E402
from moetune.assets.demo_data import ALPHABET, MAX_LEN, MIN_LEN, PREFIX  # noqa: E402

CLIP, KL_COEF = 0.2, 0.01
MAX_FAILED_STEPS = 3  # vLLM requests failing this many steps in a row end the run


def reward(completion: str, word: str) -> float:
    target = word.upper()
    answer = completion[: len(target) + 1]
    in_word = sum(c in target for c in answer) / max(len(answer), len(target))
    in_place = sum(a == b for a, b in zip(answer, target)) / len(target)
    return 0.5 * in_word + 0.5 * in_place


def pg_loss(lp, w, b):
    """Per token: −min(ρ·A, clip(ρ)·A) + β·KL₃(π‖π_base), ρ = π / π_behaviour (vLLM's sampling policy)."""
    ratio = torch.exp(lp - b["behaviour_logprobs"])
    adv = b["advantages"][:, None]
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
    d = b["ref_logprobs"] - lp
    kl = torch.exp(d) - d - 1
    return pg + KL_COEF * kl, {"kl_to_base": kl, "clipped": ((ratio - 1).abs() > CLIP).float()}


def batch_of(prompt_ids: list[list[int]], samples: list[list[tuple[list[int], list[float], float]]]) -> dict:
    """One row per completion: the prompt then the completion; the completion's tokens are the targets, weighted
    1/len (every completion counts alike), with vLLM's logprobs and the group-relative advantage (GRPO's)."""
    rows = []
    for p, group in zip(prompt_ids, samples):
        rewards = torch.tensor([r for _, _, r in group])
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-4)  # group-relative, in units of the group's spread
        rows += [(p, toks, lps, a.item()) for (toks, lps, _), a in zip(group, adv) if toks]
    T = max(len(p) + len(t) for p, t, _, _ in rows)
    B = len(rows)
    ids = torch.zeros(B, T, dtype=torch.long)
    labels = torch.full((B, T), -100, dtype=torch.long)
    behaviour, weights = torch.zeros(B, T), torch.zeros(B, T)
    for i, (p, toks, lps, _) in enumerate(rows):
        seq = p + toks
        ids[i, : len(seq)] = torch.tensor(seq)
        span = slice(len(p) - 1, len(seq) - 1)  # position t predicts seq[t + 1]
        labels[i, span] = torch.tensor(toks)
        behaviour[i, span] = torch.tensor(lps)
        weights[i, span] = 1.0 / len(toks)
    return {"input_ids": ids, "labels": labels, "weights": weights, "behaviour_logprobs": behaviour,
            "advantages": torch.tensor([a for _, _, _, a in rows])}


def mismatch(trainer_lp: torch.Tensor, batch: dict) -> dict:
    """The trainer's logprobs of the sampled tokens (before its update: the weights vLLM sampled with) against
    vLLM's: mean |Δ| and the k3 estimate of KL(vLLM ‖ trainer)."""
    mask = batch["labels"] != -100
    d = (trainer_lp - batch["behaviour_logprobs"])[mask]
    return {"mismatch_abs": d.abs().mean().item(), "mismatch_max": d.abs().max().item(),
            "mismatch_kl": (torch.exp(d) - d - 1).mean().item()}


def sample(llm, prompts, n, max_tokens, seed):
    from vllm import SamplingParams

    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, logprobs=0, seed=seed)
    for attempt in (1, 2):
        try:
            return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        except Exception as e:  # noqa: BLE001 - a failed request costs a step, not the run
            print(json.dumps({"vllm_error": f"{type(e).__name__}: {e}"[:300], "attempt": attempt}), flush=True)
    return None


def run(cfg, steps: int, prompts_per_step: int, samples_per_prompt: int, seed: int, on_step=None) -> list[dict]:
    """The loop; returns the per-step records (also printed as JSON lines). on_step(record) is called after each."""
    from vllm import LLM
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from moetune.export.run_base import write_base
    from moetune.model.random_base import base_recipe
    from moetune.sync.vllm_engine import LLMClient, MoetuneSource, MoetuneTrainerInitInfo
    from moetune.train.data_setup import run_tokenizer

    records = []
    with Trainer(cfg, data=False) as trainer:
        tok = run_tokenizer(cfg)
        base = cfg.model.path or write_base(base_recipe(cfg, "cpu"), str(cfg.run_dir / "base"))
        llm = LLM(base, dtype=cfg.model.dtype, max_model_len=64, enforce_eager=True, seed=seed,
                  weight_transfer_config={"backend": "moetune"})
        info = MoetuneTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=0, world_size=2)
        fmt = "fp32" if cfg.model.dtype == "float32" else "bf16"
        engine = WeightTransferTrainerFactory.trainer_init(info, client=LLMClient(llm),
                                                           source=MoetuneSource(trainer.model, fmt))
        engine.send_weights()  # vLLM starts from the trainer's policy (a resumed adapter, or B = 0: the base)
        rng = random.Random(seed + trainer.state.step)
        failures = 0
        while trainer.state.step < steps and not trainer.stopped:
            words = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(MIN_LEN, MAX_LEN)))
                     for _ in range(prompts_per_step)]
            texts = [tok.apply_chat_template([{"role": "user", "content": PREFIX + w}], tokenize=False,
                                             add_generation_prompt=True) for w in words]
            prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
            outputs = sample(llm, prompts, samples_per_prompt, MAX_LEN + 2, seed + trainer.state.step)
            if outputs is None:
                failures += 1
                if failures > MAX_FAILED_STEPS:
                    raise RuntimeError(f"vLLM failed {failures} steps in a row (see the vllm_error lines)")
                continue
            failures = 0
            groups = [[(list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
                        reward(tok.decode(c.token_ids, skip_special_tokens=True), w)) for c in o.outputs]
                      for o, w in zip(outputs, words)]
            batch = batch_of(prompts, groups)
            batch["ref_logprobs"] = trainer.reference_logprobs(batch)
            out = trainer.step(batch, loss_fn=pg_loss)
            t0 = time.perf_counter()
            stats = engine.send_weights()
            record = {"step": out.step, "reward": sum(x[2] for g in groups for x in g) / sum(map(len, groups)),
                      **mismatch(out.logprobs, batch), "loss": out.loss, "good": out.good,
                      "kl_to_base": out.metrics.get("kl_to_base"), "clipped": out.metrics.get("clipped"),
                      "sync_s": round(time.perf_counter() - t0, 4), "sync_bytes": stats.get("bytes"),
                      "sync_transient_bytes": stats.get("peak_alloc"), "sync_bound_bytes": stats.get("bound")}
            print(json.dumps(record), flush=True)
            records.append(record)
            if on_step is not None:
                on_step(record)
        engine.shutdown()
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="a moetune YAML config (default: the embedded demo)")
    ap.add_argument("--set", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                    help="a config override, e.g. --set optim.lr 1e-2")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--samples", type=int, default=8, help="completions per prompt")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    overrides = ["--train.steps", str(a.steps), "--optim.warmup_steps", "0", "--optim.scheduler", "constant",
                 "--logging.progress_bar", "false", "--checkpoint.every", "10"]
    for k, v in a.set:
        overrides += [f"--{k}", v]
    run(load_config(a.config, overrides), a.steps, a.prompts, a.samples, a.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
