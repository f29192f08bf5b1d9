"""Activation checkpointing modes (`train.activation_checkpointing`): their names, and which mode each decoder layer
takes. No torch here: the config, the layout and the memory estimate read it before anything is built.

A setting is one mode for every layer, or {mode: number of layers}: the modes go to the layers in the order written,
the first layers first (Megatron's "block" method: {full: 16, attention: 30} recomputes layers 0-15 whole and only
the attention of the other 30). `parallel.layout: auto` writes such a split when recomputing only the attention of
every layer does not fit and recomputing every layer whole would leave memory unused. The memory peak (the start of
backward) holds what every layer saved, so only the numbers matter, not which layers."""

from __future__ import annotations

from moetune.errors import ConfigError

AC_MODES = ("none", "attention", "selective", "full")  # what a layer recomputes: model/recompute.py


def check_setting(spec) -> None:
    """ValueError unless `spec` is a mode or {mode: layers ≥ 0} (the config's check; the layers' sum needs the
    model: layer_modes)."""
    if isinstance(spec, str) and spec in AC_MODES:
        return
    if isinstance(spec, dict) and spec and all(m in AC_MODES and type(n) is int and n >= 0 for m, n in spec.items()):
        return
    modes = ", ".join(f"'{m}'" for m in AC_MODES[:-1]) + f" or '{AC_MODES[-1]}'"
    raise ValueError(f"got {spec!r}: expected {modes}, or {{mode: number of layers ≥ 0}} such as "
                     "{full: 16, attention: 30}")


def normalize(spec):
    """A setting as the layout keeps it: a mode name, or ((mode, layers), ...) in the order written (hashable; a
    mapping of one mode stays a mapping: its number of layers is checked against the model's)."""
    if isinstance(spec, str):
        return spec
    return tuple((str(mode), int(n)) for mode, n in dict(spec).items())


def layer_modes(spec, n_layers: int) -> tuple[str, ...]:
    """Each of `n_layers` decoder layers' mode, from a setting (a mode, {mode: layers} or its normalized pairs) or an
    already per-layer sequence of modes; a ConfigError naming the key when it does not fit the model. The one reader
    of a setting: the layout keeps its result (Layout.recompute), and everything after reads that."""
    if isinstance(spec, (list, tuple)) and all(isinstance(x, str) for x in spec):
        pairs = {}
        modes = list(spec)
    else:
        pairs = {spec: n_layers} if isinstance(spec, str) else dict(spec)
        modes = [mode for mode, n in pairs.items() for _ in range(max(n, 0))]
    unknown = sorted((set(pairs) | set(modes)) - set(AC_MODES))
    if unknown or len(modes) != n_layers or any(n < 0 for n in pairs.values()):
        raise ConfigError(f"train.activation_checkpointing {describe(spec)}: "
                          + (f"unknown mode(s) {unknown}, choose from {list(AC_MODES)}" if unknown else
                             f"the numbers of layers must be ≥ 0 and add up to the model's {n_layers} layers"))
    return tuple(modes)


def runs(modes) -> str | tuple[tuple[str, int], ...]:
    """Per-layer modes written back as a setting: one mode, or its runs ((mode, layers), ...) in layer order."""
    out: list[list] = []
    for mode in modes:
        if out and out[-1][0] == mode:
            out[-1][1] += 1
        else:
            out.append([mode, 1])
    return out[0][0] if len(out) == 1 else tuple((m, n) for m, n in out)


def describe(spec) -> str:
    """'full', or 'full on 16 layers, attention on 30'."""
    if isinstance(spec, str):
        return spec
    if isinstance(spec, (list, tuple)) and all(isinstance(x, str) for x in spec):
        spec = runs(spec) if spec else ()
        if isinstance(spec, str):
            return spec
    return ", ".join(f"{mode} on {n} layer{'s' if n != 1 else ''}" for mode, n in dict(spec).items())
