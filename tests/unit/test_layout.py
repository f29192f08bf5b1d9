"""`parallel.layout: auto`: the layout chosen for (model, LoRA targets, world size, GPU memory), what the user set
kept as set (decided on the keys given, not on their values), and the errors when nothing can fit."""

import functools
from pathlib import Path

import pytest

from moetune.config import load_config
from moetune.errors import ConfigError
from moetune.parallel.estimate import FIT_FRACTION, build_meta_model, count_params
from moetune.parallel.layout import Layout, gpu_memory_gib, make_layout, memory_limit, pinned_fields, resolve_layout
from moetune.model.config import resolve_model_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
AIR, AIR_EXPERTS, GLM45, FLASH, GLM5 = (str(CONFIGS / f"{n}.yaml") for n in (
    "glm45-air-lora", "glm45-air-lora-experts", "glm45-lora", "glm47-flash-lora", "glm5-lora"))
AS_FLASH, AS_GLM5 = ["--model.config", "glm47-flash"], ["--model.config", "glm5"]
H200, H100 = 139.8, 79.1  # GiB, as torch.cuda reports them
TIGHT = 132.0  # a card on which Air's ep 2 without recompute (132.0 GiB estimated) does not fit (limit 125.4)


@functools.lru_cache(maxsize=None)
def _model(builtin, mode, targets):
    cfg = load_config(None, ["--model.config", builtin, "--finetune.mode", mode, "--lora.targets", targets])
    m = resolve_model_config(None, builtin, None)
    return m, count_params(build_meta_model(cfg, m))


def layout_for(path, world, gpu, *over, gpus_per_node=None):
    cfg = load_config(path, list(over))
    builtin = cfg.model.config if isinstance(cfg.model.config, str) else (
        "glm45-air" if path and "air" in path else "glm45" if path else "tiny")
    m, counts = _model(builtin, cfg.finetune.mode, "[" + ",".join(cfg.lora.targets) + "]")
    return resolve_layout(cfg, world, gpu, gpus_per_node=gpus_per_node, model_config=m, counts=counts)


def shape(layout: Layout):
    return (layout.ep, layout.dp_shard, layout.dp_replicate, layout.activation_checkpointing, layout.cpu_offload)


