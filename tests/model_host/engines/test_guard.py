"""The engine guard kills a fleet host's engines when the host stops ticking (paused), and
only then: real processes -- a stand-in engine in its own process group with an ownership
record, and the guard process fed by a pipe the test writes as the host would."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from sbproxy.model_host.engines.process import OwnershipRecord
from sbproxy.workflows import process_start_ticks

OWNER = "host-under-test"
DEADLINE_MS = 400


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    """A long-running child in its own group, recorded as ``OWNER``'s engine."""
    owned = tmp_path / "owned"
    owned.mkdir()
    child = subprocess.Popen(["sleep", "120"], start_new_session=True)
    record = OwnershipRecord(
        pid=child.pid,
        start_ticks=process_start_ticks(child.pid) or "",
        owner=OWNER,
        label="tiny",
        executable="sleep",
    )
    record.path(owned).write_text(json.dumps(dataclasses.asdict(record)))
    yield owned, child
    child.kill()
    child.wait()


def _guard(owned: Path, owner: str = OWNER) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "sbproxy.model_host.engines.guard", str(owned), owner]
    return subprocess.Popen([*argv, str(DEADLINE_MS)], stdin=subprocess.PIPE)


def _alive(child: subprocess.Popen[bytes]) -> bool:
    return child.poll() is None and psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE


def test_a_host_that_stops_ticking_has_its_engines_killed_within_the_deadline(
    engine: tuple[Path, subprocess.Popen[bytes]],
) -> None:
    owned, child = engine
    guard = _guard(owned)
    assert guard.stdin is not None
    try:
        ticking_until = time.monotonic() + 3 * DEADLINE_MS / 1000
        while time.monotonic() < ticking_until:  # a host that runs: nothing happens
            guard.stdin.write(b".")
            guard.stdin.flush()
            assert _alive(child)
            time.sleep(DEADLINE_MS / 4000)  # the host's tick period, not a wait for time
        silent = time.monotonic()
        child.wait(timeout=10)  # the "host" is paused now: no tick
        took = time.monotonic() - silent
        # Counted from the last tick, which came up to one tick period before ``silent``.
        assert DEADLINE_MS / 1000 * 0.7 <= took < DEADLINE_MS / 1000 + 2, took
    finally:
        guard.kill()
        guard.wait()
        guard.stdin.close()


def test_a_graceful_quit_leaves_the_engines_and_end_of_file_kills_them(
    engine: tuple[Path, subprocess.Popen[bytes]],
) -> None:
    owned, child = engine
    quiet = _guard(owned)
    assert quiet.stdin is not None
    quiet.stdin.write(b"q")
    quiet.stdin.flush()
    assert quiet.wait(timeout=10) == 0
    quiet.stdin.close()
    assert _alive(child)
    dying = _guard(owned)
    assert dying.stdin is not None
    dying.stdin.close()  # the host died
    assert dying.wait(timeout=10) == 0
    child.wait(timeout=5)


def test_the_guard_touches_only_its_own_host_s_engines(
    engine: tuple[Path, subprocess.Popen[bytes]],
) -> None:
    owned, child = engine
    other = _guard(owned, owner="another-host")
    assert other.stdin is not None
    other.stdin.close()
    assert other.wait(timeout=10) == 0
    assert _alive(child)
