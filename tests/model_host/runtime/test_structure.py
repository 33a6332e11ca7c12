"""Structural rules of the runtime package (issue 21's "done means"), kept by reading the
source: no import circle inside ``runtime/``, no ``mypy: disable-error-code`` in it, no
function over 60 lines (docstrings excluded), no module outside it touching a live
runtime object (the deployments, staging, lanes, residency, launcher or outbox), and one
facade: outside the runtime, only ``model_host/service.py`` reads the manager's cache root,
journal, configuration, catalog or stores."""

from __future__ import annotations

import ast
from pathlib import Path

import grimp

import sbproxy

PACKAGE = Path(sbproxy.__file__).parent
RUNTIME = PACKAGE / "model_host" / "runtime"
RUNTIME_MODULE = "sbproxy.model_host.runtime"
MAX_FUNCTION_LINES = 60

# Live runtime objects: a reader outside the runtime gets a DeploymentStatus instead.
LIVE_MODULES = {
    f"{RUNTIME_MODULE}.{name}" for name in ("deployment", "staging", "lanes", "launcher")
}
LIVE_ATTRIBUTES = {"deployment", "deployments", "staging", "lanes", "residency", "launcher"}
LIVE_ATTRIBUTES |= {"outbox", "slot", "slots", "staged", "_live", "tallies"}

# What the model-host facade (ModelHostService.serving) reads off a serving manager: api/,
# cli/ and the rest of the package go through the facade for these.
FACADE = PACKAGE / "model_host" / "service.py"
MANAGER_INTERNALS = {"engine", "layout", "compiled", "catalog", "cache", "runtime_store", "worker"}


def _function_lengths(path: Path) -> list[tuple[str, int]]:
    """``(name, lines)`` of every function in ``path``, its docstring not counted."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        assert node.end_lineno is not None
        lines = node.end_lineno - node.lineno + 1
        first = node.body[0]
        value = first.value if isinstance(first, ast.Expr) else None
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            assert first.end_lineno is not None
            lines -= first.end_lineno - first.lineno + 1
        found.append((f"{path.name}:{node.lineno} {node.name}", lines))
    return found


def test_no_runtime_function_is_longer_than_60_lines() -> None:
    too_long = [
        (name, lines)
        for path in sorted(RUNTIME.glob("*.py"))
        for name, lines in _function_lengths(path)
        if lines > MAX_FUNCTION_LINES
    ]
    assert too_long == []


def test_the_length_rule_counts_a_long_function(tmp_path: Path) -> None:
    """The measure itself: the def line and 60 body lines are 61, the docstring is not
    counted."""
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    probe = tmp_path / "structure_probe.py"
    probe.write_text(f'def f():\n    """Doc\n    string."""\n{body}\n')
    assert _function_lengths(probe) == [("structure_probe.py:1 f", 61)]


def test_no_mypy_error_codes_are_disabled_in_the_runtime() -> None:
    offenders = [
        path.name
        for path in sorted(RUNTIME.glob("*.py"))
        if "disable-error-code" in path.read_text()
    ]
    assert offenders == []


def _runtime_cycles() -> list[list[str]]:
    """Import circles among runtime/'s modules (imports under TYPE_CHECKING and inside
    functions count: a circle is a circle)."""
    graph = grimp.build_graph("sbproxy", exclude_type_checking_imports=False)
    modules = sorted(m for m in graph.modules if m.startswith(RUNTIME_MODULE + "."))
    edges = {
        m: sorted(n for n in graph.find_modules_directly_imported_by(m) if n in modules)
        for m in modules
    }
    cycles: list[list[str]] = []
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        for target in edges[module]:
            if target in path:
                cycles.append([*path[path.index(target) :], target])
            elif target not in done:
                visit(target, [*path, target])
        done.add(module)

    for module in modules:
        if module not in done:
            visit(module, [module])
    return cycles


def test_no_import_circle_inside_the_runtime() -> None:
    assert _runtime_cycles() == []


def _manager_reads(path: Path, node: ast.AST, attributes: set[str]) -> str | None:
    """``<file>:<line> reads manager.<attribute>`` when ``node`` reads one of ``attributes``
    off a name or attribute ending in ``manager`` (``manager.engine``,
    ``self.manager.compiled``, ...)."""
    if not isinstance(node, ast.Attribute) or node.attr not in attributes:
        return None
    owner = node.value
    name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
    if not name.endswith("manager"):
        return None
    return f"{path.name}:{node.lineno} reads {name}.{node.attr}"


def _live_touches(path: Path) -> list[str]:
    """Where ``path`` imports a live runtime module or reads a live attribute of a
    manager (``manager.deployment(...)``, ``host.manager.staging``, ...)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module in LIVE_MODULES:
            found.append(f"{path.name}:{node.lineno} imports {node.module}")
        if (
            isinstance(node, ast.ImportFrom)
            and node.module == f"{RUNTIME_MODULE}.manager"
            and any(alias.name == "Deployment" for alias in node.names)
        ):
            found.append(f"{path.name}:{node.lineno} imports Deployment")
        read = _manager_reads(path, node, LIVE_ATTRIBUTES)
        if read is not None:
            found.append(read)
    return found


def test_no_module_outside_the_runtime_touches_a_live_runtime_object() -> None:
    outside = [p for p in sorted(PACKAGE.rglob("*.py")) if RUNTIME not in p.parents]
    assert outside, "the package's modules were not found"
    touches = [touch for path in outside for touch in _live_touches(path)]
    assert touches == []


def test_the_live_object_rule_sees_a_touch(tmp_path: Path) -> None:
    probe = tmp_path / "reader.py"
    probe.write_text(
        "from sbproxy.model_host.runtime.deployment import Deployment\n"
        "def f(host):\n    return host.manager.deployment('a').config\n"
    )
    assert _live_touches(probe) == [
        "reader.py:1 imports sbproxy.model_host.runtime.deployment",
        "reader.py:3 reads manager.deployment",
    ]


def _facade_bypasses(path: Path) -> list[str]:
    """Where ``path`` reads a manager internal the facade is there for."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = (_manager_reads(path, node, MANAGER_INTERNALS) for node in ast.walk(tree))
    return [read for read in found if read is not None]


def test_one_facade_reads_the_managers_cache_journal_and_configuration() -> None:
    """api/ and cli/ (the console, desired-state routes, metrics, jobs routes, the gateway's
    usage ledger) and the lockfile guard take a ModelHostService instead."""
    outside = [p for p in sorted(PACKAGE.rglob("*.py")) if RUNTIME not in p.parents and p != FACADE]
    assert any(p.parent.name == "api" for p in outside)
    bypasses = [found for path in outside for found in _facade_bypasses(path)]
    assert bypasses == []


def test_the_facade_rule_sees_a_bypass(tmp_path: Path) -> None:
    probe = tmp_path / "page.py"
    probe.write_text(
        "def f(manager, host):\n"
        "    logs = manager.layout.root / 'logs'\n"
        "    return manager.engine.store, host.manager.compiled, manager.status()\n"
    )
    assert sorted(_facade_bypasses(probe)) == [
        "page.py:2 reads manager.layout",
        "page.py:3 reads manager.compiled",
        "page.py:3 reads manager.engine",
    ]