@pytest.mark.parametrize("path, over, world, gpu, want", [
    # the tiny demo on the CPU: no memory limit, so the first preference
    (None, [], 1, None, (1, 1, 1, "none", False)),
    (None, [], 2, None, (1, 1, 2, "none", False)),  # replicated: no all-gathers at all
    # GLM-4.5-Air LoRA q,k,v,o (compiled) on 2 x H200: ep 2 holds the rest of the model whole and half the experts,
    # 106 GiB of weights: 132.0 GiB without recompute, under 95 % of 139.8 (measured 132.1 GiB, 5,057 tokens/s per
    # GPU); on a 132 GiB card no layout fits without recompute, ep 2 with the attention of 30 layers recomputed does
    # (125.2)
    (AIR, [], 2, H200, (2, 1, 1, "none", False)),
    (AIR, [], 2, TIGHT, (2, 1, 1, (("attention", 30), ("none", 16)), False)),
    # eager: ep 2 without recompute does not fit; the attention of 9 layers recomputed 132.8
    (AIR, ["--train.compile", "false"], 2, H200, (2, 1, 1, (("attention", 9), ("none", 37)), False)),
    (AIR, [], 8, H200, (8, 1, 1, "none", False)),  # experts stay put, no FSDP: 63.6 GiB
    (AIR, [], 8, H100, (8, 1, 1, "none", False)),
    (AIR_EXPERTS, [], 8, H200, (8, 1, 1, "none", False)),  # 87.5 GiB
    # ep 2 + full: 125.3 (measured 122.4; the exchange keeps the ~2 rows a token sends, not its 8 pairs; the bad-step
    # copy of the 1.19 B LoRA parameters lives in host memory); ep 2 + attention 135.8 and FSDP + attention 148.8 do
    # not fit: ep 2 recomputes the attention of as many layers as fit (34, 132.7) and the other 12 whole
    (AIR_EXPERTS, [], 2, H200, (2, 1, 1, (("full", 12), ("attention", 34)), False)),
    # with LoRA on the experts on 8 x 80 GB ep 8 does not fit without recompute (78.0 GiB > 75.1: the exchange keeps
    # the rows received, not the expanded pairs), ep 4 × FSDP 2 does (65.5)
    (AIR_EXPERTS, [], 8, H100, (4, 2, 1, "none", False)),
    # full fine-tuning of Air on 8 x H200: 16 bytes per parameter do not fit on the GPUs, only with CPU offload
    # (131.9 GiB: 130.4 before the host shard each all-gather copies in was counted)
    (AIR, ["--finetune.mode", "full"], 8, H200, (1, 8, 1, "none", True)),
    # GLM-4.5 (355B), eager, 8 x H200: ep 8 holds 77 GiB of experts + the rest whole (too much even with the attention
    # recomputed); ep 4 × FSDP 2 with the attention of 67 of the 92 layers recomputed: 132.8 GiB
    (GLM45, [], 8, H200, (4, 2, 1, (("attention", 67), ("none", 25)), False)),
    (GLM45, [], 16, H200, (8, 2, 1, "none", False)),  # two nodes of 8: ep within the node, FSDP across: 111.9
    # GLM-4.7-Flash (MLA), its recipe: one H200 without recompute (74.9 GiB: 56 of weights; measured 74.89), and so
    # on an 80 GB card (75.1 under 95 %); LoRA on the experts too needs the attention of 42 layers recomputed there
    # (74.9: the experts keep the tokens for their LoRA, not the expanded rows; with those kept, full recompute of 7
    # layers); 8 GPUs replicate LoRA, and full fine-tuning goes expert parallel; on a 75 GiB card the attention of 17
    # layers is recomputed (71.1)
    (FLASH, AS_FLASH, 1, H200, (1, 1, 1, "none", False)),
    (FLASH, AS_FLASH, 1, H100, (1, 1, 1, "none", False)),
    (FLASH, AS_FLASH, 1, 75.0, (1, 1, 1, (("attention", 17), ("none", 30)), False)),
    (FLASH, AS_FLASH + ["--lora.targets", "[mla_all]"], 1, H100, (1, 1, 1, (("attention", 42), ("none", 5)), False)),
    (FLASH, AS_FLASH, 8, H200, (1, 1, 8, "none", False)),
    (FLASH, AS_FLASH + ["--finetune.mode", "full"], 8, H200, (8, 1, 1, "none", False)),
    # GLM-5 (MLA + DSA, 744B), its recipe: 4 nodes, ep 8 in the node × FSDP 4 with the attention of 32 of the 78
    # layers recomputed (132.4 GiB; its per-layer DSA mask is recomputed too); 8 nodes without recompute (132.8;
    # selective, 127.0 since it recomputes LoRA's B products (168.7 when it kept their full-width outputs), comes after
    # none); 2 nodes fit only with the weights offloaded to the host, the attention of 8 layers recomputed (132.5)
    (GLM5, AS_GLM5, 32, H200, (8, 4, 1, (("attention", 32), ("none", 46)), False)),
    (GLM5, AS_GLM5, 64, H200, (8, 8, 1, "none", False)),
    (GLM5, AS_GLM5, 16, H200, (1, 16, 1, (("attention", 8), ("none", 70)), True)),
])
def test_auto_layout_choices(path, over, world, gpu, want):
    layout = layout_for(path, world, gpu, *over, gpus_per_node=8 if world > 8 else None)
    assert shape(layout) == want, layout.describe()
    assert layout.auto and layout.world_size == world and (layout.memory and layout.memory.gib) == gpu
    assert gpu is None or layout.estimate_gib <= FIT_FRACTION * gpu
    assert any("chosen" in r for r in layout.reasons)


def test_reasons_give_the_estimate_of_each_layout_considered():
    layout = layout_for(AIR, 2, TIGHT)
    text = layout.describe()
    assert "layout (auto): expert parallel (ep 2; the rest replicated, no FSDP), activation checkpointing attention " \
           "on 30 layers, none on 16 layers" in text
    rejected = [r for r in layout.reasons if r.endswith("does not fit")]
    # replicated, ep 2 and FSDP without recompute, replicated with the attention recomputed
    assert len(rejected) == 4 and any(r.startswith("expert parallel (ep 2;") and "none" in r for r in rejected)
    assert "125.4 GiB (95%)" in text and "routed experts are 93% of the parameters" in text
    offload = layout_for(AIR, 8, H200, "--finetune.mode", "full")
    assert any("host memory" in r for r in offload.reasons)  # where the offloaded state goes, and how much


def test_candidates_try_light_modes_everywhere_then_attention_then_full_then_offload():
    from moetune.parallel.layout import _candidates

    structures = [("replicated", 1, 1), ("ep", 2, 1), ("fsdp", 1, 2)]
    order = [(ep, dp, ac, off) for ep, dp, ac, off in _candidates(structures, {}, compiled=False)]
    assert order == [(1, 1, "none", False), (1, 1, "selective", False), (2, 1, "none", False),
                     (2, 1, "selective", False), (1, 2, "none", False), (1, 2, "selective", False),
                     (1, 1, "attention", False), (2, 1, "attention", False), (1, 2, "attention", False),
                     (1, 1, "full", False), (2, 1, "full", False), (1, 2, "full", False),
                     (1, 2, "none", True), (1, 2, "selective", True), (1, 2, "attention", True), (1, 2, "full", True)]
    compiled = _candidates(structures, {}, compiled=True)
    assert [c for c in order if c[2] != "selective"] == compiled  # compiled layers recompute the element-wise ops
    assert _candidates(structures, {"activation_checkpointing": "attention"}, compiled=True) == [
        (1, 1, "attention", False), (2, 1, "attention", False), (1, 2, "attention", False), (1, 2, "attention", True)]


