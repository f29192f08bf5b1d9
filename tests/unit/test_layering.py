"""The house stands on a floor: no import cycle among moetune's modules, and export/ reads checkpoints and
adapters through the floor (run_dir.py, model/) rather than reaching into train/."""

import ast
from pathlib import Path

import moetune

SRC = Path(moetune.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    out = {}
    for f in SRC.rglob("*.py"):
        parts = ("moetune",) + f.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _imports(name: str, path: Path, modules: dict) -> set[str]:
    """The moetune modules `name` imports, at the top or inside functions (both run at some point)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports pkg.mod; `from mod import name` imports mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def _graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_imports():
    # the premise of the next tests: the parser finds known edges (top-level, nested and relative imports)
    g = _graph()
    assert "moetune.errors" in g["moetune.config"]
    assert "moetune.export.verify" in g["moetune.export.adapter"]
    assert "moetune.data.formats" in g["moetune.data.chat"]
    assert "moetune.train.checkpoint" in g["moetune.train.trainer"]


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_cycle_detection_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_export_imports_nothing_from_train():
    g = _graph()
    bad = {m: sorted(t for t in deps if t.startswith("moetune.train"))
           for m, deps in g.items() if m.startswith("moetune.export")}
    assert {m: d for m, d in bad.items() if d} == {}


def _imports_argparse(path: Path) -> bool:
    return any(isinstance(n, ast.Import) and any(a.name == "argparse" for a in n.names)
               or isinstance(n, ast.ImportFrom) and n.module == "argparse" for n in ast.walk(ast.parse(path.read_text())))


def test_commands_are_parsed_only_in_cli():
    # the one command layer parses arguments; the libraries below it take values. The demo data's writer is a
    # build-time script of the assets (python -m moetune.assets.demo_data), not a moetune command.
    parsing = {m for m, path in _modules().items() if _imports_argparse(path)}
    assert "moetune.cli.args" in parsing  # the premise: the check sees an import of argparse
    assert {m for m in parsing if not m.startswith("moetune.cli")} == {"moetune.assets.demo_data"}


def test_nothing_below_the_command_layer_imports_it():
    g = _graph()
    assert "moetune.cli.args" in g["moetune.cli.export"]  # the premise: edges into cli/ are seen
    assert {m: sorted(d for d in deps if d.startswith("moetune.cli")) for m, deps in g.items()
            if not m.startswith("moetune.cli") and m != "moetune.__main__"
            and any(d.startswith("moetune.cli") for d in deps)} == {}
