"""Text rendering of jobs for people: sizes, ages, progress, the list table, ``jobs show``.

Pure functions of records and a "now" (epoch milliseconds for the timestamps people read; a
lease-clock reading for leases), so they are tested directly and never read a clock
themselves.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from sbproxy.store import JobRecord, JobStatus, LeaseTime, StepRecord
from sbproxy.workflows import Staleness

__all__ = [
    "RUNTIME_KINDS",
    "age_text",
    "align",
    "duration_text",
    "job_outcome_line",
    "job_table",
    "last_error",
    "progress_text",
    "resume_hint",
    "show_lines",
    "size_text",
    "stale_dict",
    "stale_text",
]

_SECOND_MS = 1000
_MINUTE_MS = 60 * _SECOND_MS
_HOUR_MS = 60 * _MINUTE_MS
_DAY_MS = 24 * _HOUR_MS
_OUTPUT_PREVIEW_CHARS = 200

# Who resumes a stale job of each kind: the verb that submits that kind finishes a stale job
# of its kind and subject before anything else (``ModelHostService.resume_stale``), and a
# server's worker loop recovers every kind it runs within seconds.
_SERVER = "a running `sbproxy serve` on this cache"
_RESUMED_BY = {
    "pull": "the next `sbproxy models pull` (or `models import`) of this artifact",
    "remove": "the next `sbproxy models remove` of this artifact",
    "gc": "the next `sbproxy models gc` (or a pull that enforces the cache budget)",
    "prune": "the next `sbproxy models prune`",
    "engine_build": "the next `sbproxy engines build` of this source",
    "engine_fetch": "the next load that needs this engine",
}
# Deployment jobs run only in the `sbproxy serve` of their cache: its runtime manager takes
# them (at start, and a queued one within a second) and the CLI cannot run them.
RUNTIME_KINDS = frozenset({"load", "drain", "reset", "reload"})


def size_text(value: int | float) -> str:
    """``512 B``, ``120.0 MiB``, ``1.5 GiB``: binary units (2^10 steps), one decimal."""
    amount = float(value)
    if abs(amount) < 1024:
        return f"{int(amount)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        amount /= 1024
        if abs(amount) < 1024 or unit == "TiB":
            break
    return f"{amount:.1f} {unit}"


def _amount(value: object, unit: str) -> str:
    if not isinstance(value, int | float):
        return "?"
    if unit == "bytes":
        return size_text(value)
    return f"{value:g}"


def _percent(done: object, total: object) -> int | None:
    if not isinstance(done, int | float) or not isinstance(total, int | float) or total <= 0:
        return None
    return min(100, int(done * 100 // total))


def progress_text(progress: Mapping[str, Any], *, compact: bool = False) -> str:
    """Render a progress report (``{"done", "total", "unit", "current"?, "step"?}``).

    Full form: ``120.0 MiB / 241.4 MiB (49%)``, ``3 / 10 files (30%)``, ``120.0 MiB`` when the
    total is unknown, followed by `` [current item]`` when one is named. Compact form (the
    list table): ``49%``, or the bare amount when the total is unknown.
    """
    unit = str(progress.get("unit") or "bytes")
    done = progress.get("done")
    total = progress.get("total")
    percent = _percent(done, total)
    if compact:
        return f"{percent}%" if percent is not None else _amount(done, unit)
    suffix = "" if unit == "bytes" else f" {unit}"
    if total is None:
        text = f"{_amount(done, unit)}{suffix}"
    else:
        text = f"{_amount(done, unit)} / {_amount(total, unit)}{suffix}"
        if percent is not None:
            text += f" ({percent}%)"
    current = progress.get("current")
    if current:
        text += f" [{current}]"
    return text


def _ago(elapsed_ms: int) -> str:
    """``just now``, ``12s ago``, ``5m ago``, ``3h ago``, ``2d ago`` for ``elapsed_ms``."""
    if elapsed_ms < _SECOND_MS:
        return "just now"
    if elapsed_ms < _MINUTE_MS:
        return f"{elapsed_ms // _SECOND_MS}s ago"
    if elapsed_ms < _HOUR_MS:
        return f"{elapsed_ms // _MINUTE_MS}m ago"
    if elapsed_ms < _DAY_MS:
        return f"{elapsed_ms // _HOUR_MS}h ago"
    return f"{elapsed_ms // _DAY_MS}d ago"


def age_text(at_ms: int, now_ms: int) -> str:
    """How long ago ``at_ms`` was: ``12s ago``, ``5m ago``, ``3h ago``, ``2d ago``, then a date."""
    elapsed = now_ms - at_ms
    if elapsed < 7 * _DAY_MS:
        return _ago(elapsed)
    return _local_time(at_ms, "%Y-%m-%d")


def _local_time(at_ms: int, pattern: str = "%Y-%m-%d %H:%M:%S") -> str:
    return time.strftime(pattern, time.localtime(at_ms / 1000))


def duration_text(elapsed_ms: int) -> str:
    """``12ms``, ``4.3s``, ``3m05s``, ``1h02m``."""
    if elapsed_ms < _SECOND_MS:
        return f"{max(0, elapsed_ms)}ms"
    if elapsed_ms < _MINUTE_MS:
        return f"{elapsed_ms / 1000:.1f}s"
    if elapsed_ms < _HOUR_MS:
        minutes, rest = divmod(elapsed_ms, _MINUTE_MS)
        return f"{minutes}m{rest // _SECOND_MS:02d}s"
    hours, rest = divmod(elapsed_ms, _HOUR_MS)
    return f"{hours}h{rest // _MINUTE_MS:02d}m"


def align(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns two spaces apart, trailing blanks trimmed."""
    table = [tuple(headers), *(tuple(row) for row in rows)]
    widths = [max(len(cell) for cell in column) for column in zip(*table, strict=True)]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in table
    ]