@pytest.mark.parametrize("path, over, world, ep, dp_shard", [
    (AIR, [], 2, 2, 1), (AIR_EXPERTS, [], 2, 2, 1), (AIR_EXPERTS, [], 2, 1, 2), (GLM45, [], 8, 4, 2),
    (FLASH, AS_FLASH + ["--lora.targets", "[mla_all]"], 1, 1, 1), (GLM5, AS_GLM5, 32, 8, 4)])
def test_attention_recompute_takes_less_than_none_and_more_than_full(path, over, world, ep, dp_shard):
    """The order of preference is one of memory too: each mode keeps less than the one before it."""
    gib = {ac: layout_for(path, world, None, *over, "--parallel.layout", "manual", "--parallel.ep", str(ep),
                          "--parallel.dp_shard", str(dp_shard), "--train.activation_checkpointing", ac).estimate_gib
           for ac in ("none", "attention", "full")}
    assert gib["none"] > gib["attention"] > gib["full"], gib


def test_a_split_is_the_most_attention_layers_that_fit_and_its_estimate_adds_up_the_layers():
    """Auto's per-layer split (ac_modes): between attention everywhere (does not fit) and full everywhere, the most
    layers with only their attention recomputed whose estimate fits; one more does not. A split's estimate is the
    sum of its layers': a split of 0 full layers is attention everywhere."""
    chosen = layout_for(AIR_EXPERTS, 2, H200)
    (_, n_full), (_, n_attn) = chosen.activation_checkpointing
    limit = FIT_FRACTION * H200

    def gib(ac):
        return layout_for(AIR_EXPERTS, 2, None, "--parallel.layout", "manual", "--parallel.ep", "2",
                          "--parallel.dp_shard", "1", "--train.activation_checkpointing", ac).estimate_gib

    assert gib("full") < chosen.estimate_gib <= limit < gib(f"{{full: {n_full - 1}, attention: {n_attn + 1}}}")
    assert gib("{full: 0, attention: 46}") == pytest.approx(gib("attention"))
    assert gib("{full: 46, attention: 0}") == pytest.approx(gib("full"))
    assert "activation checkpointing full on 12 layers, attention on 34 layers" in chosen.summary()


def test_only_as_many_layers_as_needed_recompute_their_attention():
    """Before recomputing the attention of every layer, auto recomputes it in the fewest layers that fit, the first
    ones ({attention: n, none: L - n}, Megatron's recompute_num_layers): GLM-4.7-Flash on a 75 GiB card. The estimate
    falls with every layer recomputed, from no recompute (n = 0) to attention everywhere (n = L), but for the first:
    what one layer's recompute frees, backward holds again while it recomputes that layer."""
    chosen = layout_for(FLASH, 1, 75.0, *AS_FLASH)
    (mode, n), (rest, n_none) = chosen.activation_checkpointing
    assert (mode, rest, n + n_none) == ("attention", "none", 47) and chosen.recompute[:n] == ("attention",) * n

    def gib(ac):
        return layout_for(FLASH, 1, None, *AS_FLASH, "--parallel.layout", "manual", "--parallel.ep", "1",
                          "--parallel.dp_shard", "1", "--train.activation_checkpointing", ac).estimate_gib

    series = [gib(f"{{attention: {i}, none: {47 - i}}}") for i in range(48)]
    assert series[0] == pytest.approx(series[1]) and all(a > b for a, b in zip(series[1:], series[2:])), series
    assert series[0] == pytest.approx(gib("none")) and series[-1] == pytest.approx(gib("attention"))
    assert series[n] == pytest.approx(chosen.estimate_gib) and series[n] <= FIT_FRACTION * 75.0 < series[n - 1]
    assert "activation checkpointing attention on 17 layers, none on 30 layers" in chosen.summary()


def test_a_split_written_in_the_config_is_kept_and_must_add_up_to_the_layers():
    kept = layout_for(AIR_EXPERTS, 2, H200, "--train.activation_checkpointing", "{full: 40, attention: 6}")
    assert shape(kept) == (2, 1, 1, (("full", 40), ("attention", 6)), False)
    assert "kept from the config: train.activation_checkpointing full on 40 layers, attention on 6 layers" in \
        kept.describe()
    with pytest.raises(ConfigError, match=r"train\.activation_checkpointing full on 40 layers, attention on 5 layers: "
                                          r"the numbers of layers must be ≥ 0 and add up to the model's 46 layers"):
        layout_for(AIR_EXPERTS, 2, H200, "--train.activation_checkpointing", "{full: 40, attention: 5}")
    with pytest.raises(ConfigError, match=r"train\.activation_checkpointing full on 1 layer: the numbers of layers "
                                          r"must be ≥ 0 and add up to the model's 46 layers"):
        layout_for(AIR_EXPERTS, 2, H200, "--train.activation_checkpointing", "{full: 1}")  # not "full" everywhere
    # a one-mode mapping that adds up is that mode on every layer
    assert shape(layout_for(AIR_EXPERTS, 2, H200, "--train.activation_checkpointing", "{full: 46}")) == (
        2, 1, 1, "full", False)


