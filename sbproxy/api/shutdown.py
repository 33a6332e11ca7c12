"""The stop of a serving host: one deadline, from the signal to the last engine.

``D`` is ``proxy.model_host.shutdown_deadline_ms``, read from the runtime manager when the
signal arrives (so a reloaded value counts). Times are on the event loop's monotonic clock.

* **Signal** (SIGTERM or SIGINT, :meth:`Shutdown.request`): one log line names the signal
  and the deadline; both listeners stop accepting and close their idle connections;
  requests in flight keep running.
* **Drain deadline** (signal + ``D``, :meth:`Shutdown.enforce`): every request still in
  flight on either listener is ended by its :class:`Shutdown.guard`: a client still waiting
  for its answer gets a 503 ``shutting_down`` error (the listener's error shape, from
  :mod:`sbproxy.api.errors`); a stream already under way gets a last error event and a
  well-formed end. Ending a gateway request closes its upstream connection and frees its
  admission permit, so the deployment drains at once.
* **Engines** (:meth:`Shutdown.engine_budget_s`): the runtime manager then has what is left
  until ``deadline + ENGINE_STOP_S`` to let loads settle, drain the deployments and stop
  their engines (SIGTERM, then SIGKILL).
* **A second signal** makes the drain deadline *now* and leaves the engines no grace: the
  requests still in flight are ended and every engine gets SIGKILL (:meth:`Shutdown.on_hurry`),
  even one the manager is already stopping; later signals are ignored.

Together that is ``D + ENGINE_STOP_S`` for the work, and the rest of the 2 s beyond ``D``
the process is allowed covers closing the listeners and the journal. uvicorn's own graceful
timeout is set behind the drain deadline (``LISTENER_BACKSTOP_S``): it fires only for a
request that ignored being ended, and the guard answers that one cleanly too, so no path
prints a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final, cast

import anyio
import uvicorn
from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from sbproxy.api.access import note_shutting_down
from sbproxy.api.errors import ShuttingDown, Surface, error_event, error_payload

if TYPE_CHECKING:
    from sbproxy.model_host.runtime.manager import RuntimeManager

__all__ = ["ENGINE_STOP_S", "LISTENER_BACKSTOP_S", "Shutdown"]

logger = logging.getLogger(__name__)

# Seconds the engines get past the drain deadline to exit on SIGTERM before SIGKILL; a
# llama-server frees its model in well under this.
ENGINE_STOP_S: Final = 1.0
# Seconds past the drain deadline after which uvicorn cancels a request itself.
LISTENER_BACKSTOP_S: Final = 0.5

_ENDED_MESSAGE = (
    "the host is shutting down and ended this request unfinished (its drain deadline, "
    "proxy.model_host.shutdown_deadline_ms, passed or a second stop signal came); retry "
    "against another replica or once the host is back"
)


class Shutdown:
    """The stop of one serving host (see the module docstring).

    Create it on the event loop that serves. :meth:`enforce` must run (as a task) for as
    long as anything may request a stop.

    Args:
        deadline_s: The drain deadline in seconds, used until :meth:`follow` names the
            runtime manager (a stop requested while the host is still starting).
    """

    def __init__(self, *, deadline_s: float) -> None:
        self.signal: signal.Signals | None = None
        # Loop-clock instant at which requests still in flight are ended.
        self.deadline: float | None = None
        self.forced = False
        # The drain deadline has passed: in-flight requests were ended; new ones are refused.
        self.drain_over = False
        self._deadline_s = deadline_s
        self._manager: RuntimeManager | None = None
        self._listeners: list[uvicorn.Server] = []
        # Each request in flight: its task and its scope.
        self._in_flight: dict[asyncio.Task[Any], Scope] = {}
        self._requested = anyio.Event()
        self._hurried = anyio.Event()
        self._hurry_actions: list[Callable[[], object]] = []

    @property
    def requested(self) -> bool:
        """Whether a stop was requested."""
        return self.signal is not None

    async def wait_requested(self) -> None:
        """Return once a stop is requested (a signal, or :meth:`stop_self`)."""
        await self._requested.wait()

    def follow(self, manager: RuntimeManager) -> None:
        """Take the drain deadline from ``manager`` when the stop comes."""
        self._manager = manager

    def attach(self, listeners: Sequence[uvicorn.Server]) -> None:
        """Stop ``listeners`` with the host (at once, if the stop came already)."""
        self._listeners = list(listeners)
        if self.requested:
            self._stop_listeners()

    def stop_self(self, reason: str) -> None:
        """Stop without a signal (``sbproxy run`` whose model failed to load): drain as for
        SIGTERM, logging ``reason`` -- never a "received SIGTERM" line nobody sent."""
        if self.deadline is not None:
            return
        deadline_s = self._manager.shutdown_deadline_s if self._manager else self._deadline_s
        self.signal = signal.SIGTERM
        self.deadline = anyio.current_time() + deadline_s
        logger.info("stopping: %s", reason)
        self._requested.set()
        self._stop_listeners()

    def request(self, signum: int) -> None:
        """A stop signal arrived: drain until the deadline; a second one stops at once."""
        now = anyio.current_time()
        name = signal.Signals(signum).name
        if self.deadline is None:
            deadline_s = self._manager.shutdown_deadline_s if self._manager else self._deadline_s
            self.signal = signal.Signals(signum)
            self.deadline = now + deadline_s
            logger.info(
                "received %s: draining; requests in flight have %g s "
                "(proxy.model_host.shutdown_deadline_ms), then what is left is ended and the "
                "engines stop; send %s again to stop at once",
                name,
                deadline_s,
                name,
            )
            self._requested.set()
        elif not self.forced:
            self.forced = True
            self.deadline = min(self.deadline, now)
            logger.warning("received %s again: ending every request now, killing the engines", name)
            self._hurried.set()
            if self.drain_over:  # requests were ended already: the engines may be stopping
                self._hurry()
        else:
            return
        self._stop_listeners()

    def _stop_listeners(self) -> None:
        assert self.deadline is not None  # noqa: S101 - set by request()
        left_s = max(0.0, self.deadline - anyio.current_time())
        for server in self._listeners:
            # uvicorn reads this when its graceful phase begins (a whole number of seconds).
            server.config.timeout_graceful_shutdown = math.ceil(left_s + LISTENER_BACKSTOP_S)
            server.should_exit = True

    async def enforce(self) -> None:
        """At the drain deadline (or a second signal), end every request still in flight.

        Runs until then; cancel it when the host has stopped without a signal.
        """
        await self._requested.wait()
        assert self.deadline is not None  # noqa: S101 - set with the event
        with anyio.CancelScope(deadline=self.deadline):
            await self._hurried.wait()
        self.drain_over = True
        if self._in_flight:
            logger.warning(
                "%s: ending %d request(s) still in flight (shutting_down)",
                "stopping now" if self.forced else "drain deadline",
                len(self._in_flight),
            )
        for task, scope in list(self._in_flight.items()):
            # Logged as ended here (shutting_down), not as a client that went away.
            note_shutting_down(scope)
            task.cancel()
        if self.forced:
            # After the cancellations, so an ended request answers shutting_down rather
            # than seeing its engine vanish first.
            self._hurry()

    def on_hurry(self, action: Callable[[], object]) -> None:
        """Run ``action`` (quick, synchronous) when a second signal comes, once the requests
        in flight were told to end: the host kills its engines with it."""
        self._hurry_actions.append(action)

    def _hurry(self) -> None:
        for action in self._hurry_actions:
            action()

    def track(self, task: asyncio.Task[Any], scope: Scope) -> None:
        """Count ``task`` (serving the request of ``scope``) as in flight until
        :meth:`untrack`: at the drain deadline it is cancelled (a native cancellation, which
        its guard recognises by :attr:`requested`).

        The task itself, not a cancel scope around the request: this runs for every request,
        and an anyio cancel scope (or an ``asyncio.timeout``) costs several times as much
        (``benchmarks/proxy.py``).
        """
        self._in_flight[task] = scope

    def untrack(self, task: asyncio.Task[Any]) -> None:
        """The request of ``task`` ended (idempotent)."""
        self._in_flight.pop(task, None)

    def engine_budget_s(self) -> float | None:
        """Seconds the runtime manager may still spend settling loads, draining and stopping
        engines: what is left until ``deadline + ENGINE_STOP_S``; 0 after a second signal
        (SIGKILL at once); ``None`` when no stop was requested (the host stops for another
        reason, and the configured deadline applies)."""
        if self.deadline is None:
            return None
        if self.forced:
            return 0.0
        return max(0.0, self.deadline + ENGINE_STOP_S - anyio.current_time())

    def guard(self, app: ASGIApp, *, surface: Surface) -> ASGIApp:
        """``app`` with its HTTP requests ended cleanly at the drain deadline; ``surface``
        chooses the error shape (OpenAI envelope or admin body)."""
        return _Guard(self, app, surface)


class _Progress:
    """How far a request's answer got: its start message (``None`` before it went out) and
    whether its last body message went out."""

    __slots__ = ("complete", "start")

    def __init__(self) -> None:
        self.start: Message | None = None
        self.complete = False

    @property
    def event_stream(self) -> bool:
        """Whether the answer that started is an event stream (read only when ending it)."""
        if self.start is None:
            return False
        headers = cast("Iterable[tuple[bytes, bytes]]", self.start.get("headers", ()))
        for name, value in headers:
            if name.lower() == b"content-type":
                return value.startswith(b"text/event-stream")
        return False


class _Guard:
    """The ASGI wrapper of :meth:`Shutdown.guard`.

    Per message it only remembers the start message and whether the body ended; what the
    answer is (an event stream?) is looked at only when the guard has to end it.
    """

    __slots__ = ("app", "shutdown", "surface")

    def __init__(self, shutdown: Shutdown, app: ASGIApp, surface: Surface) -> None:
        self.shutdown = shutdown
        self.app = app
        self.surface = surface

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP:
            await self.app(scope, receive, send)
            return
        progress = _Progress()
        shutdown = self.shutdown
        if shutdown.drain_over:
            await self._end(send, progress)
            return

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                progress.start = message
                await send(message)
                return
            await send(message)
            if not message.get("more_body", False):
                progress.complete = True

        task = asyncio.current_task()
        assert task is not None  # noqa: S101 - an ASGI app runs in a task
        in_flight = shutdown._in_flight  # track() and untrack(), inlined: every request
        in_flight[task] = scope
        try:
            await self.app(scope, receive, tracked)
            ended = False
        except asyncio.CancelledError:
            if not shutdown.requested:
                raise
            # The drain deadline (Shutdown.enforce) or uvicorn's graceful timeout (the
            # backstop) cancelled the request's task: answer it cleanly and let the task end
            # normally.
            task.uncancel()
            ended = True
        finally:
            in_flight.pop(task, None)
        if ended and not progress.complete:
            await self._end(send, progress)

    async def _end(self, send: Send, progress: _Progress) -> None:
        """Finish the answer with ``shutting_down`` in whatever form it can still take."""
        error = ShuttingDown(_ENDED_MESSAGE)
        if progress.start is None:
            status, body, headers = error_payload(error, surface=self.surface)
            headers.append((b"connection", b"close"))
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
        elif progress.event_stream:
            last = error_event(error, surface=self.surface)
            await send({"type": "http.response.body", "body": last, "more_body": False})
        else:
            # A partly sent answer of declared length cannot end early: uvicorn refuses the
            # short body and closes the connection, which is all a client can be told.
            with contextlib.suppress(RuntimeError):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
