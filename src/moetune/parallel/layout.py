"""The parallel layout of a run — expert-parallel size, FSDP shard size, replicas, each layer's activation
checkpointing, CPU offload, the device mesh they make — resolved once, before the process group exists, and taken as
it is by everything after: init_distributed creates the process group and `Layout.build_mesh` its mesh, the model's
setup applies it (apply.parallelize), `moetune inspect` prints it, the memory estimate reads it. Nothing else decides
whether FSDP is on or which mode a layer recomputes.

`parallel.layout: auto` (the default) chooses from the memory estimate (estimate.py), the world size and the GPU's
memory, in this order of preference (what a torchtitan/Megatron user would pick by hand):

  1. one process: no parallelism;
  2. the model replicated on every GPU (dp_shard 1, no FSDP): no all-gathers, gradients all-reduced (LoRA: tiny);
  3. MoE models whose routed experts are most of the parameters: expert parallelism, the largest size first that
     divides the world size and the number of experts and stays within a node. With ep = world (dp_shard 1)
     nothing is FSDP-sharded: each GPU keeps the rest of the model whole and its 1/ep of the experts, no
     per-layer all-gathers, and the all-to-all stays on NVLink. Smaller sizes shard everything over the world
     with FSDP (dp_shard = world / ep): less memory, more communication; they come next.
  4. FSDP over all GPUs;
  each first without activation checkpointing, then with `selective` (not under torch.compile). Then every
  structure again with `attention` (the attention block's forward repeated in backward, the MLP/MoE activations
  kept: the middle ground), then with `full` (the whole layer; under EP a MoE layer's attention and expert work
  apart, model/recompute.split_modes) — each as the per-layer split (ac_modes) that recomputes the fewest layers
  that fit: {attention: n, none: L - n} (Megatron's recompute_num_layers: often only a few layers need recompute), then
  {full: n, attention: L - n}; recompute on a preferred structure is not assumed to beat a less preferred structure
  without it. CPU offload (FSDP; on one GPU FSDP over a
  mesh of one process) only when nothing else fits, its modes in the same order, for a bf16 or an fp8 base alike (an
  fp8 base's shards stay fp8 in host memory); on a GPU run what it keeps in host memory must also fit the node's RAM
  (MemoryLimit.host_gib). A layout fits when its estimate is under FIT_FRACTION (95 %) of the memory
  (`memory_limit`): `parallel.gpu_memory_gib` (or inspect's --gpu-mem-gib) when set, else torch.cuda's; a CPU run is
  held to the machine's RAM (or its cgroup's limit) shared by the processes on the node, and considers no CPU offload
  (its weights are already in host memory).

Whatever the user set — `parallel.ep`, `dp_shard`, `cpu_offload`, `train.activation_checkpointing` written in the
file or on the command line, whatever its value — is kept, and the rest is chosen around it (a dp_shard set without
ep means FSDP over that many GPUs and replicas of it, HSDP, as documented: no expert parallelism); `parallel.layout:
manual` takes all four as written (dp_shard -1: world / ep). When nothing fits, resolve_layout raises a ConfigError
that names the smallest estimate and what was kept.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace

from moetune.errors import ConfigError
from moetune.parallel.ac_modes import describe, layer_modes, normalize, runs
from moetune.parallel.estimate import FIT_FRACTION, build_meta_model, count_params, estimate_memory
from moetune.parallel.mesh import launch_gpus_per_node

PINNABLE = {"ep": ("parallel", "ep"), "dp_shard": ("parallel", "dp_shard"),
            "cpu_offload": ("parallel", "cpu_offload"),
            "activation_checkpointing": ("train", "activation_checkpointing")}


@dataclass(frozen=True)
class MemoryLimit:
    """The memory one process may use: a GPU's, or on a CPU run (host) its share of the machine's RAM."""

    gib: float
    what: str  # where the figure comes from, for the reasons and errors
    host: bool = False
    stated: bool = False  # the user's statement (parallel.gpu_memory_gib): the run's allocator is held to it (mesh.py)
    # a GPU run's share of this node's RAM (memory_limit): what a cpu_offload layout keeps in host memory must fit it
    # too. None (inspect, a GPU size given): not checked, the estimate's note says what offload needs
    host_gib: float | None = None

    def __str__(self) -> str:
        return f"{self.what}: {self.gib:.1f} GiB"


@dataclass(frozen=True)
class Layout:
    """A validated parallel shape: world_size = dp_replicate × dp_shard × ep (expert parallelism does not replicate),
    and each decoder layer's activation checkpointing (ac_modes.AC_MODES). Build it with make_layout or
    resolve_layout; it checks itself on construction, so a Layout that exists can be run."""

    world_size: int = 1
    ep: int = 1
    dp_shard: int = 1
    dp_replicate: int = 1
    recompute: tuple[str, ...] = ("none",)  # each decoder layer's mode (ac_modes.layer_modes)
    cpu_offload: bool = False
    n_experts: int = 0  # routed experts of the model (0: none): ep must divide them
    auto: bool = False  # chosen by `parallel.layout: auto` (some fields may still be the user's)
    memory: MemoryLimit | None = None  # the memory it was chosen for (None: no limit)
    estimate_gib: float | None = None  # estimated peak per process of this layout
    # an fp8 base's weights kept a second time, transposed, for the input gradient
    # (quant.modules.keep_transposed_copies)
    fp8_copies: bool = False
    reasons: list[str] = field(default_factory=list, compare=False)

    def __post_init__(self):
        world, ep, dp_shard, replicate = self.world_size, self.ep, self.dp_shard, self.dp_replicate
        if min(world, ep, dp_shard) < 1:
            raise ConfigError(f"layout: world size {world}, parallel.ep {ep} and parallel.dp_shard {dp_shard} must be "
                              "positive")
        if ep > 1 and world == 1:
            raise ConfigError(f"parallel.ep {ep} needs several processes: launch with torchrun")
        if world % ep:
            raise ConfigError(f"parallel.ep ({ep}) must divide the world size ({world})")
        if self.n_experts and ep > 1 and self.n_experts % ep:
            raise ConfigError(f"parallel.ep ({ep}) must divide the number of routed experts ({self.n_experts})")
        if replicate * dp_shard * ep != world or (replicate > 1 and ep > 1):
            raise ConfigError(f"parallel.dp_shard ({dp_shard}) × parallel.ep ({ep}) must equal the world size "
                              f"({world}), or, without expert parallelism, divide it (the rest replicates)")
        if not isinstance(self.recompute, tuple) or not self.recompute:
            raise TypeError(f"Layout.recompute is each decoder layer's mode, got {self.recompute!r} (make_layout "
                            "spreads a setting over the layers)")
        layer_modes(self.recompute, len(self.recompute))  # known modes (the layers' number came from the model)
        if self.fp8_copies and self.fsdp:
            raise ConfigError("parallel.fp8_transposed_copies true: FSDP shards the weights here (dp_shard "
                              f"{dp_shard}, cpu_offload {str(self.cpu_offload).lower()}), and a rank would copy its "
                              "shard, not the weight it computes with; set it to auto or false")

    # ---- what the shape means
    @property
    def fsdp(self) -> bool:
        """Whether FSDP2 shards the model: over dp_shard > 1 ranks, or to carry CPU offload (a shard group of one
        process too). Without it every rank holds the whole model (the routed experts still split by expert under
        EP): no per-layer all-gathers, one all-reduce of the gradients per step (grads.sync_replicated_grads)."""
        return self.dp_shard > 1 or self.cpu_offload

    @property
    def allows_cuda_graphs(self) -> bool:
        """Whether a compiled layer may replay as a CUDA graph: not under FSDP2, which swaps parameter storage in and
        out around each layer. Under expert parallelism the exchange (data-dependent sizes, a host copy) is a graph
        break: the compiled parts before and after it replay as graphs, the exchange runs eagerly between them."""
        return not self.fsdp

    @property
    def shard_size(self) -> int:
        """Ranks over which FSDP shards the parameters that are not routed experts (1 without FSDP)."""
        return self.dp_shard * self.ep if self.fsdp else 1

    @property
    def activation_checkpointing(self):
        """The per-layer modes as a setting: one mode, or ((mode, layers), ...) in layer order."""
        return runs(self.recompute)

    @property
    def needs_process_group(self) -> bool:
        """Several processes, or FSDP in one (CPU offload on one GPU: FSDP2 needs a mesh, of one)."""
        return self.world_size > 1 or self.fsdp

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """("dp_replicate", "dp_shard") for HSDP, ("dp_shard", "ep") under expert parallelism (with "dp", the two
        flattened: FSDP of everything but the routed experts), else ("dp_shard",)."""
        if self.dp_replicate > 1:
            return ("dp_replicate", "dp_shard")
        return ("dp_shard", "ep") if self.ep > 1 else ("dp_shard",)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        if self.dp_replicate > 1:
            return (self.dp_replicate, self.dp_shard)
        return (self.dp_shard, self.ep) if self.ep > 1 else (self.world_size,)

    def build_mesh(self, device_type: str):
        """The DeviceMesh of this layout over the default process group (init_distributed creates it)."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=self.mesh_dim_names)
        if self.ep > 1:
            mesh._flatten("dp")
        return mesh

    # ---- how it is told
    @property
    def kind(self) -> str:
        if self.world_size == 1:
            return "one process"
        if self.ep > 1 and self.dp_shard == 1:
            return f"expert parallel (ep {self.ep}; the rest replicated, no FSDP)"
        if self.ep > 1:
            return f"expert parallel (ep {self.ep} × FSDP dp_shard {self.dp_shard})"
        if self.dp_shard == 1:
            return f"replicated on {self.world_size} GPUs (dp_shard 1, no FSDP)"
        if self.dp_replicate > 1:
            return f"HSDP (FSDP dp_shard {self.dp_shard} × {self.dp_replicate} replicas)"
        return f"FSDP over {self.world_size} GPUs (dp_shard {self.dp_shard})"

    def settings(self) -> str:
        return (f"{self.kind}, activation checkpointing {describe(self.activation_checkpointing)}, cpu_offload "
                f"{str(self.cpu_offload).lower()}" + (", fp8 transposed copies kept" if self.fp8_copies else ""))

    def summary(self) -> str:
        per = "process" if self.memory is not None and self.memory.host else "GPU"
        est = f"; estimated peak {self.estimate_gib:.2f} GiB per {per}" if self.estimate_gib is not None else ""
        mem = f" of {self.memory.gib:.1f}" if self.memory is not None and est else ""
        return f"layout ({'auto' if self.auto else 'manual'}): {self.settings()}{est}{mem}"

    def describe(self) -> str:
        return "\n".join([self.summary()] + [f"  {r}" for r in self.reasons])


