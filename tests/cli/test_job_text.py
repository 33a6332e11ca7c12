"""Rendering of jobs for people: sizes, progress, ages, and how a watch replays its backlog."""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import pytest

from sbproxy.cli._event_view import LineView
from sbproxy.cli._job_text import (
    age_text,
    duration_text,
    job_table,
    progress_text,
    resume_hint,
    show_lines,
    size_text,
)
from sbproxy.store import EventRecord, JobRecord, JobStatus, LeaseStamp, LeaseTime, StepRecord
from sbproxy.store.lifecycle import StepStatus
from sbproxy.workflows import Staleness

JOB = "01JABCDEFGHJKMNPQRSTVWXYZ0"
MIB = 2**20


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (120 * MIB, "120.0 MiB"),
        (3 * 2**40, "3.0 TiB"),
    ],
)
def test_sizes_use_binary_units_with_one_decimal(value: int, text: str) -> None:
    assert size_text(value) == text


@pytest.mark.parametrize(
    ("progress", "full", "compact"),
    [
        (
            {"done": 120 * MIB, "total": 253_125_017, "unit": "bytes"},
            "120.0 MiB / 241.4 MiB (49%)",
            "49%",
        ),
        ({"done": 5 * MIB, "total": None, "unit": "bytes"}, "5.0 MiB", "5.0 MiB"),
        ({"done": 3, "total": 10, "unit": "files"}, "3 / 10 files (30%)", "30%"),
        (
            {"done": 1, "total": 2, "unit": "files", "current": "a.gguf"},
            "1 / 2 files (50%) [a.gguf]",
            "50%",
        ),
        ({"done": 7, "total": 0, "unit": "bytes"}, "7 B / 0 B", "7 B"),
    ],
)
def test_progress_text(progress: dict[str, Any], full: str, compact: str) -> None:
    assert progress_text(progress) == full
    assert progress_text(progress, compact=True) == compact


def test_ages_and_durations_read_naturally() -> None:
    now = 10**12
    assert age_text(now - 200, now) == "just now"
    assert age_text(now - 12_000, now) == "12s ago"
    assert age_text(now - 5 * 60_000, now) == "5m ago"
    assert age_text(now - 3 * 3_600_000, now) == "3h ago"
    assert age_text(now - 2 * 86_400_000, now) == "2d ago"
    assert len(age_text(now - 30 * 86_400_000, now)) == len("2001-09-09")
    assert duration_text(12) == "12ms"
    assert duration_text(4_300) == "4.3s"
    assert duration_text(185_000) == "3m05s"
    assert duration_text(3_720_000) == "1h02m"


def event(number: int, at_ms: int, kind: str, **data: Any) -> EventRecord:
    return EventRecord(seq=number, job_id=JOB, at_ms=at_ms, type=kind, data=data)


def test_backlog_progress_collapses_to_the_latest_report_while_live_progress_streams() -> None:
    out = io.StringIO()
    view = LineView(JOB, live_from_ms=1000, stream=out)
    backlog = [
        event(1, 10, "status", status="running"),
        event(2, 20, "step", seq=0, name="download:a", status="running"),
        *(
            event(3 + i, 30 + i, "progress", step="download:a", done=i, total=9, unit="files")
            for i in range(1, 9)
        ),
    ]
    live = [
        event(20, 1001, "progress", step="download:a", done=9, total=9, unit="files"),
        event(21, 1002, "step", seq=0, status="failed", error={"code": "x", "message": "boom"}),
        event(22, 1003, "status", status="failed", error={"code": "x", "message": "boom"}),
    ]
    for record in (*backlog, *live):
        view.show(record)
    view.close()
    assert out.getvalue().splitlines() == [
        f"{JOB}: running",
        f"{JOB}: step download:a started",
        f"{JOB}: running step download:a 8 / 9 files (88%)",
        f"{JOB}: running step download:a 9 / 9 files (100%)",
        f"{JOB}: step download:a failed: x: boom",
        f"{JOB}: failed: x",  # the error comes with the outcome the verb prints next
    ]


