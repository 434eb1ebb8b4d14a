"""The experiments package's layering, read from the source (no imports run): imports flow one way,
``pipeline → definitions → models, data → analysis → engine``, with no cycle and no experiment
importing another. ``papers`` (the papers' settings and published numbers: data, no imports from
the package) sits below all of them."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

# found without importing the package (and torch): only its source is read
_spec = importlib.util.find_spec("layernorm")
assert _spec is not None and _spec.submodule_search_locations
ROOT = Path(next(iter(_spec.submodule_search_locations))) / "experiments"
PREFIX = "layernorm.experiments"

# What each part may import from inside the package (its own part is always allowed).
ALLOWED = {
    "papers": set(),
    "engine": set(),
    "analysis": {"engine.registry", "engine.io", "papers"},
    "models": {"engine", "analysis", "data"},
    "data": set(),
    "definitions": {"engine", "analysis", "models", "data", "papers"},
    "pipeline": {"engine", "analysis", "definitions", "papers"},
    "__init__": {"engine", "definitions", "pipeline", "papers"},
}


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"] or ["__init__"]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """The package-internal modules ``path`` imports (relative to the package), whole modules
    included when a name is taken from a package."""
    mod = _module(path)
    is_pkg = path.name == "__init__.py"
    here = [] if mod == "__init__" else mod.split(".")
    base = here if is_pkg else here[:-1]  # the package a relative import starts from
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if node.module and node.module.startswith(PREFIX + "."):
                    out.add(node.module[len(PREFIX) + 1 :])
                continue
            up = base[: len(base) - (node.level - 1)] if node.level > 1 else base
            if node.level - 1 > len(base):
                continue  # above the package: the library itself
            target = [*up, *(node.module.split(".") if node.module else [])]
            if not target:  # `from . import x`: the modules x
                out |= {n.name for n in node.names}
            elif node.module is None:
                out |= {".".join([*target, n.name]) for n in node.names}
            else:
                out.add(".".join(target))
    return {m for m in out if m}


def _graph() -> dict[str, set[str]]:
    return {_module(p): _imports(p) for p in sorted(ROOT.rglob("*.py"))}


def _part(mod: str) -> str:
    return mod.split(".")[0]


def test_imports_flow_one_way():
    bad = []
    for mod, deps in _graph().items():
        part = _part(mod)
        for dep in deps:
            if _part(dep) == part and part != "definitions":
                continue
            allowed = ALLOWED[part]
            if part == "definitions" and mod == "definitions":  # the package registers them all
                allowed = allowed | {"definitions"}
            if not any(dep == a or dep.startswith(a + ".") for a in allowed):
                bad.append(f"{mod} imports {dep}")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_import_cycle():
    graph = _graph()
    known = set(graph)

    def visit(mod: str, stack: list[str], done: set[str]) -> list[str] | None:
        if mod in stack:
            return [*stack[stack.index(mod) :], mod]
        if mod in done or mod not in known:
            return None
        done.add(mod)
        for dep in sorted(graph[mod]):
            cycle = visit(dep, [*stack, mod], done)
            if cycle:
                return cycle
        return None

    for mod in graph:
        cycle = visit(mod, [], set())
        assert cycle is None, " → ".join(cycle)


def test_the_graph_sees_relative_imports():
    # guards the parser above: these edges exist, so a test that finds nothing is not vacuous
    graph = _graph()
    assert "engine.registry" in graph["analysis.report"]
    assert "models.mlp" in graph["definitions.mnist_ff"]
    assert "definitions.char_lm" in graph["definitions"]
    assert "analysis.report" in graph["pipeline"]


def test_one_comparison_helper():
    defs = [
        _module(p)
        for p in ROOT.rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name == "lower"
    ]
    assert defs == ["analysis.compare"]
