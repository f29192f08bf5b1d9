"""The one command layer: `moetune train | export | inspect | plot | generate | chat`. Each command's module parses
its arguments, calls the library that does the work and prints what it returns; nothing below this package parses
arguments or prints errors. Every user error is a `MoetuneError`, printed here as one line with one prefix."""

from __future__ import annotations

import difflib
import importlib
import sys

from moetune.errors import MoetuneError

USAGE = """\
usage: moetune [--version] [--help] COMMAND [ARGS]

Fine-tune GLM-4.5-family mixture-of-experts models (LoRA or full), on one CPU, one GPU or many.

commands:
  train [CONFIG.yaml] [--section.key VALUE ...]
                  train (no CONFIG: the embedded tiny demo on this machine); torchrun/srun/accelerate for many GPUs:
                  torchrun --nproc-per-node 8 -m moetune train CONFIG.yaml
  export adapter  write a run's adapter for PEFT (transformers) or vLLM     (moetune export adapter --help)
  export merged   merge a run's adapter into its base: an HF checkpoint     (moetune export merged --help)
  generate        generate text from a run directory or an HF model         (moetune generate --help)
  chat            chat with a run directory or an HF model in the terminal   (moetune chat --help)
  inspect         preflight a config: parameter counts, memory estimate, a masked sample
  plot            PNGs of a run's metrics (loss, lr, throughput, memory, expert load)

Run `moetune COMMAND --help` for a command's flags. Configuration: see README.md ('Configuration reference');
`moetune train --print-config` prints the defaults, `moetune train CONFIG.yaml --print-config` the resolved config.
"""

# command -> (module in this package, its function taking the command's arguments)
COMMANDS = {"train": ("train", "train"), "export": ("export", "export"), "inspect": ("inspect", "inspect"),
            "plot": ("plot", "plot"), "generate": ("generate", "generate"), "chat": ("generate", "chat")}


def error_line(e: MoetuneError) -> str:
    return f"moetune: error: {e}"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        from moetune import __version__

        print(f"moetune {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        guess = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
        hint = f"did you mean {guess[0]!r}?" if guess else f"the commands are {', '.join(COMMANDS)}"
        print(f"moetune: unknown command {argv[0]!r}: {hint} (`moetune --help` describes them)", file=sys.stderr)
        return 2
    module, function = COMMANDS[argv[0]]
    try:
        command = getattr(importlib.import_module(f"moetune.cli.{module}"), function)
        return command(argv[1:]) or 0
    except MoetuneError as e:  # anything else is a bug in moetune and keeps its traceback
        print(error_line(e), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        # Ctrl-C is the user's, not a bug: one line, the shell's exit status for SIGINT. Nothing half-written counts:
        # checkpoints and adapter exports are renamed into place when complete, a merged export is removed.
        hint = (": checkpoints already written are complete (resume: auto continues from the newest); SIGTERM or "
                "SIGUSR1 instead saves one at the next step" if argv[0] == "train" else "")
        print(f"\nmoetune: interrupted{hint}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