def test_expert_parallelism_stays_within_a_node():
    assert shape(layout_for(AIR, 16, H200, gpus_per_node=8)) == (8, 2, 1, "none", False)
    assert shape(layout_for(AIR, 16, H200, gpus_per_node=16)) == (16, 1, 1, "none", False)


def test_dense_dominated_models_are_not_given_expert_parallelism():
    """Experts under half of the parameters: FSDP, not EP, when replication does not fit."""
    from moetune.parallel.estimate import estimate_memory

    cfg = load_config(None, ["--data.seq_len", "8", "--train.micro_batch_size", "1"])
    dense = {**_tiny_dict(), "num_hidden_layers": 8, "first_k_dense_replace": 6, "intermediate_size": 2048}
    m = resolve_model_config(None, {**dense, "moe_intermediate_size": 4}, None)
    counts = count_params(build_meta_model(cfg, m))
    assert counts.experts < counts.total / 2
    replicated, fsdp = (estimate_memory(cfg, m, counts, make_layout(2, dp_shard=d, n_layers=8)).total_gib for d in (1, 2))
    assert fsdp < replicated
    gpu = (fsdp + replicated) / 2 / 0.9  # replication does not fit, sharding does
    layout = resolve_layout(cfg, 2, gpu, model_config=m, counts=counts)
    assert shape(layout) == (1, 2, 1, "none", False), layout.describe()
    assert "expert parallelism not considered" in layout.describe()
    # the same sizes with experts that dominate: expert parallelism
    m = resolve_model_config(None, {**dense, "first_k_dense_replace": 1, "moe_intermediate_size": 400}, None)
    counts = count_params(build_meta_model(cfg, m))
    replicated, ep2 = (estimate_memory(cfg, m, counts, make_layout(2, ep=e, n_layers=8)).total_gib for e in (1, 2))
    layout = resolve_layout(cfg, 2, (ep2 + replicated) / 2 / 0.9, model_config=m, counts=counts)
    assert shape(layout) == (2, 1, 1, "none", False), layout.describe()


def _tiny_dict():
    from moetune.model.config import BUILTIN

    return dict(BUILTIN["tiny"])


# ------------------------------------------------------------------------------------------ what the user set wins
def test_explicit_settings_win_even_when_equal_to_the_default():
    # ep 1 is the default value, but written by the user: no expert parallelism
    assert shape(layout_for(AIR, 8, H200, "--parallel.ep", "1")) == (1, 8, 1, "none", False)
    # no recompute, as the user says: the only layout left that fits is FSDP with CPU offload
    assert shape(layout_for(AIR, 2, TIGHT, "--train.activation_checkpointing", "none")) == (1, 2, 1, "none", True)
    assert shape(layout_for(AIR, 8, H200, "--parallel.ep", "2")) == (2, 4, 1, "none", False)
    assert shape(layout_for(AIR, 8, H200, "--parallel.dp_shard", "4")) == (1, 4, 2, "none", False)  # HSDP
    kept = layout_for(AIR, 8, H200, "--parallel.ep", "2").reasons
    assert "kept from the config: parallel.ep 2" in kept
    # attention recompute as the user says, though none would fit; where it does not fit, the offload fallback
    pinned = layout_for(AIR, 2, H200, "--train.activation_checkpointing", "attention")
    assert shape(pinned) == (2, 1, 1, "attention", False)
    assert "kept from the config: train.activation_checkpointing attention" in pinned.reasons
    offloaded = layout_for(AIR_EXPERTS, 2, H200, "--train.activation_checkpointing", "attention")
    assert shape(offloaded) == (1, 2, 1, "attention", True), offloaded.describe()


def test_settings_written_in_the_file_are_pinned_too(tmp_path):
    text = Path(AIR).read_text().replace("  layout: auto\n", "  layout: auto\n  ep: 1\n")
    (tmp_path / "air.yaml").write_text(text)
    cfg = load_config(tmp_path / "air.yaml")
    assert pinned_fields(cfg) == {"ep": 1}
    assert pinned_fields(load_config(AIR)) == {}
    assert shape(layout_for(str(tmp_path / "air.yaml"), 8, H200)) == (1, 8, 1, "none", False)


