"""`moetune train [CONFIG.yaml] [--section.key VALUE ...] [--print-config]`."""

from __future__ import annotations

from moetune.errors import MoetuneError

CONFIG_REFERENCE = ("the configuration reference is the table in README.md (section 'Configuration reference'); "
                    "`moetune train --print-config` prints every key with its default")

TRAIN_HELP = """\
usage: moetune train [CONFIG.yaml] [--section.key VALUE ...] [--print-config]

Train a GLM-4.5-family MoE model with LoRA or fully. Without CONFIG.yaml: the embedded demo (a tiny random-init
GLM-4.5 learning to upper-case words, ~25 s on 2 CPU cores). The run directory (run.output_dir/run.name,
default runs/demo) receives config.yaml, metrics.jsonl, checkpoints/ and adapter/.

arguments:
  CONFIG.yaml             a YAML file with sections run, model, finetune, lora, data, train, optim, eval,
                          logging, checkpoint, parallel, resume (configs/ holds recipes for GLM-4.5-Air,
                          GLM-4.5, GLM-4.7-Flash and GLM-5)
  --section.key VALUE     override one key, e.g. --optim.lr 2e-4 --lora.targets [q_proj,v_proj] (also
                          --section.key=VALUE): a key of one value takes the text as typed (null: unset, where
                          the key may be); lists and mappings are YAML
  --print-config          print the resolved config (defaults < file < overrides) as YAML and exit
  -h, --help              show this help and exit

Many GPUs or nodes: torchrun --nproc-per-node 8 -m moetune train CONFIG.yaml (or srun / accelerate launch).
Afterwards: moetune export adapter|merged --checkpoint RUN_DIR ..., moetune generate RUN_DIR --prompt TEXT,
moetune plot RUN_DIR.
{reference}.
"""


def split_config_argument(argv: list[str]) -> tuple[str | None, list[str]]:
    """(CONFIG.yaml or None, the rest): the config file is the first argument when it is not an option."""
    if argv and not argv[0].startswith("-"):
        return argv[0], argv[1:]
    return None, argv


def train(argv: list[str]) -> int:
    from moetune.config import check_paths, config_to_yaml, load_config

    if any(a in ("-h", "--help") for a in argv):
        print(TRAIN_HELP.format(reference=CONFIG_REFERENCE[0].upper() + CONFIG_REFERENCE[1:]))
        return 0
    print_config = "--print-config" in argv
    config_path, overrides = split_config_argument([a for a in argv if a != "--print-config"])
    cfg = load_config(config_path, overrides)
    if print_config:
        print(config_to_yaml(cfg), end="")
        return 0
    check_paths(cfg)  # a typo or a placeholder path: one line now, not a hub traceback after model building
    from moetune.parallel.mesh import shutdown_distributed
    from moetune.train.loop import train as run_training

    try:
        run_training(cfg)
    except MoetuneError:
        shutdown_distributed(finished=False)
        raise
    shutdown_distributed(finished=True)  # anything else keeps its traceback and exits: see there
    return 0

