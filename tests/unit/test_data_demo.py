"""The embedded demo: its tokenizer ships inside the package, and its dataset is deterministic and checkable."""

import json

from moetune.assets import build_tokenizer
from moetune.assets.demo_data import demo_answer, main as demo_main, write_demo_dataset
from moetune.data import build_packs, load_tokenizer, tokenize_record


def test_demo_tokenizer_loads_from_the_package_and_round_trips_text():
    tok = load_tokenizer(None)
    text = "Hello, World!\n\tx = [1, 2] ~ {ok} 'q' \"dq\" \\ /nothink"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text)  # character level, no BOS added
    assert tok.decode(ids) == text
    assert len(tok) <= 160


def test_demo_tokenizer_has_glm_special_tokens_as_single_tokens():
    tok = load_tokenizer(None)
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    for special in ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>",
                    "</think>"]:
        assert len(tok(special)["input_ids"]) == 1, special
        assert tok.convert_ids_to_tokens(tok(special)["input_ids"]) == [special]


def test_committed_tokenizer_matches_the_build_script(tmp_path):
    build_tokenizer.main([str(tmp_path)])
    fresh, shipped = load_tokenizer(str(tmp_path)), load_tokenizer(None)
    assert fresh.get_vocab() == shipped.get_vocab()
    assert fresh.chat_template == shipped.chat_template


def test_demo_chat_template_is_glm_shaped():
    tok = load_tokenizer(None)
    prompt = tok.apply_chat_template([{"role": "user", "content": "upper: ab"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == "[gMASK]<sop><|user|>\nupper: ab<|assistant|>\n"


def test_demo_dataset_is_deterministic_checkable_and_short(tmp_path):
    train, evaluation = write_demo_dataset(tmp_path / "a", n_train=300, n_eval=50, seed=3)
    train2, eval2 = write_demo_dataset(tmp_path / "b", n_train=300, n_eval=50, seed=3)
    assert open(train).read() == open(train2).read() and open(evaluation).read() == open(eval2).read()
    assert open(train).read() != open(write_demo_dataset(tmp_path / "c", 300, 50, seed=4)[0]).read()

    tok = load_tokenizer(None)
    rows = [json.loads(line) for line in open(train)]
    eval_rows = [json.loads(line) for line in open(evaluation)]
    assert len(rows) == 300 and len(eval_rows) == 50
    for r in rows + eval_rows:
        user, assistant = r["messages"]
        assert assistant["content"] == demo_answer(user["content"])
        ids, mask = tokenize_record(r, tok)
        assert len(ids) <= 64 and any(mask)
    train_questions = {r["messages"][0]["content"] for r in rows}
    assert not train_questions & {r["messages"][0]["content"] for r in eval_rows}  # held out

    packs, stats = build_packs(train, tok, seq_len=128)
    assert stats["documents"] == 300 and stats["dropped_too_long"] == 0


def test_demo_cli_writes_both_files(tmp_path, capsys):
    demo_main([str(tmp_path), "--n-train", "5", "--n-eval", "2"])
    assert len((tmp_path / "train.jsonl").read_text().splitlines()) == 5
    assert len((tmp_path / "eval.jsonl").read_text().splitlines()) == 2
    # a new user prompting the demo model with other letters learns nothing from the model: say which it knows
    assert "letters a-j only" in capsys.readouterr().out


def test_the_demo_words_use_the_letters_its_note_names(tmp_path):
    import json

    from moetune.assets.demo_data import letters_note, write_demo_dataset

    train, _ = write_demo_dataset(tmp_path, n_train=200, n_eval=10)
    letters = set()
    for line in open(train):
        letters |= set(json.loads(line)["messages"][0]["content"].removeprefix("upper: "))
    assert letters == set("abcdefghij") and "a-j" in letters_note()
