"""Reading a configuration: the YAML file, the `--section.key value` overrides on top of it, and the one-line
messages (naming the dotted key, the file or the override, and a suggestion) that pydantic's errors become.

Precedence: built-in defaults (the tiny CPU demo) < YAML file < `--section.key value` overrides.
"""
from __future__ import annotations

import difflib
import re
from collections.abc import Hashable
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Optional, Sequence, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from moetune.config.schema import Config, _all_paths, _did_you_mean, _model_in, _section_class
from moetune.errors import ConfigError
from moetune.text import check_text, decode_utf8

def _initials(name: str) -> str:
    parts = name.split("_")
    return "".join(p[0] for p in parts if p) if len(parts) > 1 else ""


def _key_suggestion(bad: str) -> str:
    parent, _, leaf = bad.rpartition(".")
    if parent.endswith("]"):  # a key of a model inside a list (data.train[0].wieght): its siblings only
        cls: Optional[type[BaseModel]] = Config
        for name in re.sub(r"\[\d+\]", "", parent).split("."):
            field = cls.model_fields.get(name) if cls is not None else None
            cls = _model_in(field.annotation) if field is not None else None
        siblings = list(cls.model_fields) if cls is not None else []
        match = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
        return f" — did you mean {parent + '.' + match[0]!r}?" if match else (
            f" (allowed: {', '.join(siblings)})" if siblings else "")
    paths = _all_paths()
    # The right key in the wrong section ("optim.steps" -> "train.steps") beats a fuzzy sibling.
    moved = [p for p in paths if p.rpartition(".")[2] == leaf and p != bad]
    if moved:
        return " — did you mean " + " or ".join(repr(p) for p in moved) + "?"
    siblings = [p.rpartition(".")[2] for p in paths if p.rpartition(".")[0] == parent]
    # a spelled-out name of an abbreviated key or the reverse (learning_rate / lr), before the fuzzy match, which
    # finds min_lr_ratio closer to learning_rate than lr
    if short := [s for s in siblings if _initials(leaf) == s or _initials(s) == leaf]:
        return f" — did you mean {(parent + '.' if parent else '') + short[0]!r}?"
    if match := difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6):
        return f" — did you mean {(parent + '.' if parent else '') + match[0]!r}?"
    return _did_you_mean(bad, paths)


# --- YAML ------------------------------------------------------------------------------------

class _Loader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML silently keeps the last one)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # let SafeLoader report unhashable keys its own way
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


# YAML 1.1 reads `2e-4` (no dot) as a string; that would break floats inside an inline model.config.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def read_yaml(text: str, label: str, annotation: Any = Config) -> Any:
    """The one reader of user YAML (a config file, an override's value), guided by the schema's `annotation` for it.

    A scalar where the schema expects text, a number or a switch is passed on as the text as typed, for the field's
    own type to read: YAML 1.1 would read `off`/`yes` as booleans, `2024-01-01` as a date, `010` as 8, `0x10` as 16
    and `1:30` as 90, and a run name, a path or a step count typed that way must mean what it says. YAML still decides
    what is null (`null`, `~`), a list and a mapping; values the schema leaves open (an inline model.config) keep
    YAML's reading."""
    check_text(text, label, ConfigError)  # YAML's reader would refuse it with a traceback
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        return None if node is None else _construct(loader, node, annotation)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{label}:{mark.line + 1}:{mark.column + 1}" if mark else label
        raise ConfigError(f"{where}: YAML syntax error: {getattr(e, 'problem', None) or e}") from None
    finally:
        loader.dispose()


