"""Regenerate the embedded demo tokenizer in ``assets/tokenizer/``.

    python -m moetune.assets.build_tokenizer [OUT_DIR]

The demo trains a tiny random-init model on two CPU cores, so the tokenizer is character level: every printable
ASCII character (plus newline and tab) is one token, and the vocabulary (107 entries) fits a tiny embedding. The
special tokens and the chat template follow GLM-4.5 (``[gMASK]<sop>`` prefix, ``<|role|>\\n`` headers, no end-of-turn
marker: an assistant turn is closed by the next role token, so the data pipeline trains that token, or ``<|endoftext|>``
at the end of a conversation). The output is committed; rerun this only when changing the tokenizer.
"""

from __future__ import annotations

import string
import sys
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

# <|endoftext|> first: it is GLM's pad and eos, and id 0 makes padding easy to spot in a dump.
SPECIAL_TOKENS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
# GLM-4.5 keeps <think>/</think> as added but non-special tokens (they survive skip_special_tokens).
THINK_TOKENS = ["<think>", "</think>"]
UNK_TOKEN = "<unk>"  # anything outside printable ASCII; GLM itself has no unk (byte-level BPE)
CHARACTERS = ["\n", "\t"] + [chr(c) for c in range(32, 127)]

# GLM-4.5's template, reduced to what the demo needs: string contents, four roles, no tools and no thinking switch.
CHAT_TEMPLATE = (
    "{{- '[gMASK]<sop>' -}}"
    "{%- set tags = {'system': '<|system|>', 'user': '<|user|>', 'assistant': '<|assistant|>', "
    "'tool': '<|observation|>'} -%}"
    "{%- for m in messages -%}"
    "{%- if m.role not in tags -%}{{- raise_exception('unknown role: ' + m.role) -}}{%- endif -%}"
    "{{- tags[m.role] + '\\n' + m.content -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

DEFAULT_OUT = Path(__file__).resolve().parent / "tokenizer"


def build_tokenizer():
    from transformers import PreTrainedTokenizerFast

    assert len(set(CHARACTERS)) == len(CHARACTERS) and set(string.printable) - {"\r", "\x0b", "\x0c"} <= set(CHARACTERS)
    vocab_list = SPECIAL_TOKENS + THINK_TOKENS + [UNK_TOKEN] + CHARACTERS
    vocab = {tok: i for i, tok in enumerate(vocab_list)}

    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    # One pre-token per character; [\s\S] rather than "." so that newlines are split off too.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join characters back without inserting spaces
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS + [UNK_TOKEN]])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token=UNK_TOKEN,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # " ." must decode to " ." for exact round trips
        model_max_length=4096,
        padding_side="right",
    )


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else DEFAULT_OUT
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(str(out))
    print(f"wrote {out} (vocab {len(tokenizer)})")


if __name__ == "__main__":
    main()
