"""The preflight report behind `moetune inspect` (moetune.cli.inspect): it needs no GPU.

Prints the resolved config; the architecture and its parameter counts (total, active per token, trainable by
module kind: the model is built on the meta device, LoRA applied there, nothing allocated); the parallel layout the
run would use at that world size and GPU memory, and why (layout.py); an estimate of peak memory per GPU of that
layout (estimate.py says how it is computed); the data: statistics of the train
and eval sets and the first packed sample with its trained tokens marked. Parts whose inputs do not exist
(placeholder paths in the shipped configs) are skipped with a note instead of failing, so that a config can be
checked before the checkpoint and data are on the machine. Data problems (a malformed line, nothing left to train)
are reported and make the exit status 1, as does a layout that cannot fit.
"""

from __future__ import annotations

import os
import re
import tempfile

from moetune.config import ConfigError, config_to_yaml
from moetune.parallel.ac_modes import describe
from moetune.parallel.estimate import COMMON_GPUS, build_meta_model
from moetune.parallel.layout import Layout, MemoryLimit, gpu_memory_gib

TRAINED_ANSI = ("\x1b[1;32m", "\x1b[0m")  # bold green
CONTEXT_ANSI = ("\x1b[2m", "\x1b[0m")  # dim
TRAINED_PLAIN = ("[[", "]]")


def report(cfg, world_size: int = 1, gpu_mem_gib: float | None = None, color: bool = False,
           sample_tokens: int = 512) -> bool:
    """Print the preflight report of `cfg` at `world_size` processes of `gpu_mem_gib` each (None:
    parallel.gpu_memory_gib, else this machine's GPU); False when data problems or a layout that cannot fit were
    reported."""
    _section("resolved config")
    print(config_to_yaml(cfg).rstrip())
    gpu_mem = gpu_mem_gib if gpu_mem_gib is not None else gpu_memory_gib(cfg)
    model_ok = inspect_model(cfg, world_size, gpu_mem)
    ok = inspect_data(cfg, world_size, color, sample_tokens)
    if model_ok is None:
        print("\n(model sections skipped: see the note above)")
    return ok and model_ok is not False


def _section(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 72 - len(title)))


def _b(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n:,.0f}"


# ------------------------------------------------------------------------------------------------ model
def resolve_model(cfg):
    """(ModelConfig, note); for a placeholder model.path without model.config, the builtin shape its name says."""
    from moetune.model.config import BUILTIN, resolve_model_config
    from moetune.train.setup import model_config_for

    try:
        return model_config_for(cfg), None
    except FileNotFoundError as e:
        guess = _builtin_from_name(cfg.model.path or "")
        if guess is None:
            return None, f"{e}; pass --model.config (one of {', '.join(BUILTIN)} or a config.json) to inspect the model"
        m = resolve_model_config(None, guess, cfg.model.num_hidden_layers)
        return m, (f"model.path {cfg.model.path} has no config.json (a placeholder?): showing the builtin {guess!r} "
                   f"that its name matches")


def _builtin_from_name(path: str) -> str | None:
    name = os.path.basename(os.path.normpath(path)).lower()
    if re.search(r"glm-?5", name):
        return "glm5"
    if re.search(r"glm-?4\.?7-?flash", name):
        return "glm47-flash"
    if re.search(r"glm-?4\.?[567]", name):
        return "glm45-air" if "air" in name else "glm45"
    return None


