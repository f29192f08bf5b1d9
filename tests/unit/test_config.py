"""Config layer: schema, error messages, CLI overrides, dump/load round trip, resume hash."""
from pathlib import Path

import pytest

from moetune.config import (
    Config,
    ConfigError,
    config_hash,
    config_to_yaml,
    load_config,
    parse_overrides,
)

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def write(tmp_path, text, name="cfg.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


# --- defaults -------------------------------------------------------------------------------

def test_defaults_are_the_demo():
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.run.name == "demo" and cfg.model.dtype == "float32"
    assert cfg.model.effective_config == "tiny"
    assert cfg.lora.targets == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert cfg.optim.betas == (0.9, 0.95)
    assert cfg.run_dir == Path("runs") / "demo"


def test_model_path_means_its_own_config():
    assert load_config(None, ["--model.path", "/ckpt"]).model.effective_config is None
    assert load_config(None, ["--model.config", "glm45-air-8layers"]).model.effective_config == "glm45-air-8layers"


def test_an_empty_section_means_defaults_and_an_empty_file_is_refused(tmp_path):
    assert load_config(write(tmp_path, "lora:\n  # rank: 8\n")) == Config()
    assert load_config(write(tmp_path, "{}\n")) == Config()  # said explicitly
    # an empty file trained the demo's defaults without a word
    for text in ("", "# optim:\n#   lr: 1.0e-4\n"):
        path = write(tmp_path, text)
        with pytest.raises(ConfigError, match=rf"^{path}: the config file is empty"):
            load_config(path)


# --- unknown keys ---------------------------------------------------------------------------

def test_misspelt_key_names_dotted_path_file_and_suggestion(tmp_path):
    p = write(tmp_path, "optim:\n  lrr: 2.0e-4\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert "unknown key 'optim.lrr'" in msg
    assert str(p) in msg
    assert "did you mean 'optim.lr'?" in msg


def test_misspelt_section(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'optimm'.*did you mean 'optim'\?"):
        load_config(write(tmp_path, "optimm:\n  lr: 1.0\n"))


def test_key_in_wrong_section_suggests_the_right_one(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'optim.steps'.*did you mean 'train.steps'\?"):
        load_config(write(tmp_path, "optim:\n  steps: 3\n"))


def test_nested_unknown_key_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'parallel.dp_shrad'.*'parallel.dp_shard'"):
        load_config(write(tmp_path, "parallel:\n  ep: 2\n  dp_shrad: 4\n"))


def test_all_errors_are_reported_together(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "lora:\n  rnak: 8\ntrain:\n  steps: zero\n"))
    assert "2 config errors" in str(e.value)
    assert "'lora.rnak'" in str(e.value) and "'lora.rank'" in str(e.value)
    assert "'train.steps'" in str(e.value)


# --- wrong types and values ----------------------------------------------------------------

def test_wrong_type_names_path_and_file(tmp_path):
    p = write(tmp_path, "train:\n  steps: lots\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert "'train.steps'" in msg and str(p) in msg and "'lots'" in msg


def test_wrong_literal_and_union_paths(tmp_path):
    with pytest.raises(ConfigError, match=r"'model.dtype'.*bfloat16"):
        load_config(write(tmp_path, "model:\n  dtype: fp16\n"))
    # union members (str | dict) must not leak into the reported path
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "model:\n  config: [1, 2]\n"))
    assert "'model.config'" in str(e.value) and "model.config.str" not in str(e.value)


def test_activation_checkpointing_modes_are_the_models():
    """Every mode the model implements is accepted (attention: the attention block recomputed); a typo is one error
    that lists them, lightest first."""
    from moetune.parallel.ac_modes import AC_MODES

    for mode in AC_MODES:
        assert load_config(None, ["--train.activation_checkpointing", mode]).train.activation_checkpointing == mode
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--train.activation_checkpointing", "atention"])
    msg = str(e.value)
    assert "'train.activation_checkpointing'" in msg and "'atention'" in msg and "\n" not in msg
    assert "'none', 'attention', 'selective' or 'full'" in msg


def test_list_element_path(tmp_path):
    with pytest.raises(ConfigError, match=r"'optim.betas\[1\]'"):
        load_config(write(tmp_path, "optim:\n  betas: [0.9, high]\n"))


@pytest.mark.parametrize("override, needle", [
    ("--lora.rank=0", "'lora.rank'"),
    ("--lora.dropout=1.5", "'lora.dropout'"),
    ("--data.seq_len=4", "'data.seq_len'"),
    ("--train.micro_batch_size=0", "'train.micro_batch_size'"),
    ("--optim.lr=-1", "'optim.lr'"),
    ("--optim.betas=[0.9, 1.5]", "'optim.betas'"),
    ("--parallel.dp_shard=0", "'parallel.dp_shard'"),
    ("--parallel.ep=0", "'parallel.ep'"),
    ("--finetune.train_router=true", "finetune.mode: full"),
    ("--model.attn_implementation=varlen", "set model.dtype: bfloat16 (it is float32)"),
    ("--model.attn_implementation=varlen_fa4", "varlen_fa4 (FlashAttention-4) computes in bf16 only"),
    ("--model.config=glm45air", "did you mean 'glm45-air'?"),
    ("--logging.report_to=[tensorbord]", "'logging.report_to[0]'"),
])
def test_value_validation(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert needle in str(e.value)


def test_train_router_allowed_in_full_mode():
    cfg = load_config(None, ["--finetune.mode", "full", "--finetune.train_router", "true"])
    assert cfg.finetune.train_router is True


# --- YAML syntax ----------------------------------------------------------------------------

def test_yaml_syntax_error_names_file_and_line(tmp_path):
    p = write(tmp_path, "run:\n  name: x\noptim:\n  lr: [1e-4\n  eps: 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert f"{p}:" in str(e.value) and "YAML syntax error" in str(e.value)
    line = int(str(e.value).split(f"{p}:")[1].split(":")[0])
    assert 4 <= line <= 6


def test_yaml_bad_indentation_line(tmp_path):
    p = write(tmp_path, "train:\n  steps: 3\n    grad_accum: 2\n")
    with pytest.raises(ConfigError, match=rf"{p}:3:"):
        load_config(p)


def test_duplicate_key_is_an_error(tmp_path):
    p = write(tmp_path, "optim:\n  lr: 1.0e-4\n  lr: 2.0e-4\n")
    with pytest.raises(ConfigError, match=rf"{p}:3:.*duplicate key 'lr'"):
        load_config(p)


def test_top_level_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_missing_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent/cfg.yaml")


def test_exponent_without_dot_is_a_float(tmp_path):
    # YAML 1.1 reads `2e-4` as a string; inline model configs need real floats.
    cfg = load_config(write(tmp_path, "optim:\n  lr: 2e-4\nmodel:\n  config: {rms_norm_eps: 1e-5}\n"))
    assert cfg.optim.lr == 2e-4
    assert cfg.model.config == {"rms_norm_eps": 1e-5}


# --- overrides ------------------------------------------------------------------------------

def test_parse_overrides_both_syntaxes():
    # a scalar of the schema stays the text as typed, for the field's type to read (load_config validates)
    got = parse_overrides(["--optim.lr", "2e-4", "--train.steps=5", "--run.name", "x"])
    assert got == {"optim": {"lr": "2e-4"}, "train": {"steps": "5"}, "run": {"name": "x"}}


def test_parse_overrides_lists_bools_null_and_merge():
    got = parse_overrides(["--lora.targets", "[q_proj,v_proj]", "--train.compile=true",
                           "--model.path", "null", "--lora.rank=8", "--model.config", "{rms_norm_eps: 1e-5}"])
    assert got == {"lora": {"targets": ["q_proj", "v_proj"], "rank": "8"}, "train": {"compile": "true"},
                   "model": {"path": None, "config": {"rms_norm_eps": 1e-5}}}


@pytest.mark.parametrize("args, needle", [
    (["optim.lr", "1"], "'optim.lr'"),
    (["--optim.lr"], "missing value for '--optim.lr'"),
    (["--optim.lr", "--train.steps", "3"], "missing value for '--optim.lr'"),
    (["--optim..lr=1"], "'--optim..lr=1'"),
    (["--lora.targets=[q_proj"], "'--lora.targets=[q_proj'"),
])
def test_parse_overrides_errors_name_the_arg(args, needle):
    with pytest.raises(ConfigError) as e:
        parse_overrides(args)
    assert needle in str(e.value)


def test_overrides_apply_on_top_of_file(tmp_path):
    p = write(tmp_path, "optim:\n  lr: 1.0e-4\n  warmup_steps: 2\ntrain:\n  steps: 10\n")
    cfg = load_config(p, ["--optim.lr", "2e-4", "--train.steps=20", "--lora.targets", "[q_proj,v_proj]",
                          "--train.compile", "true", "--logging.progress_bar=false", "--resume", "auto"])
    assert cfg.optim.lr == 2e-4 and cfg.optim.warmup_steps == 2
    assert cfg.train.steps == 20 and cfg.train.compile is True
    assert cfg.logging.progress_bar is False
    assert cfg.lora.targets == ["q_proj", "v_proj"]
    assert cfg.resume == "auto"


def test_numeric_string_fields():
    assert load_config(None, ["--run.name", "7"]).run.name == "7"


@pytest.mark.parametrize("typed", ["off", "yes", "2024-01-01", "010", "0x10", "1:30", "1.50", "1e3", "~off"])
def test_a_text_field_takes_the_text_as_typed(tmp_path, typed):
    # YAML 1.1 read `off`/`yes` as booleans and `2024-01-01` as a date (refused as not a string), and `010` as 8,
    # `0x10` as 16, `1:30` as 90, `1.50` as 1.5 (silently another name): from the command line and from a file
    assert load_config(None, ["--run.name", typed]).run.name == typed
    assert load_config(None, [f"--run.name={typed}"]).run.name == typed
    assert load_config(write(tmp_path, f"run:\n  name: {typed}\n")).run.name == typed
    assert load_config(None, ["--data.columns", f"{{output: {typed}}}"]).data.columns == {"output": typed}
    assert load_config(None, ["--lora.targets", "[q_proj]", "--data.train", f"[{typed}.jsonl]"]).data.train == [
        f"{typed}.jsonl"]


def test_a_number_field_reads_the_text_as_typed(tmp_path):
    # YAML 1.1 read `010` as octal 8 and `1:30` as sexagesimal 90
    assert load_config(None, ["--train.steps", "010"]).train.steps == 10
    assert load_config(write(tmp_path, "run:\n  seed: 010\n")).run.seed == 10
    with pytest.raises(ConfigError, match=r"'train.steps'.*unable to parse string as an integer \(got '1:30'\)"):
        load_config(None, ["--train.steps", "1:30"])
    cfg = load_config(None, ["--optim.lr", "2e-4", "--data.shuffle", "off", "--optim.betas", "[0.8, 0.9]",
                             "--eval.max_batches", "null"])
    assert (cfg.optim.lr, cfg.data.shuffle, cfg.optim.betas, cfg.eval.max_batches) == (2e-4, False, (0.8, 0.9), None)


@pytest.mark.parametrize("typed", ["exp #3", "[a, b]", "a: b", "@home", "null", "*x", "- a"])
def test_a_text_only_field_on_the_command_line_is_the_text_as_typed(typed):
    # nothing of a run name typed on the command line is YAML syntax: `#3` was dropped as a comment, `[a, b]` became a
    # list, `@home` a YAML error, `null` no value (refused)
    assert load_config(None, ["--run.name", typed]).run.name == typed
    # quotes stay the way to give the text `null` to a field that may be unset
    assert load_config(None, ["--model.path", "null"]).model.path is None
    assert load_config(None, ["--model.path", "'null'"]).model.path == "null"
    assert load_config(None, ["--data.train", "my data #1.jsonl"]).data.train == "my data #1.jsonl"


@pytest.mark.parametrize("typed, kind", [("null", "no value (null)"), ("[a, b]", "a list"), ("{a: 1}", "a mapping")])
def test_yaml_that_is_not_text_for_a_text_field_says_how_to_quote(tmp_path, typed, kind):
    hint = f"YAML read the value as {kind}: to mean the text, put it in quotes ('...')"
    with pytest.raises(ConfigError, match="'run.name'") as e:
        load_config(write(tmp_path, f"run:\n  name: {typed}\n"))
    assert hint in str(e.value)
    with pytest.raises(ConfigError, match="'data.columns.output'") as e:  # text in a mapping on the command line
        load_config(None, ["--data.columns", f"{{output: {typed}}}"])
    assert hint in str(e.value)


def test_a_section_given_a_value_names_its_keys_not_a_class():
    from moetune.config.overrides import _schema_models

    classes = [m.__name__ for m in _schema_models()]
    assert "RunConfig" in classes and "DataSource" in classes  # the premise: the check knows the class names
    for args in [[f"--{section}", "demo"] for section in Config.model_fields if section != "resume"] + [
            ["--data.train", "[[a]]"]]:
        with pytest.raises(ConfigError) as e:
            load_config(None, args)
        assert "expected a mapping of keys (" in str(e.value), args
        assert not [c for c in classes if c in str(e.value)], str(e.value)


@pytest.mark.parametrize("args, hint", [
    (["--optim.learning_rate", "1e-4"], "did you mean 'optim.lr'?"),  # was optim.min_lr_ratio
    (["--train.mbs", "2"], "did you mean 'train.micro_batch_size'?"),
    (["--config", "x.yaml"], "a config file is the first argument"),  # was model.config
])
def test_suggestions_say_what_was_meant(args, hint):
    with pytest.raises(ConfigError) as e:
        load_config(None, args)
    assert hint in str(e.value)


def test_unknown_override_key_suggests():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--optim.lrr=2e-4"])
    msg = str(e.value)
    assert "unknown key 'optim.lrr'" in msg and "'--optim.lrr=2e-4'" in msg
    assert "did you mean 'optim.lr'?" in msg
    with pytest.raises(ConfigError, match=r"unknown key 'lr'.*did you mean 'optim.lr'\?"):
        load_config(None, ["--lr", "1"])
    with pytest.raises(ConfigError, match=r"unknown key 'optimm.lr'.*did you mean 'optim.lr'\?"):
        load_config(None, ["--optimm.lr", "1"])
    with pytest.raises(ConfigError, match="not a section"):
        load_config(None, ["--optim.lr.x", "1"])


def test_invalid_override_value_names_the_override(tmp_path):
    p = write(tmp_path, "train:\n  steps: 10\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, ["--train.grad_accum", "two"])
    assert "'train.grad_accum'" in str(e.value) and "'--train.grad_accum'" in str(e.value)


def test_inline_model_config_override():
    cfg = load_config(None, ["--model.config.hidden_size", "64", "--model.config.num_hidden_layers=2"])
    assert cfg.model.config == {"hidden_size": 64, "num_hidden_layers": 2}


# --- LoRA targets ---------------------------------------------------------------------------

def test_alias_expansion():
    cfg = load_config(None, ["--lora.targets", "[attention, experts, shared_experts]"])
    assert cfg.lora.targets == ["q_proj", "k_proj", "v_proj", "o_proj", "shared_experts", "experts"]
    everything = load_config(None, ["--lora.targets", "all"]).lora.targets
    assert everything == ["q_proj", "k_proj", "v_proj", "o_proj", "dense_mlp", "shared_experts", "experts"]
    # order and duplicates don't matter: same set, same resolved list
    assert load_config(None, ["--lora.targets", "[v_proj, q_proj, q_proj]"]).lora.targets == ["q_proj", "v_proj"]


def test_bad_target_suggests():
    with pytest.raises(ConfigError, match=r"'lora.targets'.*unknown LoRA target 'q_prj'.*did you mean 'q_proj'\?"):
        load_config(None, ["--lora.targets", "[q_prj]"])
    with pytest.raises(ConfigError, match="at least one"):
        load_config(None, ["--lora.targets", "[]"])


# --- dump and hash --------------------------------------------------------------------------

@pytest.mark.parametrize("overrides", [
    [],
    ["--lora.targets", "[attention, experts]", "--optim.lr", "2e-4", "--optim.betas", "[0.8, 0.99]"],
    ["--model.config", "{hidden_size: 64, rms_norm_eps: 1e-5, name: x}", "--logging.report_to", "[tensorboard]",
     "--eval.max_batches", "3", "--optim.fused", "true", "--finetune.mode", "full"],
])
def test_yaml_round_trip(tmp_path, overrides):
    cfg = load_config(None, overrides)
    p = write(tmp_path, config_to_yaml(cfg), "resolved.yaml")
    again = load_config(p)
    assert again == cfg
    assert config_to_yaml(again) == config_to_yaml(cfg)
    assert config_hash(again) == config_hash(cfg)


def test_hash_tracks_what_must_not_change_on_resume():
    base = load_config(None)
    h = config_hash(base)
    assert h == config_hash(load_config(None)) and len(h) == 16
    assert config_hash(load_config(None, ["--lora.rank", "8"])) != h
    assert config_hash(load_config(None, ["--model.dtype", "bfloat16"])) != h
    assert config_hash(load_config(None, ["--finetune.mode", "full"])) != h
    assert config_hash(load_config(None, ["--optim.lr", "2e-4"])) == h
    assert config_hash(load_config(None, ["--train.steps", "500", "--run.name", "other"])) == h
    # an alias and its expansion are the same adapter
    assert config_hash(load_config(None, ["--lora.targets", "attention"])) == h
    # explicit sections
    assert config_hash(base, sections=("optim",)) != config_hash(load_config(None, ["--optim.lr=2e-4"]), ("optim",))
    with pytest.raises(ConfigError):
        config_hash(base, sections=("optimizer",))


def test_hash_ignores_lora_in_full_mode():
    full = ["--finetune.mode", "full"]
    assert config_hash(load_config(None, full)) == config_hash(load_config(None, full + ["--lora.rank", "8"]))


# --- shipped configs ------------------------------------------------------------------------

def test_configs_are_shipped():
    names = {p.name for p in CONFIGS}
    assert {"tiny.yaml", "glm45-air-lora.yaml", "glm45-air-lora-experts.yaml", "glm45-lora.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.lora.targets and cfg.data.seq_len >= 256
    assert load_config(path, ["--optim.lr", "1e-5"]).optim.lr == 1e-5


def test_tiny_yaml_is_the_defaults():
    assert load_config(CONFIGS[0].parent / "tiny.yaml") == load_config(None)


def test_big_recipes():
    for name in ("glm45-air-lora", "glm45-air-lora-experts", "glm45-lora"):
        cfg = load_config(CONFIGS[0].parent / f"{name}.yaml")
        assert cfg.model.dtype == "bfloat16" and cfg.data.seq_len == 4096
        assert (cfg.lora.rank, cfg.lora.alpha, cfg.optim.lr) == (16, 32, 2e-4)
        assert cfg.train.micro_batch_size * cfg.train.grad_accum * 8 == 64
        # the layout (ep, dp_shard, recompute, offload) is chosen for the machine: nothing pinned in the recipes
        assert cfg.parallel.layout == "auto" and cfg.train.compile == name.startswith("glm45-air")
        assert "activation_checkpointing" not in cfg.train.model_fields_set
        assert not {"ep", "dp_shard", "cpu_offload"} & cfg.parallel.model_fields_set
        assert (cfg.eval.every, cfg.checkpoint.every) == (50, 100)
    experts = load_config(CONFIGS[0].parent / "glm45-air-lora-experts.yaml").lora.targets
    assert {"experts", "shared_experts", "q_proj", "o_proj"} <= set(experts)


# --- bad input found by a newcomer's audit ---------------------------------------------------

def test_an_override_inside_a_value_that_is_not_a_mapping_is_refused(tmp_path):
    # `train: 5` in the file plus --train.steps 2 used to train silently with the defaults of train
    cfg = write(tmp_path, "train: 5\n")
    with pytest.raises(ConfigError) as e:
        load_config(cfg, ["--train.steps", "2"])
    assert "'train'" in str(e.value) and str(cfg) in str(e.value) and "--train.steps" in str(e.value)
    cfg = write(tmp_path, "model:\n  config: tiny\n")  # a builtin name is not a dict to set a key in
    with pytest.raises(ConfigError, match=r"'model.config'.*'tiny'.*--model.config.num_hidden_layers"):
        load_config(cfg, ["--model.config.num_hidden_layers", "3"])
    with pytest.raises(ConfigError, match=r"'train' in command-line override '--train'"):
        load_config(None, ["--train", "5", "--train.steps", "2"])
    # a mapping set earlier can still be refined key by key, and an empty section is all defaults
    c = load_config(None, ["--model.config", "{num_hidden_layers: 3}", "--model.config.head_dim", "8"])
    assert c.model.config == {"num_hidden_layers": 3, "head_dim": 8}
    assert load_config(write(tmp_path, "train:\n"), ["--train.steps", "2"]).train.steps == 2


def test_a_bad_data_source_is_one_error_naming_its_key(tmp_path):
    # three errors (one per member of the union) used to name data.train and data.train[0], never the weight
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--data.train", "[{path: a.jsonl, weight: -1}]"])
    assert "\n" not in str(e.value) and "'data.train[0].weight'" in str(e.value) and "greater than 0" in str(e.value)
    with pytest.raises(ConfigError, match=r"unknown key 'data.eval\[1\].wieght'.*did you mean 'data.eval\[1\].weight'"):
        load_config(None, ["--data.eval", "[a.jsonl, {path: b.jsonl, wieght: 2}]"])
    with pytest.raises(ConfigError, match=r"a source with a weight is an item of a list"):
        load_config(None, ["--data.train", "{path: a.jsonl, weight: 2}"])
    c = load_config(None, ["--data.train", "[a.jsonl, {path: b.jsonl, weight: 0.5}]"])
    assert c.data.train[0] == "a.jsonl" and (c.data.train[1].path, c.data.train[1].weight) == ("b.jsonl", 0.5)
    assert load_config(config_file_of(c, tmp_path)).data.train == c.data.train


def config_file_of(cfg, tmp_path):
    return write(tmp_path, config_to_yaml(cfg), "resolved.yaml")


def test_check_paths_reads_the_model_config_and_finds_the_tokenizer(tmp_path):
    from moetune.config import check_paths

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "glm4_moe",\n  "hidden_size": }\n')
    with pytest.raises(ConfigError, match=r"model.path: .*config.json:2: invalid JSON"):  # a ValueError traceback before
        check_paths(load_config(None, ["--model.path", str(model)]))
    (model / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"model.config: .*expected a JSON object"):
        check_paths(load_config(None, ["--model.config", str(model / "config.json")]))
    (model / "config.json").write_text('{"model_type": "glm4_moe"}')
    # model.path is the tokenizer unless data.tokenizer says otherwise: a folder without one is named now, not after
    # the model is built with a message cut at its first line
    with pytest.raises(ConfigError, match=r"model.path: .* holds no tokenizer files.*set data.tokenizer"):
        check_paths(load_config(None, ["--model.path", str(model)]))
    with pytest.raises(ConfigError, match=r"data.tokenizer: .* holds no tokenizer files"):
        check_paths(load_config(None, ["--data.tokenizer", str(tmp_path)]))
    (model / "tokenizer.json").write_text("{}")
    check_paths(load_config(None, ["--model.path", str(model)]))


def test_an_empty_override_is_refused_not_read_as_null():
    # "--data.train $TRAIN" with TRAIN unset trained on the demo data set (YAML reads "" as null, the default)
    for args in (["--data.train", ""], ["--model.path=  "]):
        with pytest.raises(ConfigError, match=r"empty value for '--(data.train|model.path=  )' \(an unset shell"):
            load_config(None, args)
    assert load_config(None, ["--model.path", "null"]).model.path is None


def test_config_text_that_is_not_utf8_is_one_error_naming_where(tmp_path):
    # a config file with a byte that is not UTF-8 was a UnicodeDecodeError traceback; the same byte in a command-line
    # value (a lone surrogate, PEP 383) was a yaml ReaderError traceback
    path = tmp_path / "latin1.yaml"
    path.write_bytes("run:\n  name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"^{path}:2: the byte 0xe9 is not UTF-8; moetune reads UTF-8 text$"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"^value of override '--run.name': character 4 is the byte 0xe9, which is "
                                          r"not UTF-8"):
        load_config(None, ["--run.name", b"caf\xe9".decode("utf-8", "surrogateescape")])
