"""A committed reload is routine: logged at INFO, not WARNING (issue 30, the operator guide:
routine events must not look like something to act on); a refused one stays an ERROR."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from sbproxy.api.config_state import ConfigState, ReloadSource
from sbproxy.api.host import ServedHost
from sbproxy.api.server import reload_logged
from tests.api.support import TINY
from tests.model_host.runtime.host import runtime_host

pytestmark = pytest.mark.anyio


def records(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "sbproxy.api.server" and text in r.message]


async def test_a_committed_reload_logs_at_info_and_a_refused_one_at_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with runtime_host(tmp_path, deployments={"a": TINY}, config_file=True) as host:
        served: Any = SimpleNamespace(
            manager=host.manager, config=ConfigState.of(host.manager.compiled, revision=None)
        )
        caplog.set_level(logging.INFO, logger="sbproxy")
        await reload_logged(cast("ServedHost", served), source=ReloadSource.SIGHUP)
        (committed,) = records(caplog, "committed revision")
        assert committed.levelno == logging.INFO
        (tmp_path / "sb.yml").write_text("proxy: [not a mapping]\n")
        await reload_logged(cast("ServedHost", served), source=ReloadSource.SIGHUP)
        (refused,) = records(caplog, "nothing changed")
        assert refused.levelno == logging.ERROR
