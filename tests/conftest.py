from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.postgres import PostgresServer, postgres_bin_dir


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
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        pytest.fail(
            "PostgreSQL's initdb is not installed: `bash scripts/test.sh` installs Debian's "
            "postgresql package (apt-get install postgresql)"
        )
    server = PostgresServer(bin_dir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


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