def _construct(loader: _Loader, node: yaml.Node, annotation: Any) -> Any:
    if annotation is Any:
        return loader.construct_object(node, deep=True)
    if isinstance(node, yaml.ScalarNode):
        value = loader.construct_object(node, deep=True)
        return node.value if value is not None and node.style is None and _reads_scalars(annotation) else value
    if isinstance(node, yaml.SequenceNode):
        return [_construct(loader, item, _item_annotation(annotation, i)) for i, item in enumerate(node.value)]
    loader.flatten_mapping(node)  # `<<: *anchor` merge keys
    out: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, Hashable):
            raise yaml.constructor.ConstructorError(None, None, "found an unhashable key", key_node.start_mark)
        if key in out:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        out[key] = _construct(loader, value_node, _key_annotation(annotation, key))
    return out


def _members(annotation: Any) -> list:
    """The types a field's annotation admits: Optional, Union and Annotated (tags, discriminators) unwrapped."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, UnionType):
        return [m for arg in get_args(annotation) for m in _members(arg)]
    return [annotation]


def _reads_scalars(annotation: Any) -> bool:
    """Whether the field reads a scalar itself (text, a number, a switch, one of some words; or a list of those,
    which takes one item alone)."""
    for m in _members(annotation):
        if m in (str, int, float, bool) or get_origin(m) is Literal:
            return True
        if get_origin(m) in (list, tuple) and any(_reads_scalars(a) for a in get_args(m) if a is not Ellipsis):
            return True
    return False


def _only_scalars(annotation: Any) -> bool:
    """A field that reads one scalar and never a list or a mapping (run.name, train.steps, model.path)."""
    return all(m in (str, int, float, bool, type(None)) or get_origin(m) is Literal for m in _members(annotation))


def read_override(raw: str, label: str, annotation: Any) -> Any:
    """An override's value. For a field that only reads a scalar, the text as typed: nothing of it is YAML syntax
    (`--run.name "exp #3"` keeps its `#3`, `--run.name "[a]"` is that name), except `null` where the field may be
    unset and quotes, which stay the way to say `'null'` itself. Other fields (lists, mappings) read YAML."""
    check_text(raw, label, ConfigError)
    if not _only_scalars(annotation):
        value = read_yaml(raw, label, annotation)
        return raw if isinstance(value, str) and _reads_scalars(annotation) and _plain(raw) else value
    if not _plain(raw):
        return read_yaml(raw, label, str)  # the quoted text
    if type(None) in _members(annotation) and read_yaml(raw, label, Any) is None:
        return None
    return raw


def _plain(raw: str) -> bool:
    """Not a quoted YAML scalar."""
    text = raw.strip()
    return not (len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"")


def _key_annotation(annotation: Any, key: Any) -> Any:
    for m in _members(annotation):
        if isinstance(m, type) and issubclass(m, BaseModel):
            return m.model_fields[key].annotation if key in m.model_fields else Any
        if get_origin(m) is dict:
            return get_args(m)[1]
    return Any


def _item_annotation(annotation: Any, index: int) -> Any:
    for m in _members(annotation):
        args = get_args(m)
        if get_origin(m) is list and args:
            return args[0]
        if get_origin(m) is tuple and args:
            return args[0] if args[-1] is Ellipsis else args[index] if index < len(args) else Any
    return Any


def _field_annotation(parts: Sequence[str]) -> Any:
    """The schema's annotation for a dotted key (Any for a key it does not know: that is reported on its own)."""
    annotation: Any = Config
    for name in parts:
        annotation = _key_annotation(annotation, name)
    return annotation


# --- command-line overrides ------------------------------------------------------------------

def _split_overrides(args: Sequence[str]) -> list[tuple[list[str], Any, str]]:
    """["--a.b", "1", "--c=2"] -> [(["a","b"], 1, "--a.b"), (["c"], 2, "--c=2")]."""
    out, args, i = [], list(args), 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key VALUE "
                              "or --section.key=VALUE")
        key, eq, raw = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ConfigError(f"missing value for {arg!r}")
            i += 1
            raw = args[i]
        i += 1
        parts = key.split(".")
        if not all(parts):
            raise ConfigError(f"malformed key in override {arg!r}")
        if not raw.strip():
            # YAML reads "" as null, which means "the default" (the demo's data, the tiny random model): an unset
            # shell variable ("--model.path $MODEL") must not silently train something else
            raise ConfigError(f"empty value for {arg!r} (an unset shell variable?); write null to mean none")
        out.append((parts, read_override(raw, f"value of override {arg!r}", _field_annotation(parts)), arg))
    return out


