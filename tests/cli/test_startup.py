"""What a CLI process imports to answer: the fast verbs stay off the heavy stacks.

Each test runs the console script's ``main`` in a fresh interpreter and looks at
``sys.modules`` when it exits; ``benchmarks/cli.py`` measures what that saves, these tests
only keep the imports from creeping back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from tests.support.journals import fill_varied_journal

ROOT = Path(__file__).resolve().parents[2]

# Run ``main`` as the console script does; whatever it prints, the modules come last, on
# stderr, after a marker.
_PROBE = """
import json, sys
from sbproxy.cli import main
sys.argv = ["sbproxy", *json.loads(sys.argv[1])]
try:
    main()
except SystemExit as exc:
    code = exc.code
print("\\nMODULES " + json.dumps({"code": code, "modules": sorted(sys.modules)}), file=sys.stderr)
"""

# The database layer, the server stack and the model host's engines.
HEAVY = ("sqlalchemy", "aiosqlite", "sqlmodel", "litestar", "uvicorn", "httpx", "anyio")


def imported(*args: str, env: dict[str, str] | None = None) -> tuple[int, set[str]]:
    """Exit status and every module imported by ``sbproxy ARGS``."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(list(args))],
        cwd=ROOT,
        env=env or _clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    marker = done.stderr.rindex("MODULES ")
    report = json.loads(done.stderr[marker + len("MODULES ") :])
    return int(report["code"] or 0), set(report["modules"])


def _clean_env() -> dict[str, str]:
    dropped = {"SB_CONFIG_FILE", "SBPROXY_CACHE_DIR", "SBPROXY_FAULT_POINTS"}
    return {key: value for key, value in os.environ.items() if key not in dropped}


def _roots(modules: set[str]) -> set[str]:
    return {name.split(".")[0] for name in modules}


@pytest.mark.parametrize("args", [("--help",), ("--version",)])
def test_help_imports_click_and_the_verb_table_only(args: tuple[str, ...]) -> None:
    code, modules = imported(*args)
    assert code == 0
    assert not _roots(modules) & {"pydantic", "pydantic_core", "yaml", *HEAVY}
    ours = {name for name in modules if name.startswith("sbproxy")}
    assert ours <= {
        "sbproxy",
        "sbproxy.cli",
        "sbproxy.cli.main",
        "sbproxy.cli._lazy",
        "sbproxy.cli._output",
        "sbproxy.errors",
    }


def test_models_help_imports_none_of_the_verbs_it_lists() -> None:
    code, modules = imported("models", "--help")
    assert code == 0
    verbs = {name for name in modules if name.startswith("sbproxy.cli.models_")}
    assert verbs == {"sbproxy.cli.models_cmd"}


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A cache root whose journal holds jobs in every state, stale ones included."""
    root = tmp_path_factory.mktemp("startup-cache")
    anyio.run(fill_varied_journal, root / "jobs" / "journal.db")
    return {**_clean_env(), "SBPROXY_CACHE_DIR": str(root)}


@pytest.mark.parametrize("output", ["text", "json"])
def test_jobs_list_reads_the_journal_without_the_database_layer(
    cache_env: dict[str, str], output: str
) -> None:
    code, modules = imported("jobs", "list", "--format", output, env=cache_env)
    assert code == 0
    assert "sbproxy.store.readonly" in modules
    assert not _roots(modules) & {"pydantic", "pydantic_core", "yaml", "ulid", *HEAVY}
    assert not {name for name in modules if name.startswith("sbproxy.store.")} & {
        "sbproxy.store.database",
        "sbproxy.store.jobs",
        "sbproxy.store.migrations",
    }
    assert "sbproxy.cli.jobs_control_cmd" not in modules


@pytest.mark.parametrize("output", ["text", "json"])
def test_models_list_reads_the_cache_without_the_journal_or_yaml(
    cache_env: dict[str, str], output: str
) -> None:
    code, modules = imported("models", "list", "--format", output, env=cache_env)
    assert code == 0
    assert "sbproxy.model_host.artifacts.cache" in modules  # the cache status was read
    assert not _roots(modules) & {"yaml", "sqlalchemy", "aiosqlite", "sqlmodel", "litestar"}
    assert not _roots(modules) & {"uvicorn", "httpx"}
    assert not modules & {
        "sbproxy.model_host.service",
        "sbproxy.model_host.flows",
        "sbproxy.workflows.engine",
        "sbproxy.model_host.artifacts.download",
    }
