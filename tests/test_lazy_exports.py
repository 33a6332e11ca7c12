"""Packages whose heavy modules load on first use still export exactly their ``__all__``."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import subprocess
import sys

import pytest

LAZY_PACKAGES = (
    "sbproxy.store",
    "sbproxy.workflows",
    "sbproxy.model_host.artifacts",
    "sbproxy.model_host.runtime",
)


def _type_checking_imports(package: str) -> dict[str, tuple[str, ...]]:
    """Module -> names of the ``from M import ...`` statements under ``if TYPE_CHECKING:``."""
    tree = ast.parse(inspect.getsource(importlib.import_module(package)))
    found: dict[str, tuple[str, ...]] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for statement in node.body:
                assert isinstance(statement, ast.ImportFrom) and statement.module
                found[statement.module] = tuple(alias.name for alias in statement.names)
    return found


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_lazy_table_matches_the_type_checking_imports(package: str) -> None:
    module = importlib.import_module(package)
    assert _type_checking_imports(package) == module._LAZY


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_every_export_resolves_to_its_modules_object(package: str) -> None:
    module = importlib.import_module(package)
    lazy = {name: owner for owner, names in module._LAZY.items() for name in names}
    for name in module.__all__:
        value = getattr(module, name)
        if name in lazy:
            assert value is getattr(importlib.import_module(lazy[name]), name), name
    eager = {name for name in vars(module) if not name.startswith("_")}
    assert set(module.__all__) <= eager | set(lazy)
    assert set(lazy) <= set(module.__all__)


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_unknown_names_are_attribute_errors(package: str) -> None:
    module = importlib.import_module(package)
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = module.no_such_name


def test_store_records_import_without_the_database_layer() -> None:
    code = (
        "import json, sys\n"
        "from sbproxy.store import JobRecord, JobStatus, StepRecord, wall_clock_ms\n"
        "from sbproxy.workflows import Staleness, staleness\n"
        "from sbproxy.model_host.artifacts import resolve_cache_root\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    roots = {name.split(".")[0] for name in json.loads(done.stdout)}
    assert not roots & {"sqlalchemy", "aiosqlite", "sqlmodel", "anyio", "pydantic"}