def test_retries_are_one_line_each_and_quote_an_error_once() -> None:
    out = io.StringIO()
    view = LineView(JOB, live_from_ms=0, stream=out)
    refused = {"code": "transport", "message": "cannot reach h:1 (the connection was refused)"}
    records = [
        event(1, 1, "step", seq=1, name="fetch:a", status="running"),
        event(2, 2, "retry", step="fetch:a", attempt=2, max_attempts=3, delay_s=0.52,
              error=refused),
        event(3, 3, "retry", step="fetch:a", attempt=3, max_attempts=3, delay_s=1.04,
              error=refused),
        event(4, 4, "step", seq=1, status="failed",
              error={**refused, "message": refused["message"] + " for GET http://h:1/a"}),
        event(5, 5, "step", seq=2, name="fetch:b", status="running"),
        event(6, 6, "retry", step="fetch:b", attempt=2, max_attempts=3, delay_s=0.5,
              error={"code": "http_status", "message": "GET b answered HTTP 503"}),
        event(7, 7, "step", seq=2, status="failed", error=refused),
    ]  # fmt: skip
    for record in records:
        view.show(record)
    view.close()
    assert out.getvalue().splitlines() == [
        f"{JOB}: step fetch:a started",
        f"{JOB}: step fetch:a retry 2/3 in 0.5 s: transport: cannot reach h:1 (the connection "
        "was refused)",
        f"{JOB}: step fetch:a retry 3/3 in 1.0 s: same error",
        f"{JOB}: step fetch:a failed after 3 attempts: same error",
        f"{JOB}: step fetch:b started",
        f"{JOB}: step fetch:b retry 2/3 in 0.5 s: http_status: GET b answered HTTP 503",
        f"{JOB}: step fetch:b failed after 2 attempts: transport: cannot reach h:1 (the "
        "connection was refused)",
    ]


BOOT = "boot-a"
STARTED_MS = 10**12


def running_job(lease: LeaseStamp | None) -> JobRecord:
    return JobRecord(
        id=JOB,
        kind="pull",
        workflow_version=1,
        subject="artifact:sha256:" + "a" * 64,
        input={},
        idempotency_key="a" * 64,
        status=JobStatus.RUNNING,
        attempt=1,
        lease_owner="host:1234",
        lease=lease,
        cancel_requested=False,
        progress=None,
        output=None,
        error=None,
        trace_context=None,
        created_at_ms=STARTED_MS,
        updated_at_ms=STARTED_MS + 30_000,
        started_at_ms=STARTED_MS,
        ended_at_ms=None,
    )


def lease_line(job: JobRecord, *, now_ms: int, lease_now: LeaseTime) -> str:
    (line,) = [
        line for line in show_lines(job, [], now_ms=now_ms, lease_now=lease_now) if "lease" in line
    ]
    return line


# Renewed at 500_000 ms of lease time with a 15 s lease.
RENEWED = LeaseStamp(clock=BOOT, deadline_ms=515_000, duration_ms=15_000)


@pytest.mark.parametrize("wall_jump_ms", [0, 3_600_000, -3_600_000])
def test_show_says_when_a_lease_expires_on_the_lease_clock_whatever_the_wall_clock(
    wall_jump_ms: int,
) -> None:
    now_ms = STARTED_MS + 60_000 + wall_jump_ms
    live = lease_line(running_job(RENEWED), now_ms=now_ms, lease_now=LeaseTime(BOOT, 505_500))
    assert live == "  lease      host:1234 (expires in 9s)"
    lapsed = lease_line(
        running_job(RENEWED), now_ms=now_ms, lease_now=LeaseTime(BOOT, 515_000 + 5 * 60_000)
    )
    assert "expired 5m ago; resumed by the next worker or rerun" in lapsed
    assert "expires in" not in lapsed


@pytest.mark.parametrize(
    ("lease", "lease_now"),
    [
        (RENEWED, LeaseTime("boot-b", 505_500)),  # stamped before this machine's last boot
        (RENEWED, LeaseTime(BOOT, 400_000)),  # renewed "later" than now: not this clock
        (None, LeaseTime(BOOT, 505_500)),  # a wall-clock lease from before schema 4
    ],
)
def test_show_says_a_lease_this_clock_cannot_measure_has_lapsed(
    lease: LeaseStamp | None, lease_now: LeaseTime
) -> None:
    line = lease_line(running_job(lease), now_ms=STARTED_MS, lease_now=lease_now)
    assert line == (
        "  lease      host:1234 (lapsed: not renewed on this boot's clock; "
        "resumed by the next worker or rerun)"
    )


DELETE_STEP = StepRecord(
    job_id=JOB,
    seq=0,
    name="delete",
    status=StepStatus.RUNNING,
    attempts=1,
    output_json=None,
    error=None,
    started_at_ms=STARTED_MS,
    ended_at_ms=None,
)