def test_manual_takes_the_config_as_written():
    layout = layout_for(AIR, 8, H200, "--parallel.layout", "manual")
    assert shape(layout) == (1, 8, 1, "none", False) and not layout.auto
    assert "parallel.layout: manual" in layout.reasons[0]
    # manual and over the memory: a warning, not a refusal (the user knows their machine)
    big = layout_for(AIR, 2, H200, "--parallel.layout", "manual")
    assert shape(big) == (1, 2, 1, "none", False) and any(r.startswith("warning:") for r in big.reasons)


# ------------------------------------------------------------------------------------------ what cannot be
@pytest.mark.parametrize("path, over, world, match", [
    (AIR, ["--finetune.mode", "full"], 2, r"nothing fits 2 GPU\(s\) of 139.8 GiB: the smallest estimate is .* GiB"),
    (AIR, ["--train.activation_checkpointing", "none", "--parallel.cpu_offload", "false"], 2,
     r"nothing fits .*kept from the config: parallel.cpu_offload false, train.activation_checkpointing none"),
    (AIR, ["--parallel.ep", "3"], 6, r"parallel.ep \(3\) must divide the number of routed experts \(128\)"),
    (AIR, ["--parallel.ep", "2"], 1, r"parallel.ep 2 needs several processes"),
    (AIR, ["--parallel.ep", "4"], 2, r"parallel.ep \(4\) must divide the world size \(2\)"),
    (AIR, ["--parallel.ep", "2", "--parallel.dp_shard", "2"], 8, r"parallel.dp_shard \(2\) × parallel.ep \(2\)"),
])
def test_impossible_layouts_are_config_errors(path, over, world, match):
    with pytest.raises(ConfigError, match=match):
        layout_for(path, world, TIGHT if "--parallel.cpu_offload" in over else H200, *over)


def test_the_layout_validates_itself_and_owns_the_mesh_and_fsdp():
    """One object says the shape: its sizes, its mesh's shape and names, whether FSDP shards, each layer's mode."""
    assert shape(make_layout(8, ep=2, n_layers=4)) == (2, 4, 1, "none", False)
    assert shape(make_layout(8, dp_shard=2, n_layers=4)) == (1, 2, 4, "none", False)
    with pytest.raises(ConfigError, match="dp_shard"):
        make_layout(8, ep=2, dp_shard=2, n_layers=4)  # EP does not replicate
    with pytest.raises(ConfigError, match="dp_shard"):
        Layout(8, 2, 2, 2, ("none",))  # constructed directly: the same check
    with pytest.raises(ConfigError, match=r"train\.activation_checkpointing some: unknown mode\(s\) \['some'\]"):
        make_layout(1, activation_checkpointing="some", n_layers=4)
    with pytest.raises(ConfigError, match=r"parallel.ep \(3\) must divide the number of routed experts \(8\)"):
        make_layout(6, ep=3, n_layers=4, n_experts=8)
    ep = make_layout(8, ep=2, activation_checkpointing={"full": 1, "attention": 3}, n_layers=4)
    assert ep.recompute == ("full", "attention", "attention", "attention")
    assert ep.activation_checkpointing == (("full", 1), ("attention", 3))
    assert (ep.mesh_shape, ep.mesh_dim_names, ep.fsdp, ep.shard_size) == ((4, 2), ("dp_shard", "ep"), True, 8)
    hsdp = make_layout(8, dp_shard=4, n_layers=4)
    assert (hsdp.mesh_shape, hsdp.mesh_dim_names, hsdp.fsdp) == ((2, 4), ("dp_replicate", "dp_shard"), True)
    replicated = make_layout(2, dp_shard=1, n_layers=4)
    assert (replicated.fsdp, replicated.shard_size, replicated.needs_process_group) == (False, 1, True)
    one = make_layout(1, n_layers=4)
    assert (one.fsdp, one.needs_process_group) == (False, False)
    offload = make_layout(1, cpu_offload=True, n_layers=4)  # one GPU with CPU offload: FSDP over a mesh of one
    assert (offload.fsdp, offload.needs_process_group, offload.mesh_shape) == (True, True, (1,))


def test_gpu_memory_from_the_config_else_torch_cuda(monkeypatch):
    import torch

    assert gpu_memory_gib(load_config(None, ["--parallel.gpu_memory_gib", "80"])) == 80
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_memory_gib(load_config(None)) is None  # no GPU here
    host = memory_limit(load_config(None))  # a CPU run is held to the machine's RAM, not to nothing
    assert host.host and 0 < host.gib < 1e5 and "host RAM" in host.what

    class Props:
        total_memory = 150_000_000_000

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props)
    assert gpu_memory_gib(load_config(None)) == pytest.approx(139.7, abs=0.05)
    with pytest.raises(ConfigError, match="gpu_memory_gib"):
        load_config(None, ["--parallel.gpu_memory_gib", "0"])


