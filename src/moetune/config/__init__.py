"""moetune configuration: one YAML file, validated by pydantic (schema.py), overridable from the command line
(overrides.py), the paths it names checked before anything is built (paths.py).

Every problem surfaces as a ConfigError naming the dotted key and where it came from (the file or the override).
"""

from moetune.config.overrides import load_config, parse_overrides
from moetune.config.paths import check_paths
from moetune.config.schema import (BUILTIN_MODELS, CheckpointConfig, Config, DataConfig, DataSource, EvalConfig,
                                   FinetuneConfig, LoggingConfig, LoraConfig, ModelSection, OptimConfig,
                                   ParallelConfig, RunConfig, TrainConfig, config_hash, config_to_yaml, dump_hash,
                                   train_steps_for_epochs)
from moetune.errors import ConfigError

__all__ = ["BUILTIN_MODELS", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "DataSource", "EvalConfig",
           "FinetuneConfig", "LoggingConfig", "LoraConfig", "ModelSection", "OptimConfig", "ParallelConfig",
           "RunConfig", "TrainConfig", "check_paths", "config_hash", "config_to_yaml", "dump_hash", "load_config",
           "parse_overrides", "train_steps_for_epochs"]
