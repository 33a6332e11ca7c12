"""Every reason code the package can produce, found by reading its source (AST), not by
importing it: a code raised in a module no test imports is found all the same.

A reason code reaches an operator as an error's ``code`` (CLI JSON, admin and gateway
bodies, a job's error), a deployment's ``reason_code`` (``models ps``, ``/status``) or an
access-log outcome. The scan collects string literals in the places such a code is written:

* ``default_code = "..."`` on an error class;
* ``code=`` / ``reason_code=`` keyword arguments, and the positional argument of a callable
  of the package whose parameter (or first dataclass field) is named ``code`` --
  ``ErrorInfo("invalid_input", ...)``, ``self._error("engine_port_lost", ...)``;
* ``{"code": ...}`` dictionaries; ``x.code == "..."`` and ``x.code in (...)`` comparisons
  (the codes a table produces are compared where they are handled), ``x.code in NAME`` of a
  module's ``NAME = frozenset({...})`` (or set, tuple) of literals too;
* assignments to ``code``, ``reason_code`` or ``outcome`` (a name or an attribute);
* ``stop(..., reason="...")`` of the runtime: a stop's reason becomes the stopped
  deployment's ``reason_code``;
* the values of :class:`~sbproxy.model_host.runtime.admission.AdmissionReason`, and of the
  fleet planner's :class:`~sbproxy.fleet.placement.PlacementReason`,
  :class:`~sbproxy.fleet.placement.DeferReason` (a decision's ``reason``) and
  :class:`~sbproxy.fleet.placement.StuckReason` (a stuck placement's, a re-placement's
  ``cause``).

In each place the value may be a literal, a module constant (``RECOVERY_EXHAUSTED``), a
conditional (``a if x else "prepare_failed"``), an ``or`` (``reason or "admin_error"``), a
tuple of literals, ``str(...)`` of one of those, ``TABLE.get(key, "default")`` (the table's
values and the default) or a call of a function of the same module that returns one of
those (``code=_http_code(exc)``).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from sbproxy.fleet.placement import DeferReason, PlacementReason, StuckReason
from sbproxy.model_host.runtime.admission import AdmissionReason

__all__ = ["PACKAGE", "reason_codes"]

PACKAGE = Path(__file__).resolve().parents[2] / "sbproxy"
_CODE_NAMES = frozenset({"code", "reason_code"})
# Calls whose `reason=` becomes a deployment's reason code: the runtime's stop and the
# Deployment's drained (a stop that ends `stopped` with that reason).
_REASON_CALLS = frozenset({"stop", "drained"})
_ASSIGNED = frozenset({"code", "reason_code", "outcome"})


class _Module:
    def __init__(self, path: Path, tree: ast.Module) -> None:
        self.path = path
        self.tree = tree
        self.constants: dict[str, str] = {}
        self.tables: dict[str, list[ast.expr]] = {}
        self.sets: dict[str, ast.expr] = {}
        self.functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
        for statement in tree.body:
            target, value = _assignment(statement)
            if target is not None and value is not None:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    self.constants[target] = value.value
                elif isinstance(value, ast.Dict):
                    self.tables[target] = list(value.values)
                elif isinstance(value, ast.Set | ast.Tuple):
                    self.sets[target] = value
                elif (
                    isinstance(value, ast.Call)
                    and isinstance(value.func, ast.Name)
                    and value.func.id == "frozenset"
                    and value.args
                ):
                    self.sets[target] = value.args[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.functions.setdefault(node.name, node)


def _assignment(statement: ast.stmt) -> tuple[str | None, ast.expr | None]:
    if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
        target = statement.targets[0]
        if isinstance(target, ast.Name):
            return target.id, statement.value
    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
        return statement.target.id, statement.value
    return None, None


class _Scan:
    def __init__(self, modules: list[_Module], root: Path) -> None:
        self.modules = modules
        self.root = root
        self.constants = {k: v for m in modules for k, v in m.constants.items() if k.isupper()}
        self.positional: dict[str, int] = {}
        for module in modules:
            for node in ast.walk(module.tree):
                self._note_positional(node)
        self.found: defaultdict[str, set[str]] = defaultdict(set)

    def _note_positional(self, node: ast.AST) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names = [a.arg for a in (*node.args.posonlyargs, *node.args.args)]
            if names[:1] in (["self"], ["cls"]):
                names = names[1:]
            if "code" in names:
                self.positional[node.name] = names.index("code")
        elif isinstance(node, ast.ClassDef):
            fields = [
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            ]
            if "code" in fields:
                self.positional.setdefault(node.name, fields.index("code"))

    def literals(self, node: ast.expr | None, module: _Module, depth: int = 0) -> Iterator[str]:
        """The codes ``node`` can evaluate to, as far as the rules above see."""
        if node is None or depth > 3:
            return
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value
        elif isinstance(node, ast.Name) and node.id in self.constants:
            yield self.constants[node.id]
        elif isinstance(node, ast.Name) and node.id in module.sets:
            yield from self.literals(module.sets[node.id], module, depth + 1)
        elif isinstance(node, ast.Attribute) and node.attr in self.constants:
            yield self.constants[node.attr]
        elif isinstance(node, ast.IfExp):
            yield from self.literals(node.body, module, depth)
            yield from self.literals(node.orelse, module, depth)
        elif isinstance(node, ast.BoolOp):
            for value in node.values:
                yield from self.literals(value, module, depth)
        elif isinstance(node, ast.Tuple | ast.List | ast.Set):
            for element in node.elts:
                yield from self.literals(element, module, depth)
        elif isinstance(node, ast.Call):
            yield from self._call_literals(node, module, depth)

    def _call_literals(self, node: ast.Call, module: _Module, depth: int) -> Iterator[str]:
        func = node.func
        if isinstance(func, ast.Name) and func.id == "str" and node.args:
            yield from self.literals(node.args[0], module, depth)
        elif isinstance(func, ast.Attribute) and func.attr == "get":
            if isinstance(func.value, ast.Name) and func.value.id in module.tables:
                for value in module.tables[func.value.id]:
                    yield from self.literals(value, module, depth + 1)
            if len(node.args) > 1:
                yield from self.literals(node.args[1], module, depth)
        elif isinstance(func, ast.Name) and func.id in module.functions:
            for inner in ast.walk(module.functions[func.id]):
                if isinstance(inner, ast.Return):
                    yield from self.literals(inner.value, module, depth + 1)

    def add(self, node: ast.expr | None, module: _Module, line: int, how: str) -> None:
        relative = module.path.relative_to(self.root)
        for code in self.literals(node, module):
            if code:
                self.found[code].add(f"{relative}:{line} ({how})")

    def visit(self, module: _Module) -> None:
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Assign | ast.AnnAssign):
                self._visit_assignment(node, module)
            elif isinstance(node, ast.Call):
                self._visit_call(node, module)
            elif isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values, strict=True):
                    if isinstance(key, ast.Constant) and key.value in _CODE_NAMES:
                        self.add(value, module, node.lineno, "dict")
            elif isinstance(node, ast.Compare):
                left = node.left
                if isinstance(left, ast.Attribute) and left.attr in _CODE_NAMES:
                    for comparator in node.comparators:
                        self.add(comparator, module, node.lineno, "compared")

    def _visit_assignment(self, node: ast.Assign | ast.AnnAssign, module: _Module) -> None:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            name = target.id if isinstance(target, ast.Name) else None
            if isinstance(target, ast.Attribute):
                name = target.attr
            if name == "default_code" or name in _ASSIGNED:
                self.add(node.value, module, node.lineno, f"{name} =")

    def _visit_call(self, node: ast.Call, module: _Module) -> None:
        for keyword in node.keywords:
            if keyword.arg in _CODE_NAMES:
                self.add(keyword.value, module, node.lineno, f"{keyword.arg}=")
        func = node.func
        name = func.id if isinstance(func, ast.Name) else None
        if isinstance(func, ast.Attribute):
            name = func.attr
        if name in self.positional and len(node.args) > self.positional[name]:
            self.add(node.args[self.positional[name]], module, node.lineno, f"{name}()")
        if name in _REASON_CALLS:
            for keyword in node.keywords:
                if keyword.arg == "reason":
                    self.add(keyword.value, module, node.lineno, f"{name}(reason=)")


def reason_codes(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Each reason code found under ``package``, with where it was found."""
    modules = [_Module(path, ast.parse(path.read_text())) for path in sorted(package.rglob("*.py"))]
    scan = _Scan(modules, package.parent)
    for module in modules:
        scan.visit(module)
    for reason in AdmissionReason:
        scan.found[reason.value].add("sbproxy/model_host/runtime/admission.py (AdmissionReason)")
    for enum in (PlacementReason, DeferReason, StuckReason):
        for value in enum:
            scan.found[value.value].add(f"sbproxy/fleet/placement.py ({enum.__name__})")
    return dict(scan.found)