def resume_hint(kind: str) -> str:
    """How a stale job of ``kind`` gets resumed: ``resumed by <who>``."""
    if kind in RUNTIME_KINDS:
        return "resumed by the `sbproxy serve` of this cache (at once, or when it starts)"
    by = _RESUMED_BY.get(kind)
    return f"resumed by {by} or by {_SERVER}" if by else f"resumed by {_SERVER}"


def stale_text(stale: Staleness) -> str:
    """``silent for 5m: its owner <owner> is gone; last step delete (#0, running)``."""
    silent = duration_text(stale.age_ms)
    owner = stale.owner or "(none)"
    why = (
        f"its owner {owner} is gone"
        if stale.reason == "owner_gone"
        else f"the lease of {owner} lapsed"
    )
    step = stale.last_step
    where = (
        f"last step {step.name} (#{step.seq}, {step.status.value})"
        if step is not None
        else "no step begun"
    )
    return f"silent for {silent}: {why}; {where}"


def stale_dict(job: JobRecord, stale: Staleness | None) -> dict[str, Any] | None:
    """The ``stale`` field of a job in JSON output: :meth:`Staleness.to_dict` plus
    ``resume`` (who resumes it), or ``None`` for a job that is not stale."""
    if stale is None:
        return None
    return {**stale.to_dict(), "resume": resume_hint(job.kind)}


def job_table(
    jobs: Sequence[JobRecord], *, now_ms: int, stale: Mapping[str, Staleness] | None = None
) -> list[str]:
    """The ``jobs list`` table: ID KIND STATUS ATTEMPT PROGRESS SUBJECT CREATED.

    A stale job (``stale`` maps job ids to their staleness) shows ``running (stale)``, and
    one line per stale job follows the table: its age, why, its last step and owner, and
    who resumes it.
    """
    stale = stale or {}
    headers = ("ID", "KIND", "STATUS", "ATTEMPT", "PROGRESS", "SUBJECT", "CREATED")
    rows = [
        (
            job.id,
            job.kind,
            f"{job.status.value} (stale)" if job.id in stale else job.status.value,
            str(job.attempt),
            # A finished job's last report describes some earlier step, not the job.
            progress_text(job.progress, compact=True)
            if job.progress and job.status != JobStatus.SUCCEEDED
            else _decision_text(job),
            job.subject or "-",
            age_text(job.created_at_ms, now_ms),
        )
        for job in jobs
    ]
    lines = align(headers, rows)
    notes = [
        f"stale {job.id} ({job.kind}): {stale_text(stale[job.id])}; {resume_hint(job.kind)}"
        for job in jobs
        if job.id in stale
    ]
    return [*lines, "", *notes] if notes else lines


def _decision_text(job: JobRecord) -> str:
    """What a fleet scaling decision did (``1 -> 2 panic``), from its recorded input; ``-``
    for any other job."""
    body = job.input
    if job.kind != "fleet.scale" or not {"from_replicas", "to_replicas", "reason"} <= set(body):
        return "-"
    return f"{body['from_replicas']} -> {body['to_replicas']} {body['reason']}"