def test_a_stated_gpu_memory_caps_the_cuda_allocator(monkeypatch):
    """parallel.gpu_memory_gib below the device's memory holds the caching allocator to it when the run sets its
    device (an H200 run told 79.1 GiB runs out of memory where an 80 GB GPU would); the device's own memory, or a
    statement above it, sets no cap."""
    import torch

    from moetune.parallel.mesh import init_distributed

    class H200Props:
        total_memory = int(139.8 * 2**30)

    calls = []
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: H200Props)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device=None: calls.append((f, device)))
    for over, want in [(["--parallel.gpu_memory_gib", "79.1"], [(pytest.approx(79.1 / 139.8), torch.device("cuda", 0))]),
                       ([], []), (["--parallel.gpu_memory_gib", "200"], [])]:
        calls.clear()
        cfg = load_config(None, over)
        memory = memory_limit(cfg)
        assert memory.stated == bool(over)
        run = init_distributed(resolve_layout(cfg, 1, memory))
        assert run.device == torch.device("cuda", 0) and calls == want, over


# ------------------------------------------------------------------------------------------ bugs of issue 22
def test_a_cpu_run_is_held_to_the_machines_ram(monkeypatch, tmp_path):
    """A CPU run whose estimate is over the machine's RAM is refused before anything is built, naming the estimate
    and the limit (it used to take "no limit", start, and swell until the kernel killed it)."""
    import torch

    from moetune.parallel import layout as layout_module
    from moetune.train.loop import train

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(layout_module, "host_memory_gib", lambda: 0.01, raising=False)  # 10 MiB of RAM
    cfg = load_config(None, ["--run.output_dir", str(tmp_path / "runs"), "--run.name", "cpu", "--train.steps", "1"])
    with pytest.raises(ConfigError, match=r"nothing fits 1 process\(es\) in host RAM 0\.0 GiB \(a CPU run: no GPU\): "
                                          r"the smallest estimate is .* GiB per process .* over the limit 0\.0 GiB"):
        train(cfg)
    assert not (tmp_path / "runs" / "cpu").exists()  # refused before the run directory was made


def test_a_cpu_run_does_not_offload_to_the_host_it_runs_on():
    """On a GPU, full fine-tuning of Air on 8 x H200 fits only offloaded; on a CPU run the weights are in host memory
    already: offloading saves nothing, so nothing fits, and cpu_offload set true is refused."""
    from moetune.parallel.layout import MemoryLimit

    assert shape(layout_for(AIR, 8, H200, "--finetune.mode", "full"))[-1] is True
    host = MemoryLimit(H200, "host RAM", host=True)
    with pytest.raises(ConfigError, match="nothing fits 8 process"):
        layout_for(AIR, 8, host, "--finetune.mode", "full")
    with pytest.raises(ConfigError, match="parallel.cpu_offload true needs a GPU"):
        layout_for(AIR, 8, host, "--parallel.cpu_offload", "true")