def describe_architecture(m) -> str:
    from moetune.model.config import GLM4_MOE_LITE, GLM_MOE_DSA

    n_moe = sum(m.is_moe_layer(i) for i in range(m.num_hidden_layers))
    name = {GLM4_MOE_LITE: "GLM-4.7-Flash (glm4_moe_lite, MLA)", GLM_MOE_DSA: "GLM-5 (glm_moe_dsa, MLA + DSA)"}.get(
        m.model_type, "GLM-4.5 MoE (glm4_moe)")
    if m.is_mla:
        q = f"q_lora {m.q_lora_rank}" if m.q_lora_rank else "q_proj (no q_lora)"
        attention = (f"{m.num_attention_heads} heads MLA ({q}, kv_lora {m.kv_lora_rank}, qk {m.qk_nope_head_dim} + "
                     f"rope {m.qk_rope_head_dim}, v {m.v_head_dim})")
    else:
        attention = f"{m.num_attention_heads} heads / {m.num_key_value_heads} KV × {m.head_dim}"
    text = (f"{name}: {m.num_hidden_layers} layers ({m.num_hidden_layers - n_moe} dense + {n_moe} MoE), hidden "
            f"{m.hidden_size}, {attention}, {m.n_routed_experts} experts top-{m.num_experts_per_tok} + "
            f"{m.n_shared_experts} shared (intermediate {m.moe_intermediate_size}), vocab {m.vocab_size:,}")
    if m.model_type == GLM_MOE_DSA:
        own = sum(m.indexer_type(i) == "full" for i in range(m.num_hidden_layers))
        text += (f"\nDSA indexer: {m.index_n_heads} heads × {m.index_head_dim}, top-{m.index_topk} keys per query "
                 f"({own} layers compute it, {m.num_hidden_layers - own} reuse the previous layer's)")
    return text


def inspect_model(cfg, world_size: int, gpu_mem: float | None) -> bool | None:
    """Prints the model, the layout and its memory estimate; None when the model cannot be resolved, False when no
    layout fits."""
    from moetune.parallel.estimate import count_params, estimate_memory, format_estimate
    from moetune.model.lora import format_trainable_table
    from moetune.train.metrics import active_matmul_params

    _section("model")
    m, note = resolve_model(cfg)
    if note:
        print(f"note: {note}")
    if m is None:
        return None
    print(describe_architecture(m))
    try:
        model = build_meta_model(cfg, m)
    except ConfigError as e:  # LoRA targets this architecture does not have (q_proj/k_proj/v_proj on MLA)
        print(f"error: {e}")
        return False
    counts = count_params(model)
    base = counts.total - counts.lora
    active = active_matmul_params(m)
    mtp = (f"; the checkpoint's {m.num_nextn_predict_layers} MTP layer(s) are not loaded and not counted"
           if m.num_nextn_predict_layers else "")
    print(f"parameters, total:        {base:>18,}  ({_b(base)}{mtp})")
    indexer = " with the DSA indexer's projections" if m.model_type == "glm_moe_dsa" else ""
    print(f"active per token:         {active:>18,}  ({_b(active)}: matmul weights a token passes through — attention"
          f"{indexer}, dense MLP or top-{m.num_experts_per_tok} + shared experts, router, lm_head)")
    print(f"trainable ({cfg.finetune.mode}):" + " " * max(1, 17 - len(cfg.finetune.mode)) + f"{counts.trainable:>18,}  "
          f"({_b(counts.trainable)})")
    print(format_trainable_table(model))

    _section(f"parallel layout, world size {world_size}")
    choices = choose_layouts(cfg, world_size, gpu_mem, m, counts)
    layout, text = layout_report(choices)
    print(text)
    if layout is None:
        return False

    _section(f"memory estimate per GPU, world size {world_size}")
    gb = cfg.train.micro_batch_size * cfg.train.grad_accum * world_size
    print(f"world size {world_size} (--world-size), ep {layout.ep}, dp_shard {layout.dp_shard}, replicas "
          f"{layout.dp_replicate}; micro-batch {cfg.train.micro_batch_size} × seq_len {cfg.data.seq_len}, grad_accum "
          f"{cfg.train.grad_accum}: global batch {gb} sequences = {gb * cfg.data.seq_len:,} tokens per step")
    print(f"{cfg.model.dtype}, activation checkpointing: {describe(layout.activation_checkpointing)}, compile: "
          f"{cfg.train.compile}, cpu_offload: {layout.cpu_offload}, reshard_after_forward: "
          f"{cfg.parallel.reshard_after_forward}")
    print(format_estimate(estimate_memory(cfg, m, counts, layout)))
    return True


