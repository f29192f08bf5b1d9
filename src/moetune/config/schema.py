"""The configuration's schema: one pydantic model per section, validated as a whole.

Precedence and reading (defaults < YAML file < `--section.key value`) live in overrides.py, the checks of the paths a
config names in paths.py. extra="forbid" everywhere: a trainer that silently ignores `optim.lrr: 1e-4` wastes a
GPU-day.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Sequence, Union, get_args

import yaml
from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError, field_validator,
                      model_validator)

from moetune.parallel.ac_modes import check_setting
from moetune.errors import ConfigError  # noqa: F401  (re-exported)
from moetune.model.config import read_json_object
from moetune.names import LORA_ALIASES, LORA_TARGETS

BUILTIN_MODELS = ("tiny", "glm45-air", "glm45-air-8layers", "glm45", "glm47-flash", "glm5")


def _did_you_mean(word: str, choices: Sequence[str]) -> str:
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" — did you mean {match[0]!r}?" if match else ""


class _Section(BaseModel):
    # extra="forbid": a misspelt key must fail, not fall back to a default unnoticed.
    # coerce_numbers_to_str: a config built in Python may give a name as a number (the YAML reader, overrides.py,
    # passes a scalar on as the text typed, for the field's type to read).
    # allow_inf_nan=False: `inf` and `nan` read as floats; no setting of ours means anything with them.
    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, allow_inf_nan=False)


class RunConfig(_Section):
    name: str = Field("demo", min_length=1)
    output_dir: str = "runs"  # the run directory is output_dir/name
    seed: int = 0

    @field_validator("name")
    @classmethod
    def _one_folder_name(cls, v):
        # the run directory must stay inside output_dir: no separators, no "." / "..", not absolute
        if v in (".", "..") or "/" in v or "\\" in v or "\0" in v:
            raise ValueError("must be one folder name inside run.output_dir (no '/', '..' or absolute path), "
                             f"got {v!r}")
        return v


class ModelSection(_Section):
    """The `model:` section (the architecture itself is moetune.model.config.ModelConfig)."""

    path: Optional[str] = None  # HF checkpoint directory
    config: Union[str, dict[str, Any], None] = None  # config.json path, inline dict or builtin name
    num_hidden_layers: Optional[int] = Field(None, ge=1)  # truncate for proxies (AIR-8)
    dtype: Literal["bfloat16", "float32"] = "float32"  # frozen base / compute dtype
    # store the frozen base in fp8 e4m3 (LoRA only): "fp8" one scale per output row, "fp8_block" one per 128×128
    # block. An FP8 checkpoint (compressed-tensors or `quant_method: fp8`) is read as stored without this key.
    quantize: Optional[Literal["fp8", "fp8_block"]] = None
    attn_implementation: Literal["auto", "sdpa", "flex", "varlen", "varlen_fa4", "eager"] = "auto"
    # random init when there is no checkpoint. 0.1 is the demo's: at 0.02 the tiny model's frozen random lm_head
    # cannot produce logits large enough for the loss to fall far (proxies for speed set 0.02, as HF's init)
    init_std: float = Field(0.1, gt=0)

    @field_validator("config")
    @classmethod
    def _known_builtin(cls, v):
        # A bare word can only be a builtin name; catch "glm45air" here, not deep in model code.
        bare = isinstance(v, str) and not re.search(r"[/\\]|\.json$", v) and not Path(v).exists()
        if bare and v not in BUILTIN_MODELS:
            raise ValueError(f"unknown builtin model {v!r}{_did_you_mean(v, BUILTIN_MODELS)} "
                             f"(builtins: {', '.join(BUILTIN_MODELS)}; or a config.json path or a mapping)")
        return v

    @property
    def effective_config(self) -> Union[str, dict, None]:
        """What to build: `config` if given, else "tiny" without a checkpoint, else None (= path's config.json).
        Kept out of the stored fields so a dumped config plus `--model.path X` still means X's config."""
        if self.config is not None:
            return self.config
        return "tiny" if self.path is None else None


class FinetuneConfig(_Section):
    mode: Literal["lora", "full"] = "lora"
    train_router: bool = False  # full mode only: train the router weight or keep it frozen


class LoraConfig(_Section):
    rank: int = Field(16, gt=0)
    alpha: float = Field(32, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    rslora: bool = False
    targets: list[str] = Field(default_factory=lambda: list(LORA_ALIASES["attention"]))

    @field_validator("targets", mode="before")
    @classmethod
    def _single_name_is_a_list(cls, v):
        return [v] if isinstance(v, str) else v

    @field_validator("targets")
    @classmethod
    def _expand_aliases(cls, v):
        # Resolve aliases and use canonical order, so the saved config and the resume hash don't
        # depend on how the user spelled the same set ("attention" == [q,k,v,o] == [o,v,k,q]).
        chosen = set()
        for name in v:
            if name not in LORA_TARGETS and name not in LORA_ALIASES:
                raise ValueError(f"unknown LoRA target {name!r}"
                                 f"{_did_you_mean(name, LORA_TARGETS + tuple(LORA_ALIASES))}"
                                 f" (allowed: {', '.join(LORA_TARGETS + tuple(LORA_ALIASES))})")
            chosen.update(LORA_ALIASES.get(name, (name,)))
        if not chosen:
            raise ValueError("at least one LoRA target is required")
        return [t for t in LORA_TARGETS if t in chosen]


class DataSource(_Section):
    path: str = Field(min_length=1)
    weight: float = Field(1.0, gt=0, allow_inf_nan=False)  # uses of each document per epoch (data.mix_documents)


# one source, or several mixed by weight: [a.jsonl, {path: b.parquet, weight: 0.5}]. Tagged by the value's type, so
# that a bad weight is reported once as `data.train[0].weight`, not also as "input should be a valid string".
_Source = Annotated[Union[Annotated[str, Tag("str")], Annotated[DataSource, Tag("source")]],
                    Discriminator(lambda v: "str" if isinstance(v, (str, int, float)) else "source")]
_Sources = Optional[Annotated[Union[Annotated[str, Tag("str")], Annotated[list[_Source], Tag("list")]],
                              Discriminator(lambda v: "list" if isinstance(v, (list, tuple)) else "str")]]
_COLUMNS = ("text", "messages", "conversations", "instruction", "input", "output", "system")


class DataConfig(_Section):
    train: _Sources = None  # JSONL, Parquet, Arrow or hub name(s); None -> the embedded demo dataset
    eval: _Sources = None
    # our field -> the data's column, for data whose columns have other names: {messages: dialog, output: answer}
    columns: Optional[dict[str, str]] = None
    tokenizer: Optional[str] = None  # None -> model.path's tokenizer, else the embedded one
    seq_len: int = Field(256, ge=8)
    pack: bool = True
    train_on: Literal["assistant", "all"] = "assistant"
    # Reasoning (`reasoning_content` or a leading <think>…</think> block) is part of what the assistant writes:
    # trained by default, as for distilling reasoning traces; false conditions on it without learning to produce it.
    train_reasoning: bool = True
    # GLM-4.5's template writes an empty <think></think> into turns without reasoning. Training it teaches the model to
    # skip thinking whenever a data set has no reasoning, so by default it is context, not target.
    train_empty_think: bool = False
    skip_malformed: bool = False
    shuffle: bool = True

    @field_validator("train", "eval", mode="before")
    @classmethod
    def _a_mapping_goes_in_a_list(cls, v):
        if isinstance(v, dict):
            raise ValueError("one source is a path; a source with a weight is an item of a list: "
                             "[{path: PATH, weight: W}, ...]")
        return v

    @field_validator("train", "eval")
    @classmethod
    def _non_empty_list(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("an empty list of data sources")
        return v

    @field_validator("columns")
    @classmethod
    def _known_columns(cls, v):
        for key in v or {}:
            if key not in _COLUMNS:
                raise ValueError(f"unknown field {key!r}{_did_you_mean(key, _COLUMNS)} (data.columns maps ours to "
                                 f"the data's: {', '.join(_COLUMNS)})")
        return v
    # Tokenized data is cached (Arrow, via Hugging Face datasets) under a key of file content + tokenizer + these
    # options, and reused across runs and ranks. null: $MOETUNE_CACHE_DIR or ~/.cache/moetune/datasets.
    cache: bool = True
    cache_dir: Optional[str] = None


DETERMINISTIC_COMPILE = "compile"  # train.deterministic's level that holds only the compiler (train/determinism.py)


class TrainConfig(_Section):
    steps: int = Field(200, ge=1)  # optimizer steps
    # passes over the training data; when set, steps is derived from it and the data size (train_steps_for_epochs)
    epochs: Optional[float] = Field(None, gt=0, allow_inf_nan=False)
    micro_batch_size: int = Field(4, ge=1)  # sequences per rank per micro-batch
    grad_accum: int = Field(1, ge=1)
    # recompute in backward (ac_modes): none | selective (the element-wise ops) | attention (the attention block) |
    # full (the whole layer), or {mode: layers} for the layers in order, e.g. {full: 16, attention: 30};
    # parallel.layout auto chooses it unless set
    activation_checkpointing: Union[str, dict[str, Any]] = "none"
    compile: bool = False
    # CUDA graphs around each compiled layer (torch.compile mode "reduce-overhead"): the GPU no longer waits for the
    # host to launch a layer's many small kernels. A GPU, compiled, no FSDP (whose parameter storage moves); under
    # expert parallelism the parts of a layer around its exchange replay as graphs, the exchange runs eagerly between
    # them; anywhere else true is an error
    cuda_graphs: bool = False
    # bit-for-bit repeatable runs in another process (train/determinism.py): "compile" holds Inductor to choices made
    # without timing (~1% on GLM-4.7-Flash); true also torch's deterministic algorithms and cuDNN/cuBLAS fixed (−26%)
    deterministic: Union[bool, Literal[DETERMINISTIC_COMPILE]] = False
    max_grad_norm: float = Field(1.0, ge=0)  # 0 disables clipping
    aux_loss_coef: float = Field(0.0, ge=0)  # load-balancing loss; 0 = off
    # Python's automatic garbage collection off during training, a young-generation collection every this many
    # steps (train/garbage.py); 0 leaves Python's automatic collection on
    gc_every: int = Field(50, ge=0)

    @field_validator("activation_checkpointing")
    @classmethod
    def _known_modes(cls, v):
        check_setting(v)  # one message for both forms; the layers' sum is checked against the model (layout.py)
        return v

    @field_validator("deterministic", mode="before")
    @classmethod
    def _one_level(cls, v):
        # one message, not one per member of the union
        if v == DETERMINISTIC_COMPILE:
            return v
        try:
            return TypeAdapter(bool).validate_python(v)  # a switch as pydantic reads one ("true", "off", ...)
        except ValidationError:
            raise ValueError(f'must be true, false or "{DETERMINISTIC_COMPILE}", got {v!r}') from None


class OptimConfig(_Section):
    lr: float = Field(3e-3, gt=0)  # the demo's; real recipes (configs/*.yaml) set their own
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(10, ge=0)  # capped at train.steps, so `--train.steps 3` needs no second override
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    fused: Optional[bool] = None  # None = auto

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v):
        if not all(0 <= b < 1 for b in v):
            raise ValueError(f"betas must be in [0, 1), got {list(v)}")
        return v


class EvalConfig(_Section):
    every: int = Field(50, ge=0)  # 0 = only at the end
    max_batches: Optional[int] = Field(None, ge=1)


# A callable discriminator, so that a bad list element is reported as `logging.report_to[0]` alone, not also as
# "input should be 'auto'".
_Trackers = Annotated[
    Union[Annotated[Literal["auto"], Tag("auto")], Annotated[list[Literal["tensorboard", "wandb"]], Tag("list")]],
    Discriminator(lambda v: "auto" if v == "auto" else "list"),
]


class LoggingConfig(_Section):
    every: int = Field(1, ge=1)
    expert_stats_every: int = Field(10, ge=0)  # 0 = off
    # The CUDA allocator's history over this step (0 = off), written to the run directory's memory_snapshot/ with
    # what was live at the step's peak (train/memory_snapshot.py)
    memory_snapshot_step: int = Field(0, ge=0)
    # A torch.profiler trace of this step (0 = off), to the run directory's profile/ (train/step_profile.py)
    profile_step: int = Field(0, ge=0)
    # "auto": TensorBoard when it is installed, else nothing; or a list: [], [tensorboard], [tensorboard, wandb]
    report_to: _Trackers = "auto"
    progress_bar: bool = True
    # An alarm line in the log when an expert gets no token for this many expert-stats intervals in a row (0 = off)
    # or when a layer's busiest expert gets more than this many times the mean load (0 = off).
    alarm_dead_intervals: int = Field(3, ge=0)
    alarm_max_over_mean: float = Field(4.0, ge=0)

    @field_validator("report_to", mode="before")
    @classmethod
    def _single_tracker_is_a_list(cls, v):
        return [v] if isinstance(v, str) and v != "auto" else v


class CheckpointConfig(_Section):
    every: int = Field(0, ge=0)  # 0 = no intermediate checkpoints (the last step is always saved)
    keep_last: int = Field(2, ge=1)
    async_save: bool = False  # write in a background thread while training goes on (meant for full fine-tuning)
    max_bad_steps: int = Field(5, ge=1)  # this many consecutive non-finite steps stop the run


class ParallelConfig(_Section):
    # auto: moetune.parallel.layout picks ep, dp_shard, train.activation_checkpointing and cpu_offload from the memory
    # estimate, keeping each of them the user set (in the file or on the command line); manual: take them as written
    layout: Literal["auto", "manual"] = "auto"
    gpu_memory_gib: Optional[float] = Field(None, gt=0)  # per GPU, for `layout: auto`; null: what torch.cuda reports
    ep: int = Field(1, ge=1)
    dp_shard: int = -1  # FSDP shard group size; -1 = world_size / ep; smaller (ep 1): the rest replicates (HSDP)
    reshard_after_forward: bool = True
    cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy: sharded params, grads and optimizer state in host memory
    # an fp8 base's weights kept a second time, transposed, for the input gradient's fp8 GEMMs (which take K-major
    # operands only) instead of a copy made in every backward: faster, for the fp8 weights' bytes again. auto: kept
    # when the layout fits with them and FSDP does not shard the weights
    fp8_transposed_copies: Union[Literal["auto"], bool] = "auto"

    @field_validator("dp_shard")
    @classmethod
    def _auto_or_positive(cls, v):
        if v != -1 and v < 1:
            raise ValueError(f"must be -1 (auto) or >= 1, got {v}")
        return v


class Config(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelSection = Field(default_factory=ModelSection)
    finetune: FinetuneConfig = Field(default_factory=FinetuneConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    resume: str = Field("none", min_length=1)  # "auto" | "none" | a checkpoint path
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)

    @model_validator(mode="before")
    @classmethod
    def _empty_section_means_defaults(cls, data):
        # `lora:` with every line commented out parses as None; treat it as "all defaults".
        if isinstance(data, dict):
            data = {k: {} if v is None and _section_class(Config, k) else v for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _cross_field_checks(self):
        if self.finetune.train_router and self.finetune.mode != "full":
            raise ValueError("finetune.train_router only applies to finetune.mode: full")
        kernel = {"varlen": "FlashAttention-2", "varlen_fa4": "FlashAttention-4"}.get(self.model.attn_implementation)
        if kernel and self.model.dtype != "bfloat16":
            raise ValueError(f"model.attn_implementation: {self.model.attn_implementation} ({kernel}) computes in "
                             f"bf16 only: set model.dtype: bfloat16 (it is {self.model.dtype})")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name


def _section_class(cls: type[BaseModel], name: str) -> Optional[type[BaseModel]]:
    ann = cls.model_fields[name].annotation if name in cls.model_fields else None
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _all_paths(cls: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """Every valid dotted key (sections and leaves): the vocabulary for suggestions."""
    out = []
    for name in cls.model_fields:
        out.append(prefix + name)
        if sub := _section_class(cls, name):
            out += _all_paths(sub, f"{prefix}{name}.")
    return out


def _model_in(annotation) -> Optional[type[BaseModel]]:
    """The pydantic model somewhere inside a field's type (DataSource inside data.train's union of lists)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        if found := _model_in(arg):
            return found
    return None


def config_to_yaml(cfg: Config) -> str:
    """The fully resolved config as YAML; load_config() on it gives back an equal Config. A comment line names the
    moetune version, so a run directory records what produced it even without a tracker."""
    from moetune.version import __version__

    header = f"# resolved config, written by moetune {__version__}\n"
    return header + yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=False)


def config_hash(cfg: Config, sections: Sequence[str] = ("model", "lora", "finetune")) -> str:
    """16-hex-digit digest of what must not change across a resume (by default the model and
    what is trained). The lora section is ignored in full mode, where it has no effect."""
    return dump_hash(cfg.model_dump(mode="json"), sections)


def dump_hash(dump: dict, sections: Sequence[str] = ("model", "lora", "finetune")) -> str:
    """config_hash of a config as dumped (a run's config.yaml, loaded as plain YAML)."""
    unknown = [s for s in sections if s not in dump]
    if unknown:
        raise ConfigError(f"config_hash: unknown section(s) {unknown}")
    full = (dump.get("finetune") or {}).get("mode") == "full"
    picked = {s: dump[s] for s in sections if not (s == "lora" and full)}
    blob = json.dumps(picked, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def train_steps_for_epochs(cfg: Config, batches_per_epoch: int) -> int:
    """train.steps for train.epochs passes over data of `batches_per_epoch` global micro-batches (the loader's count,
    the tail that fills no whole global micro-batch dropped), at least 1."""
    import math

    return max(1, math.ceil(cfg.train.epochs * batches_per_epoch / cfg.train.grad_accum))