def _nest(parts: list[str], value: Any) -> dict:
    for p in reversed(parts):
        value = {p: value}
    return value


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_overrides(args: Sequence[str]) -> dict:
    """Turn `--a.b 1 --c=2` style arguments into a nested dict; values are parsed as YAML."""
    result: dict = {}
    for parts, value, _ in _split_overrides(args):
        result = _deep_merge(result, _nest(parts, value))
    return result


def _check_override_key(parts: list[str], arg: str) -> None:
    """Fail on an unknown override key with the full dotted path (pydantic would only name a prefix)."""
    cls: type[BaseModel] = Config
    for i, name in enumerate(parts):
        dotted = ".".join(parts[: i + 1])
        if name not in cls.model_fields:
            full = ".".join(parts)
            hint = (" — a config file is the first argument, before any --section.key VALUE (model.config is the "
                    "model's config.json)" if parts == ["config"] else _key_suggestion(full))
            raise ConfigError(f"unknown key {full!r} in command-line override {arg!r}{hint}")
        sub = _section_class(cls, name)
        if sub is None:
            # Only a mapping-valued field (model.config) may be addressed below itself.
            kinds = [getattr(a, "__origin__", a) for a in get_args(cls.model_fields[name].annotation)]
            if i < len(parts) - 1 and dict not in kinds:
                raise ConfigError(f"{dotted!r} is a value, not a section; cannot apply {arg!r}")
            return
        cls = sub


def _check_override_target(data: dict, parts: list[str], arg: str, label: str, overridden: dict[str, str]) -> None:
    """An override of a key inside a section (or inside model.config) that the file, or an earlier override, set
    to a value that is not a mapping: merging would silently replace that value, so its error would never be seen
    (`train: 5` in the file plus `--train.steps 2` used to train with the defaults)."""
    node: Any = data
    for i, name in enumerate(parts[:-1]):
        if not isinstance(node, dict) or name not in node or node[name] is None:
            return
        node = node[name]
        if not isinstance(node, dict):
            dotted = ".".join(parts[: i + 1])
            raise ConfigError(f"invalid value for {dotted!r} in {_source(dotted, label, overridden)}: expected a "
                              f"mapping of keys (got {repr(node)[:80]}), so {arg!r} cannot set a key inside it")


# --- loading and reporting -------------------------------------------------------------------

# what pydantic puts into an error's loc for a union member, besides field names: our tags and its type names
_UNION_TAGS = frozenset({"str", "list", "source", "auto", "int", "float", "bool", "dict", "none", "tuple"})


def _loc_to_path(loc: tuple, err_type: str) -> str:
    """pydantic loc -> dotted path, dropping union-member tags like 'str' / 'dict[str,any]'."""
    path, cls, keyed = "", Config, False
    for i, seg in enumerate(loc):
        if isinstance(seg, int):
            path += f"[{seg}]"
        elif keyed:  # a key of a mapping field (data.columns.output)
            path += f".{seg}"
            keyed = False
        elif cls is not None and seg in cls.model_fields:
            path += ("." if path else "") + seg
            members = _members(cls.model_fields[seg].annotation)
            keyed = dict in [get_origin(m) for m in members] and not any(m is str or get_origin(m) is list
                                                                         for m in members)
            cls = _section_class(cls, seg)
        elif (err_type == "extra_forbidden" and i == len(loc) - 1) or (
                cls is None and path.endswith("]") and re.fullmatch(r"[a-z_][a-z0-9_]*", str(seg))
                and seg not in _UNION_TAGS):
            path += ("." if path else "") + str(seg)  # a field of a model inside a list (data.train[0].weight)
    return path


