"""The package's import graph: no cycles, nothing lower imports anything higher (the data-flow order), and the
product never imports the lab (``lab/``), the benchmarks, the demos or the tests that live beside it.

Built from the source with ``ast`` (every ``import`` and ``from ... import``, including imports inside
functions), at module granularity: a package's ``__init__`` is its own node.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "jetson_tq"

#: Rank of each top-level part in the data flow; an import may only go to a rank <= its own.
LAYERS = {
    "errors": 0,
    "env": 0,
    "version": 0,
    "arg_types": 0,
    "format": 1,
    "validate": 2,
    "config": 2,
    "codec": 3,
    "paged": 4,
    "attention": 5,
    "kernels": 5,
    "ops": 6,
    "cache": 7,
    "api": 8,
    "models": 8,
    "integrations": 9,
    "calibration": 10,
    "platform": 11,
    "reports": 12,
    "cli": 13,
    "__init__": 14,
    "__main__": 14,
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] + ["__init__"] if len(parts) == 1 else parts[:-1]
    return ".".join(parts)


def _known(modules: set[str], name: str) -> str | None:
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """module -> the jetson_tq modules it imports."""
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(files)
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        if mod == "jetson_tq.__init__":
            package = "jetson_tq"
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                # ``from pkg import sub`` imports the submodule; ``from mod import name`` imports mod
                targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix for a in node.names]
            for t in targets:
                if t.startswith("jetson_tq"):
                    hit = _known(modules, t) or ("jetson_tq.__init__" if t == "jetson_tq" else None)
                    if hit and hit != mod:
                        deps.add(hit)
        graph[mod] = deps
    return graph


def _part(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 40  # the whole package was read
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycle = stack[stack.index(d) :] + [d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_nothing_lower_imports_anything_higher():
    bad = []
    for mod, deps in import_graph().items():
        part = _part(mod)
        assert part in LAYERS, f"{mod}: new top-level part {part!r}; give it a rank in LAYERS"
        for d in deps:
            if LAYERS[_part(d)] > LAYERS[part]:
                bad.append(f"{mod} -> {d}")
    assert not bad, "imports against the data flow:\n" + "\n".join(sorted(bad))


def test_only_ops_picks_a_backend():
    """JETSON_TQ_BACKEND (``env.Settings.kernel_backend``) is read in one module, and no other module imports a
    kernel launcher directly."""
    readers = [
        str(p.relative_to(ROOT))
        for p in ROOT.rglob("*.py")
        if any(isinstance(n, ast.Attribute) and n.attr == "kernel_backend" for n in ast.walk(ast.parse(p.read_text())))
    ]
    assert readers == ["ops/backend.py"], readers
    importers = {
        m
        for m, deps in import_graph().items()
        if any(d.startswith("jetson_tq.kernels.") and d not in ("jetson_tq.kernels._common",) for d in deps)
    }
    assert importers <= {m for m in importers if m.startswith(("jetson_tq.kernels", "jetson_tq.ops"))}, importers


#: Top-level folders beside the package that import it and that it must never import: the wheel ships none of them.
OUTSIDE = ("lab", "benchmarks", "demos", "tests")
#: The one module that names a lab module, by string, to run it from a checkout (``python -m jetson_tq vllm``).
LAB_DOORWAY = "cli/vllm_cmd.py"


def outside_imports(source: str, filename: str = "<source>") -> list[str]:
    """The modules of ``OUTSIDE`` that ``source`` imports (``import``/``from ... import``, inside functions too;
    a relative import stays inside the package, so only absolute ones can reach them)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        found += [n for n in names if n.partition(".")[0] in OUTSIDE]
    return found


def lab_module_names(source: str, filename: str = "<source>") -> list[str]:
    """String constants that name a lab module (``"lab"`` or ``"lab.…"``): an import by name (importlib)."""
    return [
        n.value
        for n in ast.walk(ast.parse(source, filename))
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and (n.value == "lab" or n.value.startswith("lab."))
    ]


def test_the_package_never_imports_the_lab():
    bad = {
        str(p.relative_to(ROOT)): hits
        for p in sorted(ROOT.rglob("*.py"))
        if (hits := outside_imports(p.read_text(), str(p)))
    }
    assert not bad, f"jetson_tq imports what lives beside it ({', '.join(OUTSIDE)}): {bad}"
    by_name = {str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if lab_module_names(p.read_text(), str(p))}
    assert by_name == {LAB_DOORWAY}, f"only {LAB_DOORWAY} may name a lab module (to run it from a checkout): {by_name}"


def test_the_lab_rule_catches_each_kind_of_import():
    source = """
import lab
import benchmarks.fidelity as bf
from lab.eval import fidelity
from tests.helpers import engines
from jetson_tq.format import KVFormat
from . import lab_helpers
import labrador


def late():
    from demos import demo_jetson
    importlib.import_module("lab.vllm_compare")
"""
    assert outside_imports(source) == ["lab", "benchmarks.fidelity", "lab.eval", "tests.helpers", "demos"]
    assert lab_module_names(source) == ["lab.vllm_compare"]
    assert outside_imports("from jetson_tq.calibration import keys\nimport torch\n") == []


def test_every_jetson_tq_variable_is_named_in_env_only():
    """The ``JETSON_TQ_*`` names live in ``jetson_tq/env.py`` (one ``Settings``); other modules use its constants."""
    import re

    from jetson_tq import env

    NAME = r"JETSON_TQ_[A-Z0-9_]+"
    named: dict[str, set[str]] = {}
    for p in ROOT.rglob("*.py"):
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and re.fullmatch(NAME, n.value):
                named.setdefault(n.value, set()).add(str(p.relative_to(ROOT)))
    assert {name: files for name, files in named.items() if files != {"env.py"}} == {}
    assert set(named) == set(env.NAMES) and len(env.NAMES) == len(set(env.NAMES))