def test_a_stale_job_says_how_long_it_was_silent_why_where_who_held_it_and_what_resumes_it() -> (
    None
):
    job = running_job(RENEWED)
    stale = Staleness(reason="owner_gone", owner="host:1234", age_ms=300_000, last_step=DELETE_STEP)
    table = job_table([job], now_ms=STARTED_MS + 600_000, stale={JOB: stale})
    assert "running (stale)" in table[1]
    assert table[2:] == [
        "",
        f"stale {JOB} (pull): silent for 5m00s: its owner host:1234 is gone; last step delete "
        "(#0, running); resumed by the next `sbproxy models pull` (or `models import`) of "
        "this artifact or by a running `sbproxy serve` on this cache",
    ]
    plain = job_table([job], now_ms=STARTED_MS + 600_000)
    assert len(plain) == 2 and "stale" not in plain[1]

    lapsed = Staleness(reason="lease_expired", owner="host:1234", age_ms=4_300, last_step=None)
    lines = show_lines(job, [], now_ms=STARTED_MS, lease_now=LeaseTime(BOOT, 520_000), stale=lapsed)
    at = lines.index("  stale      silent for 4.3s: the lease of host:1234 lapsed; no step begun")
    assert lines[at + 1].startswith("             resumed by the next `sbproxy models pull`")


@pytest.mark.parametrize(
    ("kind", "hint"),
    [
        (
            "remove",
            "resumed by the next `sbproxy models remove` of this artifact or by a running "
            "`sbproxy serve` on this cache",
        ),
        ("load", "resumed by the `sbproxy serve` of this cache (at once, or when it starts)"),
        ("something-else", "resumed by a running `sbproxy serve` on this cache"),
    ],
)
def test_each_kind_names_what_resumes_it(kind: str, hint: str) -> None:
    assert resume_hint(kind) == hint


def test_line_view_drops_a_progress_line_that_repeats_the_previous_one() -> None:
    out = io.StringIO()
    view = LineView(JOB, live_from_ms=0, stream=out)
    # A build reports per compiled file: many reports land on the same whole percent.
    for seq, done in enumerate((29, 29, 29, 30, 30, 29), start=1):
        view.show(event(seq, seq, "progress", step="build", done=done, total=100, unit="percent"))
    view.close()
    assert out.getvalue().splitlines() == [
        f"{JOB}: running step build 29 / 100 percent (29%)",
        f"{JOB}: running step build 30 / 100 percent (30%)",
        f"{JOB}: running step build 29 / 100 percent (29%)",
    ]


def test_a_fleet_scale_decision_shows_what_it_did_and_why_in_the_list() -> None:
    decision = dataclasses.replace(
        running_job(None),
        kind="fleet.scale",
        subject="deployment:chat",
        input={"from_replicas": 1, "to_replicas": 3, "reason": "panic", "figures": {}},
        status=JobStatus.SUCCEEDED,
    )
    (_, row) = job_table([decision], now_ms=STARTED_MS + 1_000)
    assert "fleet.scale" in row and "1 -> 3 panic" in row and "deployment:chat" in row
    other = dataclasses.replace(running_job(None), status=JobStatus.SUCCEEDED)
    (_, plain) = job_table([other], now_ms=STARTED_MS + 1_000)
    assert "->" not in plain


def test_a_pull_says_where_each_file_came_from_and_which_peer_failed() -> None:
    out = io.StringIO()
    view = LineView(JOB, live_from_ms=0, stream=out)
    for record in (
        event(1, 1, "peer_failed", path="m.gguf", node="node-a", code="digest_mismatch",
              error="m.gguf: SHA-256 x does not match the catalog's y"),
        event(2, 2, "source", path="m.gguf", source="upstream", bytes=2**30, resumed_from=0),
        event(3, 3, "source", path="n.gguf", source="node-b", bytes=3 * 2**20,
              resumed_from=1024),
    ):  # fmt: skip
        view.show(record)
    view.close()
    assert out.getvalue().splitlines() == [
        f"{JOB}: m.gguf: peer node-a did not deliver it (digest_mismatch: m.gguf: SHA-256 x "
        "does not match the catalog's y); next source",
        f"{JOB}: m.gguf: 1.0 GiB from upstream",
        f"{JOB}: n.gguf: 3.0 MiB from node-b, resumed from byte 1024",
    ]