def _override_for(path: str, overridden: dict[str, str]) -> Optional[str]:
    """The override that set `path` (or a section above or below it)."""
    for key, arg in overridden.items():
        if path == key or path.startswith((key + ".", key + "[")) or key.startswith(path + "."):
            return arg
    return None


def _source(path: str, label: str, overridden: dict[str, str]) -> str:
    """Blame the override that set `path`, else the file."""
    if not path:  # cross-field error: could come from either
        return f"{label} + command-line overrides" if overridden else label
    arg = _override_for(path, overridden)
    return f"command-line override {arg!r}" if arg else label


def _message(e: dict, path: str) -> str:
    """pydantic's message in the user's words: a section (or a data source) given something else than a mapping is
    said so with its keys, not as "a valid dictionary or instance of RunConfig" (a class name the user never saw)."""
    if e["type"] in ("model_type", "model_attributes_type", "dataclass_type"):
        cls = e.get("ctx", {}).get("class_name")
        model = next((m for m in _schema_models() if m.__name__ == cls), None)
        keys = f" ({', '.join(model.model_fields)})" if model is not None else ""
        return f"expected a mapping of keys{keys}"
    return e["msg"].removeprefix("Value error, ")


def _schema_models(cls: type[BaseModel] = Config) -> list[type[BaseModel]]:
    """Every pydantic model of the schema, sections and the models inside their fields (DataSource)."""
    out = [cls]
    for field in cls.model_fields.values():
        if (sub := _model_in(field.annotation)) is not None and sub not in out:
            out += [m for m in _schema_models(sub) if m not in out]
    return out


def _quote_hint(e: dict) -> str:
    """Text that YAML reads as no value, a list or a mapping: the field wants text, so say how to quote it."""
    if e["type"] != "string_type" or not isinstance(e["input"], (type(None), list, dict)):
        return ""
    kind = "no value (null)" if e["input"] is None else "a list" if isinstance(e["input"], list) else "a mapping"
    return f"; YAML read the value as {kind}: to mean the text, put it in quotes ('...')"


def _format_errors(err: ValidationError, label: str, overridden: dict[str, str]) -> str:
    lines = []
    for e in err.errors():
        path = _loc_to_path(e["loc"], e["type"])
        src = _source(path, label, overridden)
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key {path!r} in {src}{_key_suggestion(path)}")
            continue
        msg = _message(e, path)
        got = "" if e["type"] in ("value_error", "missing") else f" (got {repr(e['input'])[:80]})"
        lines.append(f"invalid value for {path!r} in {src}: {msg}{got}{_quote_hint(e)}" if path
                     else f"invalid config in {src}: {msg}")
    lines = list(dict.fromkeys(lines))  # union members can repeat the same complaint
    if len(lines) == 1:
        return lines[0]
    return f"{len(lines)} config errors:\n" + "\n".join("  " + line for line in lines)


def load_config(path: Optional[Union[str, Path]], overrides: Sequence[str] = ()) -> Config:
    """Load `path` (None -> the built-in tiny demo defaults), apply overrides, validate."""
    data: Any = {}
    label = "built-in defaults"
    if path is not None:
        label = str(path)
        try:
            text = decode_utf8(Path(path).read_bytes(), label, ConfigError)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e}") from None
        data = read_yaml(text, label)
        if data is None:
            # an empty file (or one all comments) would train the demo's defaults without a word
            raise ConfigError(f"{label}: the config file is empty (no sections); for the built-in demo give no "
                              "config file")
        if not isinstance(data, dict):
            raise ConfigError(f"{label}: the top level must be a mapping of sections, got {type(data).__name__}")
    overridden: dict[str, str] = {}
    for parts, value, arg in _split_overrides(overrides):
        _check_override_key(parts, arg)
        _check_override_target(data, parts, arg, label, overridden)
        data = _deep_merge(data, _nest(parts, value))
        overridden[".".join(parts)] = arg
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, label, overridden)) from None
