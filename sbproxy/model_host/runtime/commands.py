"""Commands on one deployment, applied one at a time in arrival order; the last one wins.

Every lifecycle command -- ``load``, ``stop`` (drain), ``reset``, a reload's rollout -- is
entered in its deployment's :class:`CommandQueue` the moment it arrives (synchronously, so
the order is the order callers asked), and runs only after every earlier command of that
deployment has finished. Two rules make "the last command wins" true:

* a ``stop`` supersedes every earlier ``load`` of its deployment: one still waiting never
  runs, and one running has its live work cancelled (:meth:`Command.cancel_live`) -- a
  launch in progress stops its child and the load job ends ``cancelled``;
* a ``load`` arriving while another ``load`` is the newest command joins it (concurrent cold
  starts share one launch); after a ``stop`` it queues behind that stop, so stop-then-load
  ends ready.

Pure bookkeeping on one event loop: nothing here starts or stops a process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from enum import StrEnum

import anyio

from sbproxy.errors import SbproxyError

__all__ = ["Command", "CommandKind", "CommandQueue"]


class CommandKind(StrEnum):
    """What a command asks of its deployment."""

    LOAD = "load"
    STOP = "stop"
    RESET = "reset"
    RELOAD = "reload"


@dataclass(eq=False)
class Command:
    """One command in a deployment's queue.

    Attributes:
        seq: Arrival number within the queue (1-based).
        kind: What it asks.
        reason: Why (``request``, ``admin``, ``keep_alive``, ``engine_unhealthy``, ...).
        job_id: The durable job that carries it out, once submitted.
        superseded_by: The later command that made this one moot (a load after a stop).
        refused: Why its job could not be submitted (e.g. ``journal_unavailable``), if so.
    """

    seq: int
    kind: CommandKind
    reason: str
    job_id: str | None = None
    superseded_by: int | None = None
    # False once the command's launch is done: a later load must not join it (the engine
    # it started may already be gone).
    joinable: bool = True
    refused: SbproxyError | None = None
    done: anyio.Event = field(default_factory=anyio.Event)
    assigned: anyio.Event = field(default_factory=anyio.Event)
    _scopes: list[anyio.CancelScope] = field(default_factory=list)

    def assign(self, job_id: str) -> None:
        """Record the job that carries the command out."""
        self.job_id = job_id
        self.assigned.set()

    def cancel_live(self) -> None:
        """Cancel the live work registered with :meth:`live` (a launch in progress)."""
        for scope in self._scopes:
            scope.cancel()

    @asynccontextmanager
    async def live(self) -> AsyncIterator[anyio.CancelScope]:
        """A cancel scope a superseding command cancels; check ``cancelled_caught`` after."""
        with anyio.CancelScope() as scope:
            if self.superseded_by is not None:
                scope.cancel()
            self._scopes.append(scope)
            try:
                yield scope
            finally:
                self._scopes.remove(scope)


class CommandQueue:
    """The commands of one deployment (see the module docstring)."""

    def __init__(self, deployment: str) -> None:
        self.deployment = deployment
        self._pending: list[Command] = []
        self._seq = 0

    @property
    def pending(self) -> tuple[Command, ...]:
        """Unfinished commands, oldest first."""
        return tuple(self._pending)

    def submit(self, kind: CommandKind, *, reason: str, join: bool = True) -> tuple[Command, bool]:
        """Enter a command; ``(command, created)``.

        A ``load`` joins the newest command when that is an unsuperseded ``load`` (unless
        ``join`` is false: a recovered job brings its own). A ``stop`` supersedes every
        pending ``load`` and cancels their live work.
        """
        if kind is CommandKind.LOAD and join and self._pending:
            newest = self._pending[-1]
            if newest.kind is CommandKind.LOAD and newest.superseded_by is None and newest.joinable:
                return newest, False
        self._seq += 1
        command = Command(seq=self._seq, kind=kind, reason=reason)
        if kind is CommandKind.STOP:
            for earlier in self._pending:
                if earlier.kind is CommandKind.LOAD and earlier.superseded_by is None:
                    earlier.superseded_by = command.seq
                    earlier.cancel_live()
        self._pending.append(command)
        return command, True

    def close_joins(self) -> None:
        """The pending loads did their launch: a later load gets a command of its own."""
        for command in self._pending:
            if command.kind is CommandKind.LOAD:
                command.joinable = False

    def find(self, job_id: str) -> Command | None:
        """The pending command carried out by ``job_id``."""
        return next((c for c in self._pending if c.job_id == job_id), None)

    def later_than(self, command: Command) -> tuple[Command, ...]:
        """Pending commands that arrived after ``command``."""
        return tuple(c for c in self._pending if c.seq > command.seq)

    @asynccontextmanager
    async def turn(self, command: Command) -> AsyncIterator[None]:
        """Wait until every earlier command finished, run the body, then finish ``command``.

        The command finishes (and leaves the queue) however the body ends.
        """
        try:
            for earlier in list(self._pending):
                if earlier.seq >= command.seq:
                    break
                await earlier.done.wait()
            yield
        finally:
            self.finish(command)

    def finish(self, command: Command) -> None:
        """Mark ``command`` done and drop it (idempotent)."""
        command.done.set()
        command.assigned.set()
        if command in self._pending:
            self._pending.remove(command)
