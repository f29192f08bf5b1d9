"""The base of a run trained on a random init (the demo, proxies), written out as an HF checkpoint.

The adapter records the recipe of such a base (`base_init`, model/random_base.py). Export, `--verify`, generate
and vLLM need the base as files: it is rebuilt once, bit for bit, and written with our streaming writer (hub
layout, plus the run's tokenizer) into RUN/base/, or, for an adapter outside a run directory, into the cache.
"""

from __future__ import annotations

import hashlib
import json
import os

from moetune.export.adapter import output_errors
from moetune.model.random_base import build_base, check_recipe
from moetune.output_dir import ANY, atomic_output_dir

RECIPE_FILE = "moetune_base.json"


def recipe_hash(recipe: dict) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def _tokenizer_dir(recipe: dict) -> str | None:
    from moetune.data import DEMO_TOKENIZER_DIR

    tok = recipe.get("tokenizer")
    if tok is None:
        return str(DEMO_TOKENIZER_DIR)
    return tok if os.path.isdir(tok) else None  # a hub name: transformers finds it again by name


def write_base(recipe: dict, out_dir: str) -> str:
    """Rebuild the base and write it as an HF checkpoint at `out_dir` (a folder of ours: moetune/output_dir.py's
    rule, so it appears complete or not at all, and a stale base of an earlier recipe is replaced)."""
    from moetune.export.merged import _copy_side_files
    from moetune.export.merged_sources import write_model

    with output_errors(out_dir, "the run's rebuilt base model"), \
            atomic_output_dir(out_dir, ANY, label=f"the run's rebuilt base {out_dir}") as tmp:  # disk full: one line
        model = build_base(recipe)
        write_model(model, tmp, dtype=recipe["dtype"])
        del model
        tok = _tokenizer_dir(recipe)
        if tok:
            _copy_side_files(tok, tmp)
        with open(os.path.join(tmp, RECIPE_FILE), "w") as f:
            json.dump(recipe, f, indent=2)
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)
    return out_dir


def _is_current(base_dir: str, recipe: dict) -> bool:
    try:
        with open(os.path.join(base_dir, RECIPE_FILE)) as f:
            return json.load(f) == recipe
    except (OSError, ValueError):
        return False


def default_base_dir(adapter_dir: str, recipe: dict) -> str:
    """RUN/base when the adapter sits in a run directory (RUN/adapter, next to RUN/config.yaml), else the cache."""
    run_dir = os.path.dirname(os.path.abspath(adapter_dir))
    if os.path.basename(os.path.abspath(adapter_dir)) == "adapter" and os.path.isfile(os.path.join(run_dir, "config.yaml")):
        return os.path.join(run_dir, "base")
    cache = os.environ.get("MOETUNE_CACHE_DIR") or os.path.expanduser("~/.cache/moetune")
    return os.path.join(cache, "bases", recipe_hash(recipe))


def ensure_base(recipe: dict, adapter_dir: str) -> str:
    """The path of the rebuilt base for `recipe`, writing it first unless an identical one is already there."""
    base_dir = default_base_dir(adapter_dir, recipe)
    if not _is_current(base_dir, recipe):
        write_base(recipe, base_dir)
    return base_dir


def resolve_base(adapter_dir: str, meta: dict, base: str | None = None) -> str | None:
    """The base to use with the moetune adapter at `adapter_dir`: `base` (the --base flag) if given, else the one
    the adapter was trained on: model.path, or the rebuilt random init. None when the adapter records neither."""
    if meta.get("base_init") is not None:  # checked even with --base: its dtype is the export's default
        check_recipe(meta["base_init"], os.path.join(adapter_dir, "adapter_config.json"))
    if base:
        return base
    if meta.get("base_model"):
        return meta["base_model"]
    if meta.get("base_init"):
        return ensure_base(meta["base_init"], adapter_dir)
    return None