def make_layout(world_size: int, ep: int = 1, dp_shard: int = -1, activation_checkpointing="none",
                cpu_offload: bool = False, *, n_layers: int, n_experts: int = 0, **kw) -> Layout:
    """A layout from explicit values: dp_shard -1 means world / ep, the ranks dp_shard × ep leave over replicate
    (HSDP), the activation checkpointing setting is spread over the model's `n_layers` layers."""
    if dp_shard < 1 and dp_shard != -1:
        raise ConfigError(f"parallel.dp_shard {dp_shard} must be positive (or -1: world / ep)")
    if dp_shard == -1:
        dp_shard = max(world_size // max(ep, 1), 1)
    replicate = world_size // (dp_shard * ep) if dp_shard * ep <= world_size and ep >= 1 else 0
    return Layout(world_size, ep, dp_shard, replicate, layer_modes(activation_checkpointing, n_layers), cpu_offload,
                  n_experts, **kw)


# ------------------------------------------------------------------------------------------------ memory
def host_memory_gib() -> float:
    """This machine's RAM, or the cgroup's limit when smaller (a container's memory.max)."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                value = f.read().strip()
        except OSError:
            continue
        if value.isdigit():
            total = min(total, int(value))
    return total / 2**30


def gpu_memory_gib(cfg, local_rank: int | None = None) -> float | None:
    """`parallel.gpu_memory_gib` when set, else the memory torch.cuda reports for this rank's GPU, else None (no
    GPU)."""
    if cfg.parallel.gpu_memory_gib is not None:
        return cfg.parallel.gpu_memory_gib
    import torch

    if not torch.cuda.is_available():
        return None
    index = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
    return torch.cuda.get_device_properties(index % torch.cuda.device_count()).total_memory / 2**30


def memory_limit(cfg, local_rank: int | None = None) -> MemoryLimit:
    """What one process of this run may use: its GPU's memory (gpu_memory_gib), or on a CPU run the machine's RAM
    divided among the processes the launcher starts on this node."""
    gpu = gpu_memory_gib(cfg, local_rank)
    ram, procs = host_memory_gib(), launch_gpus_per_node() or 1
    if gpu is not None:
        stated = cfg.parallel.gpu_memory_gib is not None
        return MemoryLimit(gpu, "parallel.gpu_memory_gib" if stated else "GPU memory", stated=stated,
                           host_gib=ram / procs)
    share = f" shared by {procs} processes" if procs > 1 else ""
    return MemoryLimit(ram / procs, f"host RAM {ram:.1f} GiB{share} (a CPU run: no GPU)", host=True)


# ------------------------------------------------------------------------------------------------ choice
def pinned_fields(cfg) -> dict[str, object]:
    """The layout fields the user set (file or command line), by Layout field name; all of them when manual."""
    out = {}
    for name, (section, key) in PINNABLE.items():
        sec = getattr(cfg, section)
        if cfg.parallel.layout == "manual" or key in sec.model_fields_set:
            value = getattr(sec, key)
            out[name] = normalize(value) if name == "activation_checkpointing" else value
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _structures(world: int, n_experts: int, experts_dominate: bool, gpus_per_node: int, pinned: dict):
    """(ep, dp_shard) in order of preference: replicated, expert parallel (within a node first, largest first),
    FSDP, then HSDP (only when the user set dp_shard)."""
    if world == 1:
        return [("one", 1, 1)]
    eps = [d for d in _divisors(math.gcd(world, n_experts or 1)) if d > 1]
    eps = sorted((d for d in eps if d <= gpus_per_node), reverse=True) + [d for d in eps if d > gpus_per_node]
    out = [("replicated", 1, 1)]
    hsdp_meant = pinned.get("dp_shard", -1) != -1 and "ep" not in pinned  # README: smaller dp_shard = HSDP
    if (experts_dominate and not hsdp_meant) or pinned.get("ep", 1) > 1:
        out += [("ep", d, world // d) for d in eps]
    out.append(("fsdp", 1, world))
    out += [("hsdp", 1, d) for d in _divisors(world)[1:-1]]
    dp_pin = pinned.get("dp_shard")
    ok = [s for s in out if pinned.get("ep", s[1]) == s[1]
          and (dp_pin == s[2] or (dp_pin == -1 and s[2] * s[1] == world) or (dp_pin is None and s[0] != "hsdp"))]
    return ok


def _candidates(structures, pinned: dict, compiled: bool):
    """(ep, dp_shard, activation checkpointing, cpu_offload) in order of preference: the light modes (none, then
    selective) on every structure, then `attention` on every structure, then `full`; CPU offload last. Under
    torch.compile selective checkpointing is not considered: compiled layers already recompute the element-wise
    ops, and on AIR-8 selective took more memory (42.1 vs 39.2 GiB) and 35 % more time (BENCHMARKS.md)."""
    def ok(ac, off):
        return pinned.get("activation_checkpointing", ac) == ac and pinned.get("cpu_offload", off) == off

    pin = pinned.get("activation_checkpointing")
    light = ("none",) if compiled and pin != "selective" else ("none", "selective")
    heavy = ("attention", "full") if pin is None or isinstance(pin, str) else (pin,)  # a per-layer split as written
    out = [(s, ac, False) for s in structures for ac in light]  # by structure first, none before selective
    out += [(s, ac, False) for ac in heavy for s in structures]
    # offload is FSDP's (over the world; in one process over a mesh of one: how one GPU trains what it cannot hold)
    offload = [s for s in structures if s[0] in ("fsdp", "one")] if "cpu_offload" not in pinned else structures
    out += [(s, ac, True) for s in offload for ac in light + heavy]
    return [(s[1], s[2], ac, off) for s, ac, off in out if ok(ac, off)]


def resolve_layout(cfg, world_size: int, memory: MemoryLimit | float | None = None, *,
                   gpus_per_node: int | None = None, model_config=None, counts=None) -> Layout:
    """The layout `cfg` runs with on `world_size` processes, each held to `memory` (a MemoryLimit, a GPU of that many
    GiB, or None: no limit, the first preference). `model_config` and `counts` (estimate.count_params) are built from
    cfg when not given."""
    if model_config is None:
        from moetune.model.config import model_config_for

        model_config = model_config_for(cfg)
    if counts is None:
        counts = count_params(build_meta_model(cfg, model_config))
    if isinstance(memory, (int, float)):
        memory = MemoryLimit(float(memory), "GPU memory")
    n_experts, n_layers = model_config.n_routed_experts or 0, model_config.num_hidden_layers
    pinned = pinned_fields(cfg)
    if "activation_checkpointing" in pinned:
        layer_modes(pinned["activation_checkpointing"], n_layers)  # a split must add up to the model's layers
    host = memory is not None and memory.host
    if host and pinned.get("cpu_offload"):
        raise ConfigError("parallel.cpu_offload true needs a GPU: on a CPU run the weights already live in host "
                          "memory (set it to false)")
    limit = FIT_FRACTION * memory.gib if memory is not None else None
    common = dict(n_layers=n_layers, n_experts=n_experts, memory=memory)

    # what cpu_offload keeps in host memory must fit this node's RAM too, where the run knows it (memory_limit)
    host_limit = FIT_FRACTION * memory.host_gib if memory is not None and memory.host_gib is not None else None

    def estimate(layout):
        return estimate_memory(cfg, model_config, counts, layout)

    def over_host(e) -> bool:
        return host_limit is not None and e.host_gib > host_limit  # host_gib is 0 without offload

    def fits(e):
        return (limit is None or e.total_gib <= limit) and not over_host(e)  # False for NaN

    def host_line(e) -> str:
        return (f"cpu_offload needs {e.host_gib:.1f} GiB of host memory per process, over {host_limit:.1f} GiB "
                f"({FIT_FRACTION:.0%} of this node's RAM per process, {memory.host_gib:.1f} GiB)")

    def with_copies(layout, e, reasons):
        """`layout` with the fp8 weights' transposed copies where parallel.fp8_transposed_copies asks for them: true
        always (an error under FSDP), auto where FSDP does not shard the weights and the estimate with the copies
        fits — after the layout is chosen, so they never cost a layer's recompute."""
        want = cfg.parallel.fp8_transposed_copies
        # on a CPU run the fp8 weights are dequantised just in time (no fp8 GEMM reads a copy)
        if not counts.fp8_copy_bytes or want is False or (host and want == "auto"):
            return layout, e
        if layout.fsdp and want == "auto":
            reasons.append("fp8 transposed copies: not kept (FSDP shards the weights)")
            return layout, e
        trial = replace(layout, fp8_copies=True)
        et = estimate(trial)
        if want is True or fits(et):
            reasons.append(f"fp8 transposed copies: kept ({et.total_gib:.2f} GiB with them, {e.total_gib:.2f} "
                           "without)" + ("" if fits(et) else f"; warning: over {limit:.1f} GiB, the run may run "
                                         "out of memory"))
            return trial, et
        reasons.append(f"fp8 transposed copies: not kept ({et.total_gib:.2f} GiB with them, over {limit:.1f})")
        return layout, e

    if len(pinned) == len(PINNABLE):
        layout = make_layout(world_size, pinned["ep"], pinned["dp_shard"], pinned["activation_checkpointing"],
                             pinned["cpu_offload"], auto=False, **common)
        e = estimate(layout)
        why = ("parallel.layout: manual: ep, dp_shard, cpu_offload and activation checkpointing as written"
               if cfg.parallel.layout == "manual" else "every layout key is set in the config: taken as written")
        reasons = [why, _limit_line(memory, limit)]
        if limit is not None and not e.total_gib <= limit:
            reasons.append(f"warning: the estimate {e.total_gib:.1f} GiB is over {limit:.1f} GiB: the run may run out "
                           "of memory (parallel.layout: auto would choose a layout that fits)")
        if over_host(e):
            reasons.append(f"warning: {host_line(e)}: the run may run out of host memory")
        layout, e = with_copies(layout, e, reasons)
        return replace(layout, estimate_gib=e.total_gib, reasons=reasons)

    if "ep" in pinned or "dp_shard" in pinned:  # a pinned value no layout can use: say which, not "nothing fits"
        make_layout(world_size, pinned.get("ep", 1), pinned.get("dp_shard", -1), **common)
    experts_share = counts.experts / counts.total if counts.total else 0.0
    structures = _structures(world_size, n_experts, experts_share > 0.5,
                             gpus_per_node or launch_gpus_per_node() or min(world_size, 8), pinned)
    # a CPU run's weights are in host memory already: offloading them saves nothing there
    candidates = [c for c in _candidates(structures, pinned, cfg.train.compile) if not (host and c[3])]
    kept = ", ".join(f"{'.'.join(PINNABLE[k])} {describe(v) if k == 'activation_checkpointing' else _show(v)}"
                     for k, v in pinned.items())
    if not candidates:
        raise ConfigError(f"no layout for {world_size} process(es) is compatible with what the config sets: {kept}")
    tried = []

    def split(ep, dp_shard, offload, ac):
        """The layout of this structure that recomputes the fewest layers that fit, as a per-layer split (ac_modes);
        None if none fits. At `attention`: {attention: n, none: L - n} (Megatron's recompute_num_layers: where only a
        few layers need recompute, the others run without); at `full`: {full: n, attention: L - n}. Asked for at a
        structure's mode, which unless the mode is pinned comes after the lighter one on that structure
        (_candidates), so the lighter mode everywhere was tried there and did not fit; the heavier everywhere is the
        candidate itself. The estimate falls as n grows, so the smallest n that fits is found by bisection."""
        if "activation_checkpointing" in pinned or limit is None:
            return None
        lighter = {"attention": "none", "full": "attention"}[ac]
        best, lo, hi = None, 1, n_layers - 1  # layers in the heavier mode
        while lo <= hi:
            n = (lo + hi) // 2
            layout = make_layout(world_size, ep, dp_shard, {ac: n, lighter: n_layers - n}, offload, auto=True,
                                 **common)
            e = estimate(layout)
            if fits(e):
                best, hi = (layout, e), n - 1
            else:
                lo = n + 1
        return best

    for ep, dp_shard, ac, offload in candidates:
        found = split(ep, dp_shard, offload, ac) if ac in ("attention", "full") else None
        layout, e = found or (make_layout(world_size, ep, dp_shard, ac, offload, auto=True, **common), None)
        e = estimate(layout) if e is None else e
        tried.append((layout, e))
        if fits(e):
            break
    else:
        where = (f"{world_size} process(es) in {memory.what}" if host else
                 f"{world_size} GPU(s) of {memory.gib:.1f} GiB")
        gpu_fits = [(t, x) for t, x in tried if x.total_gib <= limit]  # offloaded, and over this node's RAM
        if gpu_fits:
            best, e = min(gpu_fits, key=lambda t: t[1].host_gib)
            raise ConfigError(
                f"parallel.layout auto: nothing fits {where} and this node's RAM: {best.settings()} fits the GPU "
                f"({e.total_gib:.1f} GiB) but {host_line(e)}" + (f"; kept from the config: {kept}" if kept else "")
                + "; use more GPUs or nodes (each rank then holds a smaller shard), or nodes with more RAM")
        best, e = min(tried, key=lambda t: t[1].total_gib)
        raise ConfigError(
            f"parallel.layout auto: nothing fits {where}: the smallest estimate is {e.total_gib:.1f} GiB per "
            f"{'process' if host else 'GPU'} ({best.settings()}) over the limit {limit:.1f} GiB ({FIT_FRACTION:.0%})"
            + (f"; kept from the config: {kept}" if kept else "")
            + ("; use a GPU, a smaller model or data.seq_len or train.micro_batch_size" if host else
               "; use more GPUs, a smaller data.seq_len or train.micro_batch_size, or LoRA"))
    reasons = [_limit_line(memory, limit)]
    if kept:
        reasons.append(f"kept from the config: {kept}")
    if world_size > 1 and n_experts:
        reasons.append(f"routed experts are {experts_share:.0%} of the parameters"
                       + ("" if experts_share > 0.5 else ": expert parallelism not considered"))
    for t, x in tried:
        host_note = f" ({host_line(x)})" if over_host(x) else ""
        verdict = "chosen" if t is layout else "does not fit"
        reasons.append(f"{t.settings()}: {x.total_gib:.2f} GiB{host_note} — {verdict}")
    layout, e = with_copies(layout, e, reasons)
    reasons += e.notes
    return replace(layout, estimate_gib=e.total_gib, reasons=reasons)


def _show(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def _limit_line(memory: MemoryLimit | None, limit) -> str:
    if memory is None:
        return "no memory limit given: the first preference is taken"
    return f"{memory}: a layout fits when its estimate is under {limit:.1f} GiB ({FIT_FRACTION:.0%})"
