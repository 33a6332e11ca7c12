"""Background tasks of the host never end the host: a stray cancellation or an error in
one is logged and contained; the task group's own cancellation still stops it."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from sbproxy.model_host.runtime.manager import contained

pytestmark = pytest.mark.anyio


async def _stray_cancellation() -> None:
    """Await a task that was cancelled: its ``CancelledError`` reaches the awaiting task
    although nobody cancelled that task (what a twice-settled engine once did)."""
    inner = asyncio.get_running_loop().create_task(asyncio.sleep(60))
    inner.cancel()
    await asyncio.wait({inner})
    await inner


async def _fails() -> None:
    raise RuntimeError("a bug in a background task")


async def test_a_stray_cancellation_or_an_error_does_not_cancel_the_host_group(
    caplog: pytest.LogCaptureFixture,
) -> None:
    survived = anyio.Event()

    async def sibling() -> None:
        await anyio.sleep(0.05)
        survived.set()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: contained(_stray_cancellation, what="the stray task"))
            group.start_soon(lambda: contained(_fails, what="the failing task"))
            group.start_soon(sibling)
    assert survived.is_set()
    assert "the stray task ended with a stray cancellation" in caplog.text
    assert "the failing task failed" in caplog.text


async def test_the_group_own_cancellation_still_stops_a_contained_task() -> None:
    finished = False

    async def forever() -> None:
        nonlocal finished
        await anyio.sleep(60)
        finished = True

    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: contained(forever, what="a long task"))
            await anyio.sleep(0.05)
            group.cancel_scope.cancel()
    assert not finished
