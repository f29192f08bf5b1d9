"""Checks of the paths a configuration names (model.path, model.config, data files, the tokenizer, resume): before
any model building or hub lookup, one line naming the key and the path."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from moetune.config.schema import BUILTIN_MODELS, Config
from moetune.errors import ConfigError
from moetune.model.config import read_json_object

_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
# what a Hugging Face tokenizer directory holds, one of them at least
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "*.model", "vocab*", "*.tiktoken")


def _local_looking(path: str, suffixes: Sequence[str] = ()) -> bool:
    """A path the user means as a local file (not a hub name like `org/name` or `org/name:split`)."""
    p = path.split(":")[0] if not path.startswith("/") else path
    return (path.startswith(("/", "./", "../", "~")) or p.count("/") != 1 or p.endswith(tuple(suffixes))
            or "\\" in path)


def check_paths(cfg: Config) -> None:
    """Every path the config names exists (before any model building or hub lookup): ConfigError naming the key
    and the path otherwise. Hub names (`org/name`) are left to their loaders."""
    def missing(key: str, path: str, what: str) -> ConfigError:
        return ConfigError(f"{key}: {what} not found: {path} (set {key} in the config or pass --{key} PATH)")

    m = cfg.model
    if m.path is not None:
        p = Path(m.path).expanduser()
        if not p.exists():
            raise missing("model.path", m.path, "HF checkpoint directory")
        if not (p / "config.json").is_file():
            raise ConfigError(f"model.path: {m.path} has no config.json (expected an HF checkpoint directory)")
        if m.config is None:
            _check_json_object(p / "config.json", "model.path")
    if isinstance(m.config, str) and m.config not in BUILTIN_MODELS:
        if not Path(m.config).expanduser().is_file():
            raise missing("model.config", m.config, "config.json file")
        _check_json_object(Path(m.config).expanduser(), "model.config")
    for key in ("train", "eval"):
        sources = getattr(cfg.data, key)
        sources = [] if sources is None else [sources] if isinstance(sources, str) else sources
        for src in sources:
            path = src if isinstance(src, str) else src.path
            if not Path(path).expanduser().exists() and _local_looking(path, _DATA_SUFFIXES):
                raise missing(f"data.{key}", path, "file")
    tok = cfg.data.tokenizer
    if tok is not None and not Path(tok).expanduser().exists() and _local_looking(tok):
        raise missing("data.tokenizer", tok, "tokenizer directory")
    key, tok = ("data.tokenizer", tok) if tok is not None else ("model.path", m.path)
    if tok is not None and Path(tok).expanduser().is_dir() and not any(
            any(Path(tok).expanduser().glob(pattern)) for pattern in _TOKENIZER_FILES):
        raise ConfigError(f"{key}: {tok} holds no tokenizer files ({', '.join(_TOKENIZER_FILES)})"
                          + ("; set data.tokenizer to the model's tokenizer" if key == "model.path" else ""))
    if cfg.resume not in ("auto", "none") and not Path(cfg.resume).expanduser().exists():
        raise missing("resume", cfg.resume, "checkpoint directory")


def _check_json_object(path: Path, key: str) -> None:
    """A model's config.json that is not a JSON object: named with its line here, before the model code reads it."""
    try:
        read_json_object(path)
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path} ({e.strerror})") from None
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None
