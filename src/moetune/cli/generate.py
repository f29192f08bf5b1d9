"""`moetune generate RUN_DIR_OR_MODEL --prompt TEXT` and `moetune chat RUN_DIR_OR_MODEL`."""

from __future__ import annotations

import sys

from moetune.cli import error_line
from moetune.cli.args import ArgumentParser
from moetune.errors import TextError, UsageError


def _parser(prog: str, description: str) -> ArgumentParser:
    p = ArgumentParser(prog=prog, description=description)
    p.add_argument("source", metavar="RUN_DIR_OR_MODEL",
                   help="a run directory (runs/NAME: its base + adapter), an adapter dir, a training checkpoint, or "
                        "an HF checkpoint directory")
    p.add_argument("--base", default=None, help="the base HF checkpoint for a run/adapter (default: the one it "
                                                "trained on; a random-init base is rebuilt into RUN/base/)")
    p.add_argument("--adapter", default=None, help="a moetune adapter (a run directory, its adapter/ or a training "
                                                   "checkpoint) to apply instead of SOURCE's own")
    p.add_argument("--max-new-tokens", type=int, default=128, help="at most this many new tokens per reply")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampling")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the most likely tokens "
                                                            "whose probability adds up to this")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampler (reproducible sampling)")
    p.add_argument("--device", default="auto", help="auto (cuda when present, else cpu), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--system", default=None, help="a system message before the conversation")
    return p


def _load(a):
    """Check the arguments (before minutes of loading), then load."""
    from moetune.inference import load_for_generation, pick_device
    from moetune.text import check_text

    if a.max_new_tokens < 1 or a.temperature < 0 or not 0 < a.top_p <= 1:
        raise UsageError("need --max-new-tokens >= 1, --temperature >= 0 and 0 < --top-p <= 1")
    for flag in ("prompt", "system"):
        if getattr(a, flag, None) is not None:
            check_text(getattr(a, flag), f"--{flag}")
    device = pick_device(a.device, "--device")
    return load_for_generation(a.source, base=a.base, adapter=a.adapter, device=device, dtype=a.dtype)


def generate(argv: list[str]) -> int:
    from moetune.inference import generate as generate_reply

    p = _parser("moetune generate", "Generate a reply to --prompt with a trained run (base + adapter) or an HF "
                "checkpoint, with a KV cache; greedy unless --temperature > 0.")
    p.add_argument("--prompt", required=True, help="the user message (or, with --raw, the text to continue)")
    p.add_argument("--raw", action="store_true", help="continue the prompt as plain text (no chat template)")
    a = p.parse_args(argv)
    model, tokenizer = _load(a)
    messages = ([{"role": "system", "content": a.system}] if a.system else []) + [{"role": "user", "content": a.prompt}]
    reply = generate_reply(model, a.prompt if a.raw else messages, tokenizer, a.max_new_tokens, a.temperature,
                           a.top_p, a.seed, chat=not a.raw)
    print(reply)
    return 0


def chat(argv: list[str], stdin=None) -> int:
    from moetune.inference import generate as generate_reply
    from moetune.text import check_text

    p = _parser("moetune chat", "Chat in the terminal with a trained run (base + adapter) or an HF checkpoint. Each "
                "line you type is a user message; the conversation so far goes through the chat template. /reset "
                "starts over, /exit (or end of input) quits.")
    a = p.parse_args(argv)
    model, tokenizer = _load(a)
    if stdin is None:
        stdin = sys.stdin
        # bytes that are not UTF-8 become lone surrogates (as in argv), refused line by line below, where the
        # default 'strict' reading ended the session with a UnicodeDecodeError traceback
        if hasattr(stdin, "reconfigure"):
            stdin.reconfigure(errors="surrogateescape")
    refused = 0
    interactive = stdin.isatty()
    history = [{"role": "system", "content": a.system}] if a.system else []
    if interactive:
        print(f"moetune chat with {a.source} (/reset, /exit)", file=sys.stderr)
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = stdin.readline()
        if not line:
            break
        line = line.rstrip("\n")
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            history = history[:1] if a.system else []
            continue
        if not line.strip():
            continue
        try:
            check_text(line, "that line")
            reply = generate_reply(model, history + [{"role": "user", "content": line}], tokenizer,
                                   a.max_new_tokens, a.temperature, a.top_p, a.seed)
        except TextError as e:  # that line is refused; the conversation so far stays
            print(error_line(e), file=sys.stderr, flush=True)
            refused += 1
            continue
        history += [{"role": "user", "content": line}, {"role": "assistant", "content": reply}]
        print(("model> " if interactive else "") + reply, flush=True)
    return 1 if refused else 0