def choose_layouts(cfg, world_size: int, gpu_mem: float | None, m, counts) -> list[tuple[str | None, object]]:
    """[(GPU name or None, Layout or the ConfigError saying why none fits)]: the layout for GPUs of `gpu_mem` GiB, or,
    without a memory (no GPU here, none given), the layout each of the common GPUs would get: a layout is chosen to
    fit a memory, and there is none to fit."""
    from moetune.parallel.layout import resolve_layout

    gpus = {None: gpu_mem} if gpu_mem is not None else COMMON_GPUS
    out = []
    for name, gib in gpus.items():
        memory = MemoryLimit(gib, "GPU memory" if name is None else name)
        try:
            out.append((name, resolve_layout(cfg, world_size, memory, model_config=m, counts=counts)))
        except ConfigError as e:
            out.append((name, e))
    return out


def layout_report(choices) -> tuple[Layout | None, str]:
    """(the layout whose estimate is shown next, the text): the one choice with its reasons; for the common GPUs each
    GPU's choice on a line, then the reasons of the first (smallest) GPU that something fits."""
    refusals = {str(c) for _, c in choices if isinstance(c, ConfigError)}
    if len(choices) == 1 or (len(refusals) == 1 and all(isinstance(c, ConfigError) for _, c in choices)):
        choice = choices[0][1]  # one memory, or the same refusal for every GPU (a setting no layout can use)
        return (None, f"error: {choice}") if isinstance(choice, ConfigError) else (choice, choice.describe())
    lines = ["no GPU memory to choose for (no GPU here, no --gpu-mem-gib, no parallel.gpu_memory_gib): the choice "
             "for each common GPU"]
    for name, choice in choices:
        what = choice.summary() if isinstance(choice, Layout) else f"error: {choice}"
        lines.append(f"  {name} ({COMMON_GPUS[name]:.1f} GiB): {what}")
    fitting = [(name, c) for name, c in choices if isinstance(c, Layout)]
    if not fitting:
        return None, "\n".join(lines)
    name, layout = fitting[0]
    lines.append(f"the {name}'s, in detail (--gpu-mem-gib for another GPU):")
    lines.append(layout.describe())
    return layout, "\n".join(lines)


# ------------------------------------------------------------------------------------------------ data
def inspect_data(cfg, world_size: int, color: bool, max_tokens: int) -> bool:
    from moetune.data import DataError, build_packs, data_options, load_tokenizer
    from moetune.data.cache import _looks_like_hub_name

    _section("data")
    tok_src = cfg.data.tokenizer or cfg.model.path
    if tok_src is not None and not os.path.exists(tok_src):
        print(f"tokenizer: {tok_src} does not exist (a placeholder?): skipping the data statistics and sample "
              "(pass --data.tokenizer DIR)")
        return True
    try:
        tokenizer = load_tokenizer(tok_src)
    except Exception as e:  # a directory without tokenizer files, a broken tokenizer.json
        print(f"tokenizer: cannot load {tok_src}: {e}")
        return False
    print(f"tokenizer: {tok_src or 'the embedded demo tokenizer'} ({len(tokenizer):,} tokens)")
    opts = data_options(cfg.data)
    print(f"masking: train_on {cfg.data.train_on}, train_reasoning {cfg.data.train_reasoning}, train_empty_think "
          f"{cfg.data.train_empty_think}; cache: {opts['cache_dir'] or 'off'}")
    with tempfile.TemporaryDirectory() as tmp:
        train_path, eval_path = cfg.data.train, cfg.data.eval
        if train_path is None:
            from moetune.assets.demo_data import write_demo_dataset

            write_demo_dataset(tmp, seed=cfg.run.seed)
            train_path, eval_path = os.path.join(tmp, "train.jsonl"), eval_path or os.path.join(tmp, "eval.jsonl")
            print("data.train is null: the embedded demo dataset")
        ok, first_pack = True, None
        for label, path in (("train", train_path), ("eval", eval_path)):
            if path is None:
                continue
            if not os.path.exists(path) and not _looks_like_hub_name(path):
                print(f"{label}: {path} does not exist (a placeholder?): skipped")
                continue
            try:
                packs, stats = build_packs(path, tokenizer, cfg.data.seq_len, **opts)
            except DataError as e:
                print(f"{label}: error: {e}")
                ok = False
                continue
            print(format_stats(label, path, stats, cfg, world_size))
            if label == "train":
                first_pack = packs[0]
        if first_pack is not None:
            _section("first packed sample (train)")
            print(render_pack(first_pack, tokenizer, color, max_tokens))
    return ok


