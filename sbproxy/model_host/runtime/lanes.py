"""Every deployment's command lane (:class:`~sbproxy.model_host.runtime.commands.CommandQueue`)
and the frames runtime jobs run in: a step's cancellable scope, a reload's exclusive turn.

Pure bookkeeping on one event loop, composed into the runtime manager: nothing here starts
an engine or writes the journal.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager

from sbproxy.model_host.runtime.commands import CommandKind, CommandQueue
from sbproxy.workflows.errors import JobCancelled

__all__ = ["CommandLanes"]


class CommandLanes:
    """The command queues by deployment id (kept across reloads)."""

    def __init__(self) -> None:
        self._queues: dict[str, CommandQueue] = {}
        # Command submissions under way (job adoption skips a pass that overlaps one: the
        # submitted job is in the journal before it is in its command's lane).
        self._submits_started = 0
        self._submits_in_flight = 0

    def queue(self, deployment: str) -> CommandQueue:
        """The command queue of ``deployment`` (created on first use)."""
        found = self._queues.get(deployment)
        if found is None:
            found = self._queues[deployment] = CommandQueue(deployment)
        return found

    def pending(self, deployment: str) -> bool:
        """Whether ``deployment`` has an unfinished command."""
        found = self._queues.get(deployment)
        return found is not None and bool(found.pending)

    def holds(self, job_id: str) -> bool:
        """Whether some lane carries ``job_id`` now."""
        return any(queue.find(job_id) is not None for queue in self._queues.values())

    @contextmanager
    def submitting(self) -> Iterator[None]:
        """Count one command submission while the body runs (see :meth:`quiet_since`)."""
        self._submits_started += 1
        self._submits_in_flight += 1
        try:
            yield
        finally:
            self._submits_in_flight -= 1

    def mark(self) -> tuple[int, int]:
        """A mark for :meth:`quiet_since`: submissions started and in flight now."""
        return self._submits_started, self._submits_in_flight

    def quiet_since(self, mark: tuple[int, int]) -> bool:
        """Whether no submission was in flight at ``mark`` or since."""
        started, in_flight = mark
        return not in_flight and not self._submits_in_flight and started == self._submits_started

    @asynccontextmanager
    async def step_scope(
        self, job_id: str, deployment: str, kind: CommandKind
    ) -> AsyncIterator[None]:
        """The frame a runtime job's step runs in: the command's cancellable scope (a later
        stop cancels a load's steps), or -- for a job run outside a command, e.g. straight
        from ``join`` in a test -- a turn of its own in the deployment's queue.

        Raises:
            JobCancelled: ``cancelled`` when a later command superseded this one.
        """
        queue = self.queue(deployment)
        command = queue.find(job_id)
        async with AsyncExitStack() as stack:
            if command is None:
                command, _ = queue.submit(kind, reason="job", join=False)
                command.assign(job_id)
                await stack.enter_async_context(queue.turn(command))
            scope = await stack.enter_async_context(command.live())
            yield
        if scope.cancelled_caught or command.superseded_by is not None:
            raise JobCancelled(f"job {job_id} was superseded by a later command on {deployment}")

    @asynccontextmanager
    async def exclusive(self, deployments: Iterable[str], *, job_id: str) -> AsyncIterator[None]:
        """Hold a turn on each of ``deployments`` (a reload's rollout or commit): every
        earlier command on them finishes first, later ones wait until the body ends."""
        async with AsyncExitStack() as stack:
            entered = []
            for deployment in sorted(set(deployments)):
                queue = self.queue(deployment)
                command, _ = queue.submit(CommandKind.RELOAD, reason="reload", join=False)
                command.assign(job_id)
                entered.append((queue, command))
            for queue, command in entered:
                await stack.enter_async_context(queue.turn(command))
            yield