@pytest.mark.parametrize("quantize", [None, "fp8"])
def test_cpu_offload_on_one_gpu_is_fsdp_over_a_mesh_of_one(quantize):
    """`parallel.cpu_offload: true` in one process: FSDP2 over a mesh of one carries the offload, bringing each unit's
    parameters to the compute device for its forward and backward. It used to be skipped without a process group, the
    parameters left in host memory, and on a GPU the first forward died (embedding weight on the CPU, ids on the
    GPU). Here on the CPU (no pinned memory): the parameters are FSDP's, and a step trains. An fp8 base stays fp8 in
    host memory, its scales fp32 (FSDP2 keeps each parameter's dtype; no param_dtype casts them)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from moetune.parallel.layout import MemoryLimit
    from moetune.parallel.mesh import init_distributed
    from moetune.train.setup import setup_model

    cfg = load_config(None, ["--parallel.cpu_offload", "true", "--model.dtype", "float32"]
                      + (["--model.quantize", quantize] if quantize else []))
    layout = resolve_layout(cfg, 1, MemoryLimit(80.0, "GPU memory"))  # as on one 80 GB GPU
    assert (layout.world_size, layout.cpu_offload, layout.fsdp) == (1, True, True)
    run = init_distributed(layout, device="cpu")
    try:
        assert run.mesh is not None and run.mesh.size() == 1
        model = setup_model(cfg, run, layout)
        assert isinstance(model, FSDPModule) and all(isinstance(p, DTensor) for p in model.parameters())
        dtypes = {p.to_local().dtype for p in model.parameters()}
        assert (torch.float8_e4m3fn in dtypes) == (quantize == "fp8")
        ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
        model(ids, None, labels=ids).backward()
        trained = [p for p in model.parameters() if p.requires_grad]
        assert trained and all(p.grad is not None and p.grad.device.type == "cpu" for p in trained)
    finally:
        dist.destroy_process_group()


def test_the_parallel_shape_has_one_owner():
    """parallel/ stands on the model and the base floor, never on what uses it (train, data, export, sync, the
    commands); process groups and meshes are made in parallel/ only (mesh.init_distributed, Layout.build_mesh)."""
    import moetune
    from test_layering import _graph

    allowed = ("moetune.parallel", "moetune.model", "moetune.errors", "moetune.names", "moetune.tensors")
    graph = _graph()
    assert "moetune.parallel.layout" in graph and "moetune.parallel.estimate" in graph["moetune.parallel.layout"]
    upward = {name: sorted(d for d in deps if not d.startswith(allowed))
              for name, deps in graph.items() if name.startswith("moetune.parallel")}
    assert {k: v for k, v in upward.items() if v} == {}
    src = Path(moetune.__file__).resolve().parent
    makers = sorted(str(f.relative_to(src)) for f in src.rglob("*.py")
                    if any(call in f.read_text() for call in ("init_device_mesh(", "init_process_group(")))
    assert makers == ["parallel/layout.py", "parallel/mesh.py"]


def test_one_gpu_offloads_what_it_cannot_hold():
    """Full fine-tuning of GLM-4.7-Flash (30B) on one H200: 16 bytes a parameter do not fit (228 GiB with full
    recompute); with the weights, gradients and optimizer state in host memory (FSDP2 over a mesh of one brings each
    layer in) and the attention of 44 layers recomputed, the rest whole, they do (132.8 GiB). Offload used to be
    considered on several GPUs only."""
    layout = layout_for(FLASH, 1, H200, *AS_FLASH, "--finetune.mode", "full")
    assert shape(layout) == (1, 1, 1, (("full", 3), ("attention", 44)), True), layout.describe()
    assert layout.fsdp and layout.needs_process_group and layout.estimate_gib <= FIT_FRACTION * H200


def test_the_glm5_fp8_recipe_fits_one_node_offloaded(capsys):
    """configs/glm5-lora-fp8.yaml as `moetune inspect` sees it (the fp8 base counted from the meta model): one node of 8
    H200s, FSDP over 8 with the fp8 shards in host memory (87.1 GiB per rank, ~116 as pinned) and 43 layers
    recomputed whole, the attention of the other 35 (131.5 GiB); without offload the smallest estimate on one node,
    FSDP over 8 with every layer recomputed, is 162 GiB. Two nodes still fit without offload (70 layers whole, the
    attention of 8). Until the fp8 base could be offloaded, the recipe needed the two nodes."""
    from moetune.cli import main

    recipe = str(CONFIGS / "glm5-lora-fp8.yaml")
    assert main(["inspect", recipe, "--world-size", "8", "--gpu-mem-gib", "139.8"]) == 0
    out = capsys.readouterr().out
    assert ("layout (auto): FSDP over 8 GPUs (dp_shard 8), activation checkpointing full on 43 layers, attention on 35 "
            "layers, cpu_offload true; estimated peak 131.54 GiB") in out
    assert ("FSDP over 8 GPUs (dp_shard 8), activation checkpointing full, cpu_offload false: 162.14 GiB — "
            "does not fit") in out
    assert "live in host memory, 87.1 GiB per rank (8 shards, fp8 as stored)" in out and "~115.9 GiB per rank" in out
    assert main(["inspect", recipe, "--world-size", "16", "--gpu-mem-gib", "139.8"]) == 0
    assert ("layout (auto): FSDP over 16 GPUs (dp_shard 16), activation checkpointing full on 70 layers, "
            "attention on 8 layers, cpu_offload false") in capsys.readouterr().out


def test_offload_must_fit_the_nodes_ram():
    """A GPU run knows its node's RAM (memory_limit: the share of each process the launcher starts there): what
    cpu_offload keeps in host memory, as pinned, must fit 95 % of it. GLM-5's fp8 base on one node of 8 needs ~116 GiB per rank:
    a node of 2 TiB holds it, one of 560 GiB (70 per rank) does not, and auto says so rather than choose it."""
    from moetune.parallel.layout import MemoryLimit

    recipe, over = str(CONFIGS / "glm5-lora-fp8.yaml"), ["--model.config", "glm5"]
    cfg = load_config(recipe, over)
    m = resolve_model_config(None, "glm5", None)
    counts = count_params(build_meta_model(cfg, m))

    def resolve(host_gib, *more):
        return resolve_layout(load_config(recipe, over + list(more)), 8,
                              MemoryLimit(H200, "GPU memory", host_gib=host_gib), model_config=m, counts=counts)

    assert resolve(2048 / 8).cpu_offload
    with pytest.raises(ConfigError, match=r"nothing fits 8 GPU\(s\) of 139.8 GiB and this node's RAM: FSDP over 8 GPUs "
                                          r"\(dp_shard 8\), activation checkpointing full, cpu_offload true fits the "
                                          r"GPU \(76.1 GiB\) but cpu_offload needs 115.9 GiB of host memory per "
                                          r"process, over 66.5 GiB \(95% of this node's RAM per process, 70.0 GiB\)"):
        resolve(560 / 8)
    # written by hand, it is taken with a warning
    manual = resolve(560 / 8, "--parallel.layout", "manual", "--parallel.cpu_offload", "true",
                     "--train.activation_checkpointing", "full")
    assert manual.cpu_offload
    assert any("warning: cpu_offload needs 115.9 GiB of host memory" in r for r in manual.reasons)


@pytest.mark.parametrize("accum, ep", [(1, 1), (2, 1), (1, 2)])
def test_lora_gradients_live_through_the_forward_only_when_micro_batches_accumulate(accum, ep):
    """zero_grad sets the adapter's gradients to None after each update: a step of one micro-batch starts its backward
    without them (the estimate counted them there until 2026-12: 4.4 GiB too much for expert LoRA of full-size Air on
    an fp8 base, whose layout auto then recomputed more than it needed); with grad_accum > 1 they exist while the
    later micro-batches run forward. The gradients are the fp32 adapter's size (4·P_lora, experts split by ep)."""
    over = ["--parallel.layout", "manual", "--parallel.ep", str(ep), "--parallel.dp_shard", "1",
            "--train.activation_checkpointing", "full", "--train.grad_accum", str(accum)]
    from moetune.parallel.estimate import estimate_memory

    layout = layout_for(AIR_EXPERTS, ep, None, *over)
    cfg = load_config(AIR_EXPERTS, over)
    m, counts = _model("glm45-air", "lora", "[" + ",".join(cfg.lora.targets) + "]")
    rows = {name: gib for name, gib, _ in estimate_memory(cfg, m, counts, layout).rows}
    p_lora = counts.lora - counts.experts_lora + counts.experts_lora / ep
    assert rows["gradients"] == pytest.approx(4 * p_lora / 2**30) == pytest.approx(rows["LoRA"])
    static = rows["weights"] + rows["LoRA"] + rows["optimizer"]
    forward = static + rows["activations"] + max(rows["logits / loss"], rows["backward working set"])
    end = static + rows["gradients"]  # the last layer's backward done
    want = forward + rows["gradients"] if accum > 1 else max(forward, end)
    assert layout.estimate_gib == pytest.approx(want, abs=1e-6)


