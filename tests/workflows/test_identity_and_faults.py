"""Lease owner identities survive pid reuse; fault points fire on the armed hit."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sbproxy.workflows import WorkerIdentity, arm, disarm_all, fault_point, owner_is_gone


def test_a_live_owner_is_not_gone() -> None:
    assert not owner_is_gone(WorkerIdentity.current().owner)


def test_a_dead_process_is_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    me = WorkerIdentity.current()
    dead = f"{me.boot_id}/{child.pid}/{me.start_ticks}/abcd"
    assert owner_is_gone(dead)


def test_a_reused_pid_is_not_mistaken_for_the_owner() -> None:
    me = WorkerIdentity.current()
    impostor = f"{me.boot_id}/{me.pid}/{int(me.start_ticks) + 1}/abcd"
    assert owner_is_gone(impostor)


def test_another_boot_is_gone_and_garbage_is_not() -> None:
    me = WorkerIdentity.current()
    assert owner_is_gone(f"00000000-0000-0000-0000-000000000000/{me.pid}/{me.start_ticks}/x")
    assert not owner_is_gone("not-an-owner")


def test_fault_point_fires_on_the_armed_hit_only(monkeypatch: pytest.MonkeyPatch) -> None:
    hits: list[str] = []
    disarm_all()
    arm("demo.point", on_hit=2, action=lambda: hits.append("fired"))
    fault_point("demo.point")
    assert hits == []
    fault_point("demo.point")
    assert hits == ["fired"]
    fault_point("demo.point")
    assert hits == ["fired"]
    fault_point("other.point")
    disarm_all()


def test_env_armed_fault_point_kills_the_process() -> None:
    code = (
        "from sbproxy.workflows import fault_point\n"
        "fault_point('x.first')\n"
        "print('passed first', flush=True)\n"
        "fault_point('x.second')\n"
        "print('never printed', flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={"SBPROXY_FAULT_POINTS": "x.second", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == -9
    assert done.stdout == "passed first\n"
