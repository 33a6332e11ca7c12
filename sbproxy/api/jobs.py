"""Admin routes of the durable jobs: list, show, follow (SSE), cancel, retry.

``GET /admin/model-host/jobs/{id}/stream`` is Server-Sent Events:

* a comment ``: connected`` first;
* unless the client resumes, a snapshot frame ``data: {"type": "job", "job": {...}}``
  (without ``id:``, so it does not move the client's cursor);
* one frame per journal event, ``id: <seq>`` and ``data: <event JSON>`` (the event's
  ``type`` is inside the JSON). ``seq`` is durable and strictly increasing across restarts,
  so ``Last-Event-ID: <seq>`` resumes after that event even against a restarted server;
  a browser's ``EventSource`` cannot set that header on its first request, so the query
  parameter ``?after=<seq>`` does the same (the header wins when both are sent: it is what
  ``EventSource`` sends on each reconnection);
* when the job is terminal (or parked), a last snapshot frame, then the stream closes.

Unlike the reference (which waits forever on an unknown id), a malformed id is a 400 and an
unknown one a 404 before the stream starts.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from litestar import Request, Router, get, post
from litestar.params import FromPath, FromQuery
from litestar.response import Stream
from ulid import ULID

from sbproxy.api.errors import ApiError, InvalidJobId
from sbproxy.model_host.service import ModelHostService
from sbproxy.store import JobRecord, JobStatus

__all__ = ["jobs_router"]

# Jobs listed at most (the journal keeps the latest 256 finished ones plus the active ones).
LIST_LIMIT = 1000


class InvalidLastEventId(ApiError):
    """``Last-Event-ID`` is not a non-negative integer (``invalid_last_event_id``)."""

    default_code = "invalid_last_event_id"


class JobNotRetryable(ApiError):
    """Only failed or parked jobs can be retried (``job_not_retryable``)."""

    default_code = "job_not_retryable"


def check_job_id(job_id: str) -> str:
    """``job_id`` if it is a ULID.

    Raises:
        InvalidJobId: ``invalid_job_id``.
    """
    try:
        ULID.from_str(job_id)
    except ValueError:
        raise InvalidJobId(
            "operation job ID must be a ULID", details={"job_id": job_id[:64]}
        ) from None
    return job_id


def _frame(data: dict[str, Any], *, seq: int | None = None) -> bytes:
    head = f"id: {seq}\n" if seq is not None else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _job(job: JobRecord) -> dict[str, Any]:
    return {"schema_version": 1, "job": job.to_dict()}


def jobs_router(
    service: Callable[[], ModelHostService],
    spawn: Callable[[Callable[[], Awaitable[object]]], None],
) -> Router:
    """The ``/model-host/jobs`` routes over the jobs of the facade ``service()`` returns (one
    per request; mounted under ``/admin``); ``spawn`` starts background work (a retried
    job)."""

    @get("/")
    async def list_jobs() -> dict[str, Any]:
        """Active and retained jobs, oldest first."""
        jobs = await service().jobs(limit=LIST_LIMIT)
        jobs.sort(key=lambda job: (job.created_at_ms, job.id))
        return {"schema_version": 1, "jobs": [job.to_dict() for job in jobs]}

    @get("/{job_id:str}")
    async def show_job(job_id: FromPath[str]) -> dict[str, Any]:
        """One job with its journal steps."""
        facade = service()
        job = await facade.job(check_job_id(job_id))
        steps = await facade.job_steps(job.id)
        body = _job(job)
        body["steps"] = [entry.to_dict() for entry in steps]
        return body

    @get("/{job_id:str}/stream")
    async def stream_job(
        job_id: FromPath[str],
        request: Request[Any, Any, Any],
        after: FromQuery[str | None] = None,
    ) -> Stream:
        """Follow a job's events as SSE (see the module docstring)."""
        facade = service()
        job = await facade.job(check_job_id(job_id))
        raw = request.headers.get("last-event-id", after)
        after_seq: int | None = None
        if raw is not None:
            if not raw.strip().isdigit():
                raise InvalidLastEventId(
                    "Last-Event-ID must be the integer id of an event frame",
                    details={"last_event_id": raw[:64]},
                )
            after_seq = int(raw.strip())

        async def frames() -> AsyncIterator[bytes]:
            yield b": connected\n\n"
            if after_seq is None:
                yield _frame({"type": "job", **_job(job)})
            async for event in facade.follow_job(job.id, after_seq=after_seq or 0):
                yield _frame(event.to_dict(), seq=event.seq)
            final = await facade.job(job.id)
            yield _frame({"type": "job", **_job(final)})

        return Stream(
            frames(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "Connection": "keep-alive"},
        )

    @post("/{job_id:str}/cancel", status_code=200)
    async def cancel_job(job_id: FromPath[str]) -> dict[str, Any]:
        """Request cancellation (immediate when queued, cooperative when running)."""
        return _job(await service().cancel_job(check_job_id(job_id)))

    @post("/{job_id:str}/retry", status_code=200)
    async def retry_job(job_id: FromPath[str]) -> dict[str, Any]:
        """Re-queue a failed or parked job; the worker loop resumes it."""
        facade = service()
        job = await facade.retry_job(check_job_id(job_id))
        if job.status != JobStatus.QUEUED:
            raise JobNotRetryable(
                f"job {job_id} is {job.status.value}; only failed or parked jobs can be retried",
                details={"job_id": job_id},
            )
        spawn(lambda: facade.run(job))
        return _job(job)

    return Router(
        path="/model-host/jobs",
        route_handlers=[list_jobs, show_job, stream_job, cancel_job, retry_job],
    )
