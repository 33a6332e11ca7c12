from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.postgres import MISSING, PostgresServer, postgres_bin_dir, running_server


@pytest.fixture
def anyio_backend() -> str:
    """Async tests run on asyncio (the server's loop)."""
    return "asyncio"


PROXY_VARIABLES = (
    "HTTPS_PROXY",
    "https_proxy",
    "HTTP_PROXY",
    "http_proxy",
    "ALL_PROXY",
    "all_proxy",
    "NO_PROXY",
    "no_proxy",
)


@pytest.fixture(autouse=True)
def _no_proxy_from_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Downloads honour the proxy variables: the tests (and the processes they start) see
    only those a test sets, never the machine's."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One real PostgreSQL server for the session (Debian's ``postgresql`` package, a
    throw-away cluster under a temporary directory, a free loopback port); removed after."""
    if postgres_bin_dir() is None:
        pytest.fail(MISSING)
    with running_server() as server:
        yield server


@pytest.fixture
def own_postgres_server() -> Iterator[PostgresServer]:
    """A real PostgreSQL server of this test's own, which it may stop and restart under a
    journal (``stop_server`` / ``start_server``) without touching the session's."""
    if postgres_bin_dir() is None:
        pytest.fail(MISSING)
    with running_server() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def journal_backend(request: pytest.FixtureRequest) -> str:
    """The journal backend a test runs on: every test taking it runs on both."""
    return str(request.param)


@pytest.fixture
def journal_location(
    journal_backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Path | str:
    """Where the test's fresh journal is: ``<tmp>/jobs/journal.db`` on SQLite, a new
    database's ``postgresql://`` URL on PostgreSQL."""
    if journal_backend == "sqlite":
        return tmp_path / "jobs" / "journal.db"
    server: PostgresServer = request.getfixturevalue("postgres_server")
    return server.create_database()
