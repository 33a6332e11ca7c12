"""Running a job in this process while its events stream to stderr.

``jobs retry`` (a re-queued job) and ``models pull`` / ``models import`` (a submitted or
joined pull job) run the job through :meth:`WorkflowEngine.join` -- which claims it, or waits
for a live owner elsewhere, or recovers it from a dead one -- and follow the journal's events
of the same job at the same time, so what the reader sees is what the journal records,
whichever process does the work.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio

from sbproxy.cli._event_view import EventView, open_view
from sbproxy.errors import sole_error
from sbproxy.store import JobRecord, wall_clock_ms
from sbproxy.workflows import WorkflowEngine

__all__ = ["follow", "run_followed"]


async def follow(
    engine: WorkflowEngine,
    job_id: str,
    *,
    after_seq: int,
    view: EventView,
    on_idle: Callable[[JobRecord], Awaitable[None]] | None = None,
) -> None:
    """Feed the events of ``job_id`` after ``after_seq`` to ``view`` until the job finishes.

    ``on_idle`` is awaited with the job whenever the journal had nothing new (after the
    backlog, so what it shows comes after the history).
    """
    try:
        async for event in engine.follow(job_id, after_seq=after_seq, on_idle=on_idle):
            view.show(event)
    finally:
        view.close()


async def run_followed(engine: WorkflowEngine, job_id: str, *, after_seq: int = 0) -> JobRecord:
    """Run ``job_id`` here until it finishes or is parked, showing its events on stderr.

    Events up to ``after_seq`` are not shown; those written before this call (a joined or
    resumed job's history) are replayed with their progress collapsed. When the run ends the
    follower is stopped and the journal read once more for the last events, rather than
    waiting out the follower's poll interval.

    Raises:
        SbproxyError: whatever running the job raised (``unknown_workflow``, a journal that
            cannot be written: ``disk_full`` ...), unwrapped from the task group.
    """
    view = open_view(job_id, live_from_ms=wall_clock_ms())
    last = after_seq

    async def watch() -> None:
        nonlocal last
        async for event in engine.follow(job_id, after_seq=after_seq):
            view.show(event)
            last = event.seq

    try:
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(watch)
                try:
                    await engine.join(job_id)
                finally:
                    group.cancel_scope.cancel()
        except ExceptionGroup as wrapped:
            # The task group wraps what the run raised (a full journal, ...): callers report
            # an SbproxyError by its code, so hand them the error itself.
            error = sole_error(wrapped)
            if error is None:
                raise
            raise error from None
        for event in await engine.store.events(job_id, after_seq=last):
            view.show(event)
    finally:
        view.close()
    return await engine.get(job_id)
