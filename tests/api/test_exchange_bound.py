"""ExchangeBound on its own: which cancellations it swallows and which it lets through.

The HTTP tests (``test_supervision.py``) cover the limits and disconnects end to end; these
pin the cancellation rules of the synchronous bound, which cancels its own task the way
``asyncio.timeout`` does: it swallows its own cancellation only, and an outside one (a
shutdown, the server) always passes through -- also when both come together. No test waits
for time to pass: deadlines are set to "now" and the watch starts on the next loop turn.
"""

from __future__ import annotations

import asyncio

import pytest
from litestar.types import HTTPDisconnectEvent

from sbproxy.api.supervision import ExchangeBound

pytestmark = pytest.mark.anyio


class Channel:
    """An ASGI ``receive`` whose client disconnects when told to; counts the calls."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()
        self.calls = 0

    async def __call__(self) -> HTTPDisconnectEvent:
        self.calls += 1
        await self.gone.wait()
        return {"type": "http.disconnect"}


async def test_a_deadline_that_passes_ends_the_block_and_is_swallowed() -> None:
    bound = ExchangeBound(Channel())
    with bound:
        bound.set_deadline(asyncio.get_running_loop().time())
        await asyncio.Event().wait()  # never set: only the deadline ends this
    assert bound.cancelled_caught
    assert not bound.disconnected
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


async def test_a_client_that_leaves_ends_the_block_once_watched() -> None:
    channel = Channel()
    bound = ExchangeBound(channel, watch_after_s=0)
    with bound:
        bound.set_deadline(asyncio.get_running_loop().time() + 3600)
        while channel.calls == 0:  # the watch starts on the next loop turn
            await asyncio.sleep(0)
        channel.gone.set()
        await asyncio.Event().wait()
    assert bound.cancelled_caught
    assert bound.disconnected


async def test_a_block_that_ends_first_is_never_watched_nor_cancelled() -> None:
    channel = Channel()
    bound = ExchangeBound(channel)
    with bound:
        bound.set_deadline(asyncio.get_running_loop().time() + 3600)
        await asyncio.sleep(0)
    assert not bound.cancelled_caught
    assert channel.calls == 0  # no watcher task was started


async def test_an_outside_cancellation_passes_through() -> None:
    inside = asyncio.Event()

    async def exchange() -> ExchangeBound:
        bound = ExchangeBound(Channel())
        with bound:
            bound.set_deadline(asyncio.get_running_loop().time() + 3600)
            inside.set()
            await asyncio.Event().wait()
        return bound

    task = asyncio.get_running_loop().create_task(exchange())
    await inside.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_outside_cancellation_with_its_own_deadline_still_passes_through() -> None:
    async def exchange() -> None:
        bound = ExchangeBound(Channel())
        with bound:
            bound.set_deadline(asyncio.get_running_loop().time())  # fires next turn
            task = asyncio.current_task()
            assert task is not None
            task.cancel()  # and a shutdown asks at the same time
            await asyncio.Event().wait()

    task = asyncio.get_running_loop().create_task(exchange())
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_async_with_works_the_same() -> None:
    bound = ExchangeBound(Channel())
    async with bound:
        bound.set_deadline(asyncio.get_running_loop().time())
        await asyncio.Event().wait()
    assert bound.cancelled_caught