def last_error(job: JobRecord, steps: Sequence[StepRecord]) -> dict[str, str] | None:
    """The job's error, else the most recent failed step's (a retried job keeps only that)."""
    if job.error is not None:
        return {"code": job.error.code, "message": job.error.message}
    for record in reversed(steps):
        if record.error is not None:
            return {"code": record.error.code, "message": record.error.message, "step": record.name}
    return None


def job_outcome_line(job: JobRecord) -> str:
    """One line saying how a job ended (or where it stands)."""
    line = f"{job.id}: {job.status.value}"
    if job.started_at_ms is not None and job.ended_at_ms is not None:
        line += f" in {duration_text(job.ended_at_ms - job.started_at_ms)}"
    if job.error is not None:
        line += f": {job.error.code}: {job.error.message}"
    return line


def _step_rows(steps: Sequence[StepRecord]) -> list[str]:
    rows = []
    for record in steps:
        took = (
            duration_text(record.ended_at_ms - record.started_at_ms)
            if record.ended_at_ms is not None
            else "-"
        )
        error = f"{record.error.code}: {record.error.message}" if record.error else ""
        rows.append(
            (str(record.seq), record.name, record.status.value, str(record.attempts), took, error)
        )
    return align(("SEQ", "STEP", "STATUS", "ATTEMPTS", "TOOK", "ERROR"), rows)


def _lease_text(job: JobRecord, lease_now: LeaseTime) -> str:
    """``expires in 9s``, or how the lease lapsed, judged on the lease clock only."""
    remaining = job.lease.remaining_ms(lease_now) if job.lease else None
    # Its owner stopped renewing (killed, or the machine went away): the next process that
    # opens this journal with work to do takes it over and resumes it.
    then = "resumed by the next worker or rerun"
    if remaining is None:
        return f"lapsed: not renewed on this boot's clock; {then}"
    if remaining >= 0:
        return f"expires in {remaining // _SECOND_MS}s"
    return f"expired {_ago(-remaining)}; {then}"


def show_lines(
    job: JobRecord,
    steps: Sequence[StepRecord],
    *,
    now_ms: int,
    lease_now: LeaseTime,
    stale: Staleness | None = None,
) -> list[str]:
    """The ``jobs show`` text: summary, times, lease, progress, error, then the journal.

    Args:
        job: The job.
        steps: Its journal.
        now_ms: Wall-clock now (epoch ms), for the ages of its timestamps.
        lease_now: Lease-clock now, read after ``job``, for whether its lease is live.
        stale: The job's staleness when it is stale (a ``stale`` line: age, why, last step
            and owner, then who resumes it).
    """
    lines = [
        f"{job.id}  {job.kind} v{job.workflow_version}  {job.status.value} (attempt {job.attempt})",
        f"  subject    {job.subject or '-'}",
        f"  key        {job.idempotency_key or '-'}",
        f"  created    {_local_time(job.created_at_ms)} ({age_text(job.created_at_ms, now_ms)})",
    ]
    if job.started_at_ms is not None:
        lines.append(f"  started    {_local_time(job.started_at_ms)}")
    if job.ended_at_ms is not None:
        took = duration_text(job.ended_at_ms - (job.started_at_ms or job.created_at_ms))
        lines.append(f"  ended      {_local_time(job.ended_at_ms)} (took {took})")
    if job.status == JobStatus.RUNNING and job.lease_owner:
        lines.append(f"  lease      {job.lease_owner} ({_lease_text(job, lease_now)})")
    if stale is not None:
        lines.append(f"  stale      {stale_text(stale)}")
        lines.append(f"             {resume_hint(job.kind)}")
    if job.cancel_requested and not job.terminal:
        lines.append("  cancel     requested; stops at the next step boundary")
    if job.progress:
        step_name = job.progress.get("step")
        where = f"{step_name} " if step_name else ""
        lines.append(f"  progress   {where}{progress_text(job.progress)}")
    error = last_error(job, steps)
    if error is not None:
        where = f" (step {error['step']})" if "step" in error else ""
        lines.append(f"  error      {error['code']}{where}: {error['message']}")
    if job.output is not None:
        preview = json.dumps(job.output, separators=(",", ":"), ensure_ascii=False)
        if len(preview) > _OUTPUT_PREVIEW_CHARS:
            preview = preview[: _OUTPUT_PREVIEW_CHARS - 1] + "…"
        lines.append(f"  output     {preview}")
    if steps:
        lines.append("")
        lines.extend(f"  {row}" for row in _step_rows(steps))
    else:
        lines.append("  steps      none yet")
    return lines