def format_stats(label: str, path: str, s: dict, cfg, world_size: int) -> str:
    capacity = s["packs"] * cfg.data.seq_len
    lines = [f"{label}: {path} (cache: {s.get('cache', 'off')})",
             f"  documents kept {s['documents']:,}; dropped: {s['dropped_too_long']:,} longer than seq_len "
             f"{cfg.data.seq_len} (never truncated), {s['dropped_no_targets']:,} without a trained token, "
             f"{s.get('skipped_malformed', 0):,} malformed (data.skip_malformed)",
             f"  tokens {s['tokens']:,}, trained {s['targets']:,} ({100 * s['targets'] / max(s['tokens'], 1):.1f}%); "
             f"{s['packs']:,} packs of {cfg.data.seq_len}, padding {100 * (1 - s['tokens'] / max(capacity, 1)):.1f}%"]
    if label == "train":
        per_step = cfg.train.micro_batch_size * cfg.train.grad_accum * world_size
        # as PackedLoader: whole global micro-batches per epoch (the tail is dropped; too few packs repeat)
        batches = max(1, s["packs"] // (cfg.train.micro_batch_size * world_size))
        lines.append(f"  {per_step} packs per step at world size {world_size}: {batches / cfg.train.grad_accum:,.1f} "
                     f"steps per epoch; train.steps {cfg.train.steps:,} = "
                     f"{cfg.train.steps * cfg.train.grad_accum / batches:,.2f} epochs")
    return "\n".join(lines)


def render_pack(pack: dict, tokenizer, color: bool, max_tokens: int) -> str:
    """The pack as text, documents separated, trained tokens (those the loss is computed on) marked."""
    from moetune.data import IGNORE_INDEX

    ids, labels, pos = pack["input_ids"], pack["labels"], pack["position_ids"]
    # labels are pre-shifted: token t is trained when labels[t-1] (the prediction made at t-1) is not ignored
    trained = [False] + [lab != IGNORE_INDEX for lab in labels[:-1]]
    starts = [t for t in range(len(ids)) if pos[t] == 0] + [len(ids)]
    on, off = TRAINED_ANSI if color else TRAINED_PLAIN
    ctx_on, ctx_off = CONTEXT_ANSI if color else ("", "")
    legend = ("trained tokens in bold green, context dimmed" if color
              else "trained tokens (the loss is computed on them) are [[in double brackets]]")
    legend += "; a document's first token is never trained: nothing before it predicts it"
    out, shown = [f"({legend}; {len(starts) - 1} document(s) in {len(ids)} positions)"], 0
    for d, (a, b) in enumerate(zip(starts, starts[1:])):
        if not any(trained[a:b]) and all(i == ids[a] for i in ids[a:b]) and d == len(starts) - 2 and d > 0:
            out.append(f"--- padding: {b - a} tokens ---")
            break
        out.append(f"--- document {d + 1}: {b - a} tokens, {sum(trained[a:b])} trained ---")
        if shown >= max_tokens:
            out.append("(not shown: --sample-tokens reached)")
            continue
        end = min(b, a + max_tokens - shown)
        text, t = [], a
        while t < end:  # decode runs of equal trained-ness together, so multi-byte characters stay whole
            u = t
            while u < end and trained[u] == trained[t]:
                u += 1
            piece = tokenizer.decode(ids[t:u], skip_special_tokens=False)
            text.append(f"{on}{piece}{off}" if trained[t] else f"{ctx_on}{piece}{ctx_off}")
            t = u
        shown += end - a
        out.append("".join(text) + (f" … ({b - end} more tokens)" if end < b else ""))
    return "\n".join(out)
