from __future__ import annotations

import pytest


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