def _fp8_layout(path, world, gpu, *over):
    from moetune.model.config import model_config_for

    cfg = load_config(path, [*AS_FLASH, "--model.quantize", "fp8", *over])
    m = model_config_for(cfg)
    counts = count_params(build_meta_model(cfg, m))
    return resolve_layout(cfg, world, gpu, model_config=m, counts=counts), cfg, m, counts


def test_fp8_transposed_copies_are_kept_where_the_layout_fits_with_them_and_fsdp_does_not_shard():
    """parallel.fp8_transposed_copies auto: GLM-4.7-Flash on an fp8 base keeps them on an H200 (their row: the
    row-scaled fp8 weights' bytes again) and not on a 72 GiB GPU, where they would not fit; never where FSDP shards
    the weights (a rank would copy its shard); `false` never, `true` under FSDP an error naming the key."""
    from moetune.parallel.estimate import estimate_memory

    h200, cfg, m, counts = _fp8_layout(FLASH, 1, H200)
    assert h200.fp8_copies and counts.fp8_copy_bytes > 20 * 2**30  # ~27 GiB of fp8 weights
    rows = {name: gib for name, gib, _ in estimate_memory(cfg, m, counts, h200).rows}
    assert rows["fp8 transposed copies"] == pytest.approx(counts.fp8_copy_bytes / 2**30)
    assert h200.estimate_gib <= FIT_FRACTION * H200 and "fp8 transposed copies kept" in h200.summary()
    assert any(r.startswith("fp8 transposed copies: kept") for r in h200.reasons)
    small, *_ = _fp8_layout(FLASH, 1, 72.0)  # fits under 68.4 GiB without them (47.6), not with them (74.9)
    assert not small.fp8_copies and small.recompute == h200.recompute and small.estimate_gib <= FIT_FRACTION * 72
    assert any(r.startswith("fp8 transposed copies: not kept") and "over 68.4" in r for r in small.reasons)
    off, *_ = _fp8_layout(FLASH, 1, H200, "--parallel.fp8_transposed_copies", "false")
    assert not off.fp8_copies and off.estimate_gib < h200.estimate_gib
    fsdp, *_ = _fp8_layout(FLASH, 2, H200, "--parallel.dp_shard", "2")
    assert fsdp.fsdp and not fsdp.fp8_copies
    with pytest.raises(ConfigError, match="parallel.fp8_transposed_copies true: FSDP shards"):
        _fp8_layout(FLASH, 2, H200, "--parallel.dp_shard", "2", "--parallel.fp8_transposed_copies", "true")
