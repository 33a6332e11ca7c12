"""The runtime's background work: :class:`HostTasks` runs it on the host's task group and
knows when the host is closing; :func:`contained` keeps one task's end from ending the host."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable

import anyio
import anyio.abc

__all__ = ["HostTasks", "contained"]

logger = logging.getLogger(__name__)


async def contained(work: Callable[[], Awaitable[object]], *, what: str) -> None:
    """Run one background task of the host so that its end never ends the host.

    A task on the host's task group that raises takes the whole group down; one that ends
    with a cancellation that is not the group's own (a ``CancelledError`` re-raised from
    a cancelled inner task) cancels the group *silently*, and the server once exited with
    status 0 that way. Here the group's own cancellation passes through; any other is
    logged and swallowed, and so is an error (logged with its traceback: it is a bug).
    """
    try:
        await work()
    except anyio.get_cancelled_exc_class():
        if anyio.current_effective_deadline() == -math.inf:
            raise  # the host is stopping: this task's cancellation is the group's own
        logger.error("%s ended with a stray cancellation; the host stays up", what)
    except Exception:
        logger.exception("%s failed; the host stays up", what)


class HostTasks:
    """The host's task group (set at start), the count of counted background tasks a
    shutdown waits for, the shutdown's deadline once it began (``anyio`` time), and whether
    the host is stopping at once (a second stop signal killed its engines: their exits are
    the stop's, not failures)."""

    def __init__(self) -> None:
        self.group: anyio.abc.TaskGroup | None = None
        self.running = 0
        self.closing_at: float | None = None
        self.stopping_now = False

    @property
    def started(self) -> bool:
        """Whether the host's task group is set (commands run only then)."""
        return self.group is not None

    def background(self, work: Callable[[], Awaitable[object]]) -> None:
        """Run ``work`` on the task group, counted so that a shutdown waits for it (up to
        the deadline) instead of cancelling it mid-write."""
        if self.group is None:
            return
        self.running += 1

        async def run() -> None:
            try:
                await contained(work, what="a runtime task")
            finally:
                self.running -= 1

        self.group.start_soon(run)

    def start_contained(self, work: Callable[[], Awaitable[object]], *, what: str) -> None:
        """Run ``work`` on the task group, not counted by a shutdown (a watcher that ends
        with the host), contained as :func:`contained` says."""
        if self.group is not None:
            self.group.start_soon(lambda: contained(work, what=what))

    def remaining_s(self, wanted_s: float) -> float:
        """``wanted_s``, or less when a shutdown's deadline comes sooner."""
        if self.closing_at is None:
            return wanted_s
        return max(0.0, min(wanted_s, self.closing_at - anyio.current_time()))
