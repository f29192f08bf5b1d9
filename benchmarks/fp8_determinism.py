"""Is the fp8 base's forward deterministic? The same loss, bit for bit, from the same weights and batch: repeated in
one process (with the allocator's cached memory poisoned with NaN, then zeros, before each run: a kernel that reads
memory it never wrote shows up), and across processes (each run of this script prints its digests; two processes
that disagree where each agrees with itself point at a choice made per process: autotuning, a cache).

    python benchmarks/fp8_determinism.py [--layers 8] [--procs 2]     (GLM-4.7-Flash's shapes, random weights)
    python benchmarks/fp8_determinism.py --layers 47 --modes compiled --cases packed/train --trainer-steps 5 \
        --trainer-args "--parallel.gpu_memory_gib 50"       (and the trainer: its steps, then its LoRA weights)
    python benchmarks/fp8_determinism.py --layers 47 --procs 3 --modes "" --trainer-steps 5 --caches shared,shared,fresh
        (the trainer only, in a process with cold compile caches, one with them warm, one cold again)
    python benchmarks/fp8_determinism.py --layers 16 --procs 4 --modes "" --trainer-steps 5 --caches \
        fresh,fresh,fresh,fresh --proc-trainer-args "||--train.deterministic true|--train.deterministic true"
        (two cold processes as the trainer runs by default, two with train.deterministic)
    python benchmarks/fp8_determinism.py --layers 16 --procs 6 --modes "" --trainer-steps 5 --caches \
        fresh,fresh,fresh,fresh,fresh,fresh --proc-settings "algorithms|algorithms|inductor|inductor|cudnn+cublas|\
        cudnn+cublas"      (which of train.deterministic's settings makes the evaluation repeat: two processes each)

Cases: an evaluation-like batch (one short document, the rest of the row padding, as the trainer's last packed eval
row) and a full packed row; each under torch.no_grad (the evaluation) and with gradients (the training forward,
then the backward's LoRA gradient norm); compiled per layer as the trainer does, and eager. --trainer-steps N: then
the step API (Trainer.step, fp8 base without transposed copies, as `moetune train` on GLM-4.7-Flash within 50 GiB) for
N steps of the packed row: each step's loss, a digest of the LoRA weights after, and the trainer's evaluation
(`evaluate`) of the evaluation-like row, twice. Writes
$OUT/fp8_determinism.json. BENCH_CPU=1: the same on the CPU rehearsal's tiny Flash (plumbing only: the CPU runs the
dequantised reference).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch._inductor.config as inductor_config

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))

from moetune.train.determinism import CUBLAS_WORKSPACE  # noqa: E402 (src is on the path above)

CPU = bool(os.environ.get("BENCH_CPU"))
OUT = os.environ.get("OUT", "/tmp")


def poison(value: float, dev) -> None:
    """Fill what the caching allocator holds free with `value`: the next buffers are carved from it."""
    if dev.type != "cuda":
        return
    free = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    blocks = []
    for size in (2**30, 2**26, 2**22, 2**18):  # large blocks first, then what is left in smaller ones
        while free >= size:
            try:
                blocks.append(torch.full((size // 4,), value, device=dev))
            except torch.OutOfMemoryError:
                break
            free -= size
    del blocks


def batches(vocab: int, S: int, dev):
    from train_throughput import make_batch

    ids, labels, pos = make_batch(1, S, vocab, 4, dev)
    short = max(S // 9, 8)  # one document, then padding (token 0, positions restarting, no targets)
    e_ids, e_labels = ids.clone(), labels.clone()
    e_ids[:, short:] = 0
    e_labels[:, short - 1:] = -100
    e_pos = torch.cat([torch.arange(short), torch.arange(S - short)]).to(dev).view(1, S)
    return {"eval_like": (e_ids, e_labels, e_pos), "packed": (ids, labels, pos)}


def finite(values) -> bool:
    """No NaN or infinity among the hex-written floats in `values` (nested lists and dicts): equal NaNs are no match."""
    text = json.dumps(values)
    return "nan" not in text and "inf" not in text


def digest(tensors) -> str:
    """Bits of every value folded into one float: any change in any weight changes it (almost surely)."""
    total = torch.zeros((), dtype=torch.float64)
    for i, t in enumerate(tensors):
        t = t.detach().double().flatten().cpu()
        total += (t * torch.linspace(1, 2, t.numel(), dtype=torch.float64)).sum() * (i + 1)
    return float(total).hex()


# one of train.deterministic's settings at a time, for the whole process (--proc-settings): which one makes the
# evaluation repeat across processes (the twentieth session: Inductor's mode during the evaluation alone did not)
SETTINGS = {
    "algorithms": lambda: torch.use_deterministic_algorithms(True, warn_only=True),
    "algorithms_nofill": lambda: (torch.use_deterministic_algorithms(True, warn_only=True),
                                  setattr(torch.utils.deterministic, "fill_uninitialized_memory", False)),
    "inductor": lambda: setattr(inductor_config, "deterministic", True),
    "cudnn": lambda: (setattr(torch.backends.cudnn, "deterministic", True),
                      setattr(torch.backends.cudnn, "benchmark", False)),
    "cublas": lambda: os.environ.__setitem__("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE),
}

def setting_names(names: str) -> list[str]:
    out = list(filter(None, names.split("+")))
    for name in out:
        if name not in SETTINGS:
            raise SystemExit(f"--proc-settings: unknown {name!r} (known: {', '.join(SETTINGS)})")
    return out


def apply_settings(names: str) -> None:
    for name in setting_names(names):
        SETTINGS[name]()


def trainer_steps(cfg: dict, S: int, dev, steps: int, args: list) -> dict:
    from train_throughput import FLASH_MLA, make_batch, trainer_step_fn

    model, step = trainer_step_fn(cfg, FLASH_MLA, 1, S, dev, quantize="fp8", fp8_copies=False, overrides=args)
    batch = make_batch(1, S, cfg["vocab_size"], 4, dev)
    lora = [p for p in model.parameters() if p.requires_grad]
    runs = [[float(step(*batch)).hex()] for _ in range(steps)]
    deterministic = torch.are_deterministic_algorithms_enabled()  # train.deterministic reached the steps
    from types import SimpleNamespace

    from moetune.train.trainer import evaluate

    e_ids, e_labels, e_pos = batches(cfg["vocab_size"], S, dev)["eval_like"]
    one = SimpleNamespace(device=dev, all_reduce_sum=lambda t: t)  # one process: nothing to reduce
    # the trainer's own evaluation (no-grad, eval mode, its graphs compiled at the first call, as it compiles them)
    ev = [float(evaluate(model, [{"input_ids": e_ids, "position_ids": e_pos, "labels": e_labels}], one, None)).hex()
          for _ in range(2)]
    return {"steps": runs, "lora_digest": digest(lora), "eval": ev, "deterministic": deterministic}


def one_process(layers: int, modes, cases: str, steps: int, args: list) -> dict:
    from train_throughput import FLASH_MLA, TINY_FLASH, build_ours

    from moetune.model.config import BUILTIN

    dev = torch.device("cpu" if CPU else "cuda")
    cfg = dict(TINY_FLASH) if CPU else dict(BUILTIN["glm47-flash"], num_hidden_layers=layers)
    S = 64 if CPU else 4096
    res = {}
    for compiled in [m == "compiled" and not CPU for m in modes if m]:
        model = build_ours(cfg, FLASH_MLA, {"quantize": "fp8", "compile": compiled}, dev)
        lora = [p for p in model.parameters() if p.requires_grad]
        for bname, (ids, labels, pos) in batches(cfg["vocab_size"], S, dev).items():
            for grad in (False, True):
                key = f"{'compiled' if compiled else 'eager'}/{bname}/{'train' if grad else 'no_grad'}"
                if cases and not any(c in key for c in cases.split(",")):
                    continue
                runs = []
                for value in (float("nan"), 0.0, float("nan")):
                    poison(value, dev)
                    for p in lora:
                        p.grad = None
                    with torch.set_grad_enabled(grad):
                        model.train(grad)
                        loss = model(ids, pos, labels=labels)
                        out = [float(loss).hex()]
                        if grad:
                            loss.backward()
                            out.append(float(torch.stack([p.grad.float().norm() for p in lora]).norm()).hex())
                    runs.append(out)
                res[key] = {"runs": runs, "same": all(r == runs[0] for r in runs) and finite(runs)}
                print(key, res[key], flush=True)
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if steps:
        run = trainer_steps(cfg, S, dev, steps, args)
        res["trainer"] = {"runs": [{k: run[k] for k in ("steps", "lora_digest", "eval")}],
                          "same": run["eval"][0] == run["eval"][1] and finite(run),
                          "deterministic": run["deterministic"]}
        print("trainer", res["trainer"], flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--modes", default="compiled,eager")
    ap.add_argument("--cases", default="", help="comma-separated substrings of the cases to run (default: all)")
    ap.add_argument("--trainer-steps", type=int, default=0)
    ap.add_argument("--trainer-args", default="", help="more `--key value` overrides for the trainer")
    ap.add_argument("--proc-trainer-args", default="", help="per process, separated by |: more trainer overrides")
    ap.add_argument("--caches", default="", help="per process, comma-separated: `shared` (one compile cache, cold "
                    "for the first process that uses it, then warm) or `fresh` (its own empty cache); default: the "
                    "machine's")
    ap.add_argument("--proc-settings", default="", help="per process, separated by |: train.deterministic's "
                    f"settings to turn on for the whole process, joined by + (of {', '.join(SETTINGS)})")
    ap.add_argument("--settings", default="", help=argparse.SUPPRESS)  # a child's own --proc-settings entry
    ap.add_argument("--child", action="store_true")
    a = ap.parse_args()
    if a.child:
        apply_settings(a.settings)
        res = one_process(a.layers, a.modes.split(","), a.cases, a.trainer_steps, a.trainer_args.split())
        print("RESULT " + json.dumps(res), flush=True)
        return
    procs = []
    caches = a.caches.split(",") if a.caches else []
    per_proc = a.proc_trainer_args.split("|") if a.proc_trainer_args else []
    per_settings = a.proc_settings.split("|") if a.proc_settings else []
    setting_names("+".join(per_settings))  # the names checked before any process runs (and not applied here: the
    # processes inherit this one's environment)
    shared = tempfile.mkdtemp(prefix="det_cache_shared_")
    for i in range(a.procs):
        env = dict(os.environ)
        if i < len(caches):  # torch.compile's and Triton's caches: what a process finds compiled and tuned already
            d = shared if caches[i] == "shared" else tempfile.mkdtemp(prefix="det_cache_fresh_")
            env.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(d, "inductor"), TRITON_CACHE_DIR=os.path.join(d, "triton"))
        r = subprocess.run([sys.executable, __file__, "--child", "--layers", str(a.layers), "--modes", a.modes,
                            "--cases", a.cases, "--trainer-steps", str(a.trainer_steps),
                            "--trainer-args=" + " ".join([a.trainer_args] + per_proc[i:i + 1]),
                            "--settings", per_settings[i] if i < len(per_settings) else ""],
                           capture_output=True, text=True, env=env)
        lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
        if r.returncode or not lines:
            print(r.stdout[-3000:], r.stderr[-3000:], flush=True)
            procs.append({"error": r.returncode})
            continue
        procs.append(json.loads(lines[-1][7:]))
        print(f"process {i}: {json.dumps(procs[-1].get('trainer', 'done'))}", flush=True)
    keys = sorted({k for p in procs for k in p if k != "error"})
    # processes compare with those run with the same trainer overrides and settings (--proc-trainer-args,
    # --proc-settings)
    groups: dict[str, list] = {}
    for i, p in enumerate(procs):
        group = " ".join(x for x in (per_proc[i] if i < len(per_proc) else "",
                                     per_settings[i] if i < len(per_settings) else "") if x)
        groups.setdefault(group, []).append(p)
    summary = {f"{k}{' [' + g + ']' if g else ''}": {
        "within_each": [p.get(k, {}).get("same") for p in ps],
        "across": len({json.dumps(p.get(k, {}).get("runs")) for p in ps}) == 1 and all(finite(p.get(k)) for p in ps)}
        for g, ps in groups.items() for k in keys}
    obj = {"layers": a.layers, "procs": procs, "summary": summary,
           "device": "cpu" if CPU else torch.cuda.get_device_name(0), "torch": torch.__version__}
    with open(os.path.join(OUT, "fp8_determinism.json"), "w") as f:
        json.dump(obj, f, indent=1)
    for k, v in summary.items():
        print(f"DETERMINISM {k}: within each process {v['within_each']}, across processes {v['across']}", flush=True)


if __name__ == "__main__":
    main()
