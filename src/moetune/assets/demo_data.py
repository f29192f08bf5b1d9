"""The embedded demo's dataset: a synthetic, checkable chat task.

    python -m moetune.assets.demo_data OUT_DIR [--n-train 4000] [--n-eval 200] [--seed 0]

The task is upper-casing words of the letters a-j only: the user writes ``upper: hecjab``, the assistant answers
``HECJAB``. A word with any other letter (``upper: hello``) is outside what the demo model learns. It was chosen because a
tiny random-init model trained with LoRA learns it within a couple of hundred steps on two CPU cores (every answer
token is a fixed function of one earlier token at a constant distance), while an untrained model scores ~0% exact
match, so both the loss curve and a generation check show learning. Words use ten letters and 3-6 characters: with
all 26 letters and up to 8 the same budget learned far less. Tried and rejected as too slow for the demo: reversing
and sorting strings (position-dependent or global rules) and plain copying. Conversations are 20-26 tokens with the
demo tokenizer.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

PREFIX = "upper: "
ALPHABET = "abcdefghij"  # few classes: the frozen random output layer of a LoRA run separates them quickly
MIN_LEN, MAX_LEN = 3, 6


def demo_answer(question: str) -> str:
    """The correct assistant reply to a demo question (for generation checks)."""
    if not question.startswith(PREFIX):
        raise ValueError(f"not a demo question: {question!r}")
    return question[len(PREFIX) :].upper()


def demo_conversation(word: str) -> dict:
    question = PREFIX + word
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": demo_answer(question)}]}


def write_demo_dataset(out_dir, n_train: int = 4000, n_eval: int = 200, seed: int = 0) -> tuple[str, str]:
    """Write ``train.jsonl`` and ``eval.jsonl`` under out_dir; the same arguments always give the same files.

    Eval words never occur in the training set, so the eval loss measures the rule rather than memorization.
    """
    rng = random.Random(seed)
    eval_words = _distinct_words(rng, n_eval)
    held_out = set(eval_words)
    train_words = [_fresh_word(rng, held_out) for _ in range(n_train)]

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, words in (("train.jsonl", train_words), ("eval.jsonl", eval_words)):
        path = out / name
        with open(path, "w", encoding="utf-8") as f:
            for w in words:
                f.write(json.dumps(demo_conversation(w)) + "\n")
        paths.append(str(path))
    return paths[0], paths[1]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(MIN_LEN, MAX_LEN)))


def _distinct_words(rng: random.Random, n: int) -> list[str]:
    words: dict[str, None] = {}  # a dict, not a set: insertion order keeps the file deterministic
    while len(words) < n:
        words[_word(rng)] = None
    return list(words)


def _fresh_word(rng: random.Random, taken: set) -> str:
    while True:
        w = _word(rng)
        if w not in taken:
            return w


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Write the moetune demo dataset (train.jsonl, eval.jsonl).")
    parser.add_argument("out_dir")
    parser.add_argument("--n-train", type=int, default=4000)
    parser.add_argument("--n-eval", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train, evaluation = write_demo_dataset(args.out_dir, args.n_train, args.n_eval, args.seed)
    print(f"wrote {train} ({args.n_train} conversations) and {evaluation} ({args.n_eval}): {letters_note()}")


def letters_note() -> str:
    """What a person trying the demo model must know about its prompts."""
    example = PREFIX + "hecjab"
    return (f"the task upper-cases words of the letters {ALPHABET[0]}-{ALPHABET[-1]} only "
            f"('{example}' -> '{demo_answer(example)}')")


if __name__ == "__main__":
    main()
