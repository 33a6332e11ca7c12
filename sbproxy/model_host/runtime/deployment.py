"""Live state of one deployment: a :class:`Deployment` owns its lifecycle fields and changes
them only through named methods.

Every state change is one call of :meth:`Deployment._move` -- a compare-and-set against
:data:`~sbproxy.model_host.runtime.state.DEPLOYMENT_TRANSITIONS`: the move names the states
it expects to find, and is refused (``illegal_transition``) when the deployment is in
another or the table forbids it. ``_move`` is synchronous: it logs, tells the owner's
synchronous hook (metrics, swap waiters) and *queues* the journal event in an
:class:`Outbox` that the owner drains afterwards, so a sequence of transitions (``preparing``
then ``failed``) never yields midway and no other task ever sees the state between them.

Only the runtime manager calls the mutating methods; readers outside the runtime get a
frozen :class:`~sbproxy.model_host.runtime.state.DeploymentStatus`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from sbproxy.catalog import ResolvedArtifact
from sbproxy.config import DeploymentConfig
from sbproxy.errors import SbproxyError
from sbproxy.model_host.artifacts import CachedMetadata
from sbproxy.model_host.artifacts.locks import DigestLease
from sbproxy.model_host.runtime.admission import AdmissionGate
from sbproxy.model_host.runtime.launcher import Engine
from sbproxy.model_host.runtime.memory import MemoryEstimate
from sbproxy.model_host.runtime.residency import ResidencyKey
from sbproxy.model_host.runtime.state import (
    DEPLOYMENT_TRANSITIONS,
    CrashLoop,
    DeploymentState,
    bounded,
)

__all__ = [
    "Deployment",
    "IllegalTransition",
    "Outbox",
    "Transition",
    "UnknownDeployment",
]

logger = logging.getLogger(__name__)

S = DeploymentState
_ANY: frozenset[DeploymentState] = frozenset(DeploymentState)


class UnknownDeployment(SbproxyError):
    """No deployment has this id (``unknown_deployment``)."""

    default_code = "unknown_deployment"


class IllegalTransition(SbproxyError):
    """A deployment state change the transition table forbids, or one from a state the
    caller did not expect (``illegal_transition``): a bug in the runtime, never an operator
    error."""

    default_code = "illegal_transition"


@dataclass(frozen=True, slots=True)
class Transition:
    """One state change, as the journal's ``deployment`` event records it.

    Attributes:
        deployment: The deployment id.
        generation: Its generation when it moved.
        before: The state it left.
        after: The state it entered.
        reason_code: Why, when there is a stable code.
        job_id: The job the event is recorded on (``None``: nowhere).
    """

    deployment: str
    generation: int
    before: DeploymentState
    after: DeploymentState
    reason_code: str | None
    job_id: str | None

    def event_data(self) -> dict[str, Any]:
        """The ``deployment`` event's data."""
        data: dict[str, Any] = {
            "deployment": self.deployment,
            "generation": self.generation,
            "from": self.before.value,
            "to": self.after.value,
        }
        if self.reason_code:
            data["reason_code"] = self.reason_code
        return data


class Outbox:
    """Transitions waiting to be journaled, in the order they happened (one per owner)."""

    def __init__(self) -> None:
        self._items: list[Transition] = []

    def put(self, transition: Transition) -> None:
        """Queue one transition (synchronous: never yields)."""
        self._items.append(transition)

    def take(self) -> list[Transition]:
        """Everything queued, oldest first; the outbox is empty after."""
        items, self._items = self._items, []
        return items

    def __len__(self) -> int:
        return len(self._items)


class Deployment:
    """Live state of one deployment (replica 0: this runtime is single-node).

    Read through the properties; change only through the named methods, each of which is
    synchronous. ``on_move`` is called (synchronously) with every transition, after it is
    queued in ``outbox``.

    Args:
        deployment: The deployment id.
        config: Its definition.
        gate: Its admission gate.
        outbox: Where transitions queue for the journal.
        on_move: The owner's synchronous hook (counts, wake-ups).
    """

    def __init__(
        self,
        deployment: str,
        config: DeploymentConfig,
        *,
        gate: AdmissionGate,
        outbox: Outbox,
        on_move: Callable[[Transition], None] | None = None,
    ) -> None:
        self._deployment = deployment
        self._config = config
        self._gate = gate
        self._outbox = outbox
        self._on_move = on_move
        self._state = S.CONFIGURED
        self._generation = 0
        self._artifact: ResolvedArtifact | None = None
        self._metadata: CachedMetadata | None = None
        self._executable: Path | None = None
        self._process: Engine | None = None
        self._port: int | None = None
        self._lease: DigestLease | None = None
        self._estimate: MemoryEstimate | None = None
        self._reason_code: str | None = None
        self._last_error: str | None = None
        self._job_id: str | None = None
        self._crash: CrashLoop | None = None
        self._exhausted_job: str | None = None
        self._load_refusal: SbproxyError | None = None
        self._evicting = False
        self._health_misses = 0
        self._timeouts = 0
        self._failures = 0
        self._not_before = 0.0
        self._restarting = False
        self._swap_waiting = False
        self._capacity_retryable = False
        self._waiting = 0
        self._ready = anyio.Event()
        self.launching = anyio.Lock()

    # -- reading ---------------------------------------------------------------------------

    @property
    def deployment(self) -> str:
        """The deployment id."""
        return self._deployment

    @property
    def config(self) -> DeploymentConfig:
        """Its definition."""
        return self._config

    @property
    def gate(self) -> AdmissionGate:
        """Its admission gate."""
        return self._gate

    @property
    def state(self) -> DeploymentState:
        """The lifecycle state."""
        return self._state

    @property
    def generation(self) -> int:
        """The current (or last) generation number; 0 before the first launch."""
        return self._generation

    @property
    def key(self) -> ResidencyKey:
        """The residency key of the current generation."""
        return ResidencyKey(self._deployment, self._generation)

    @property
    def artifact(self) -> ResolvedArtifact | None:
        """The artifact the deployment resolved to, once known."""
        return self._artifact

    @property
    def metadata(self) -> CachedMetadata | None:
        """The cached artifact's metadata of the last launch."""
        return self._metadata

    @property
    def executable(self) -> Path | None:
        """The engine executable of the last launch."""
        return self._executable

    @property
    def process(self) -> Engine | None:
        """The engine child of the current generation, if any."""
        return self._process

    @property
    def port(self) -> int | None:
        """The loopback port the engine listens on."""
        return self._port

    @property
    def estimate(self) -> MemoryEstimate | None:
        """The memory the current generation reserved."""
        return self._estimate

    @property
    def reason_code(self) -> str | None:
        """Why the deployment is in its state (a stable code)."""
        return self._reason_code

    @property
    def last_error(self) -> str | None:
        """The retained error message (bounded)."""
        return self._last_error

    @property
    def job_id(self) -> str | None:
        """The job that last launched it."""
        return self._job_id

    @property
    def crash(self) -> CrashLoop | None:
        """The retained crash loop (only a reset clears it)."""
        return self._crash

    @property
    def exhausted_job(self) -> str | None:
        """The load job that ended ``recovery_exhausted`` and holds the deployment
        ``failed`` (only a reset or an explicit load clears it); ``None`` when none."""
        return self._exhausted_job

    @property
    def load_refusal(self) -> SbproxyError | None:
        """Why the last load could not go on because of the journal (``journal_unavailable``
        and the like: the load was refused, or its job waits for the journal), told to the
        requests waiting for it; ``None`` once a new load is asked for or one launches. It
        changes no state: a refused command leaves the deployment as it was."""
        return self._load_refusal

    def refuse_load(self, error: SbproxyError) -> None:
        """The load its waiters wait for cannot go on now (:attr:`load_refusal`): wake them
        to be refused with ``error``."""
        self._load_refusal = error
        self.pulse()

    def clear_load_refusal(self) -> None:
        """A new load was asked for: its waiters wait for it."""
        self._load_refusal = None

    @property
    def evicting(self) -> bool:
        """Whether it is ``draining`` only to make room for another deployment (not an
        operator's stop or drain): a request waits for its relaunch instead of being
        refused ``draining``."""
        return self._evicting

    @property
    def failures(self) -> int:
        """Consecutive failed launches or lost generations (the restart backoff's count)."""
        return self._failures

    @property
    def timeouts(self) -> int:
        """Consecutive requests that timed out at the current generation."""
        return self._timeouts

    @property
    def not_before(self) -> float:
        """Clock time before which no launch starts (the restart backoff)."""
        return self._not_before

    @property
    def swap_waiting(self) -> bool:
        """Whether its launch waits for a busy generation to go idle."""
        return self._swap_waiting

    @property
    def capacity_retryable(self) -> bool:
        """Whether a retained ``insufficient_capacity`` came from waiting out busy models."""
        return self._capacity_retryable

    @property
    def health_misses(self) -> int:
        """Consecutive maintenance probes that found the engine not ready."""
        return self._health_misses

    @property
    def waiting(self) -> int:
        """Requests waiting for it to become ready (they keep it from eviction)."""
        return self._waiting

    @property
    def ready(self) -> anyio.Event:
        """Set at the next state change that waiters should re-check."""
        return self._ready

    def routable(self) -> bool:
        """Whether requests may go to this generation now: ready, child alive, port known."""
        return (
            self._state is S.READY
            and self._process is not None
            and self._process.alive()
            and self._port is not None
        )

    # -- the one transition function -------------------------------------------------------

    def _move(
        self,
        expected: Collection[DeploymentState],
        to: DeploymentState,
        *,
        job_id: str | None = None,
        reason_code: str | None = None,
        error: str | None = None,
    ) -> None:
        """Compare and set: move from one of ``expected`` to ``to``, checked against the
        transition table; log it, queue its journal event (on ``job_id``, else the
        deployment's job) and tell the owner's hook. A move to the same state only updates
        the reason and error. Never yields.

        Raises:
            IllegalTransition: ``illegal_transition`` (another state than expected, or a
                move the table forbids).
        """
        before = self._state
        if before not in expected or (
            to is not before and to not in DEPLOYMENT_TRANSITIONS[before]
        ):
            raise IllegalTransition(
                f"{self._deployment}: {before.value} -> {to.value} is not an allowed "
                f"transition here (expected {', '.join(sorted(s.value for s in expected))})",
                details={"deployment": self._deployment, "from": before.value, "to": to.value},
            )
        self._state = to
        self._reason_code = reason_code
        self._last_error = bounded(error)
        if to is before:
            return
        logger.info(
            "deployment %s: %s -> %s%s",
            self._deployment,
            before.value,
            to.value,
            f" ({reason_code})" if reason_code else "",
        )
        transition = Transition(
            self._deployment, self._generation, before, to, reason_code, job_id or self._job_id
        )
        self._outbox.put(transition)
        if self._on_move is not None:
            self._on_move(transition)

    def pulse(self) -> None:
        """Wake everyone waiting on the state; they re-check it."""
        self._ready.set()
        self._ready = anyio.Event()

    # -- requests --------------------------------------------------------------------------

    def add_waiter(self) -> None:
        """A request waits for this deployment to become ready (no eviction meanwhile)."""
        self._waiting += 1

    def drop_waiter(self) -> None:
        """A request stopped waiting (see :meth:`add_waiter`)."""
        self._waiting -= 1

    def hold(self) -> bool:
        """A swap waits for this generation to go idle: pause its grants while it is
        serving (a starting one must let its first waiters in); whether it was held."""
        serving = self._state is S.READY and self._gate.active > 0
        if serving:
            self._gate.hold()
        return serving

    def release(self) -> None:
        """The swap that held the gate is over: grants resume (see :meth:`hold`)."""
        self._gate.unhold()

    def count_outcome(self, generation: int, *, timed_out: bool) -> bool:
        """Count one request's end at ``generation``; whether the generation must now be
        restarted (``unhealthy_after`` consecutive timeouts while ready, no restart under
        way: the restart is then marked under way). A request in time clears the counts."""
        if generation != self._generation:
            return False
        if not timed_out:
            self._timeouts = 0
            self._failures = 0
            return False
        self._timeouts += 1
        restart = (
            self._timeouts >= self._config.unhealthy_after
            and self._state is S.READY
            and not self._restarting
        )
        self._restarting = self._restarting or restart
        return restart

    def restart_finished(self) -> None:
        """The unhealthy restart :meth:`count_outcome` asked for is over."""
        self._restarting = False

    def unhealthy(self, generation: int, *, not_before: float, message: str) -> bool:
        """``unhealthy_after`` timeouts: fail the ready ``generation`` (``engine_unhealthy``)
        and set the restart backoff; whether it was still that ready generation."""
        if generation != self._generation or self._state is not S.READY:
            return False
        self._failures += 1
        self._not_before = not_before
        self._move({S.READY}, S.FAILED, reason_code="engine_unhealthy", error=message)
        return True

    # -- launching -------------------------------------------------------------------------

    def use_artifact(self, artifact: ResolvedArtifact) -> None:
        """Remember the artifact a job resolved."""
        self._artifact = artifact

    def begin_launch(self, metadata: CachedMetadata, executable: Path, job_id: str) -> None:
        """A launch starts: remember what it runs and move to ``preparing``."""
        self._metadata = metadata
        self._executable = executable
        self._job_id = job_id
        self._exhausted_job = None  # only an allowed load gets here (a retry, a reset's)
        self._load_refusal = None
        self._move({S.CONFIGURED, S.STOPPED, S.FAILED, S.READY}, S.PREPARING, job_id=job_id)

    def numbered(self, generation: int) -> None:
        """The launch runs as ``generation``."""
        self._generation = generation

    def swap_wait(self, waiting: bool) -> None:
        """Whether the launch now waits for busy generations to go idle."""
        self._swap_waiting = waiting

    def refused_capacity(self, code: str, message: str, *, retryable: bool) -> None:
        """The launch's reservation was refused: ``failed`` with that reason."""
        self._capacity_retryable = retryable
        self._move({S.PREPARING}, S.FAILED, reason_code=code, error=message)

    def reserved(self, estimate: MemoryEstimate) -> None:
        """The launch holds memory for ``estimate``."""
        self._estimate = estimate

    def launch_abandoned(self, *, reason: str | None = None) -> None:
        """The launch ended without an engine (its reservation is freed); one still
        ``preparing`` ends ``stopped``: ``superseded`` when cancelled (a stop won), or
        ``reason`` (``journal_unavailable``: the journal went away under it; its job
        resumes the launch once it is back)."""
        self._estimate = None
        if self._state is S.PREPARING:
            self._move({S.PREPARING}, S.STOPPED, reason_code=reason or "superseded")

    def start_timed_out(self, message: str) -> None:
        """No ``/health`` within ``start_timeout_ms``: ``failed`` (``start_timeout``)."""
        self._failures += 1
        self._move({S.PREPARING}, S.FAILED, reason_code="start_timeout", error=message)

    def crash_looped(self, crash: CrashLoop, message: str) -> None:
        """Launches kept failing: retain the crash loop, ``failed`` (``crash_loop``)."""
        self._crash = crash
        self._move({S.PREPARING}, S.FAILED, reason_code="crash_loop", error=message)

    def launched(self, process: Engine, port: int, lease: DigestLease | None) -> None:
        """The engine is ready on ``port``: route to it (``ready``)."""
        self._process = process
        self._port = port
        self._health_misses = 0
        self._timeouts = 0
        if self._lease is None:
            self._lease = lease
        elif lease is not None:
            lease.release()
        self._gate.resume()
        self._gate.mark_idle()
        self._move({S.PREPARING}, S.READY, job_id=self._job_id)
        self.pulse()

    # -- health ----------------------------------------------------------------------------

    def health_ok(self) -> None:
        """A probe found the engine ready."""
        self._health_misses = 0

    def health_missed(self) -> int:
        """A probe found it not ready; the consecutive misses now."""
        self._health_misses += 1
        return self._health_misses

    def lost(self, generation: int, message: str, *, not_before: float) -> bool:
        """The ready ``generation`` died or stopped answering: ``failed``
        (``engine_health_failed``) with the restart backoff; whether it was that ready
        generation (else nothing changes)."""
        if generation != self._generation or self._state is not S.READY:
            return False
        self._failures += 1
        self._not_before = not_before
        self._move({S.READY}, S.FAILED, reason_code="engine_health_failed", error=message)
        return True

    # -- stopping --------------------------------------------------------------------------

    def detach(self) -> tuple[Engine | None, DigestLease | None]:
        """Forget the engine, port, estimate and lease; the engine and lease to stop and
        release (the owner stops the engine and frees the reservation)."""
        process, lease = self._process, self._lease
        self._process = None
        self._lease = None
        self._port = None
        self._estimate = None
        return process, lease

    def begin_drain(
        self, *, job_id: str | None, reason: str | None
    ) -> tuple[DeploymentState, str | None, str | None]:
        """Move to ``draining``; what to restore after (state, reason code, error)."""
        retained = (self._state, self._reason_code, self._last_error)
        self._move(_ANY, S.DRAINING, job_id=job_id, reason_code=reason)
        self._evicting = False  # an operator's drain over an eviction: refused from now
        return retained

    def begin_evict(self, *, job_id: str | None) -> tuple[DeploymentState, str | None, str | None]:
        """Move to ``draining`` to make room (see :attr:`evicting`); what to restore
        after, as :meth:`begin_drain`."""
        retained = self.begin_drain(job_id=job_id, reason=None)
        self._evicting = True
        return retained

    def drained(
        self,
        retained: tuple[DeploymentState, str | None, str | None],
        *,
        job_id: str | None,
        reason: str | None,
    ) -> None:
        """The drain stopped the engine: a failed deployment stays failed (its retained
        error too), any other ends ``stopped`` (with ``reason`` unless a plain stop)."""
        previous, code, error = retained
        self._evicting = False
        if previous is S.FAILED:
            self._move({S.DRAINING}, S.FAILED, reason_code=code, error=error)
        else:
            keep = None if reason in (None, "stop", "drain") else reason
            self._move({S.DRAINING}, S.STOPPED, job_id=job_id, reason_code=keep)
        self._gate.resume()
        self.pulse()

    def reset(self, *, job_id: str | None) -> bool:
        """Clear a retained failure (the backoff too): ``configured``; whether there was one.

        Raises:
            SbproxyError: ``draining`` while it is preparing or draining.
        """
        if self._state in (S.PREPARING, S.DRAINING):
            raise SbproxyError(
                f"{self._deployment} is {self._state.value}; reset it once that has finished "
                "(if it failed)",
                code="draining",
            )
        if self._state is not S.FAILED:
            logger.info("%s: reset: nothing to clear (%s)", self._deployment, self._state.value)
            return False
        self._crash = None
        self._exhausted_job = None
        self._failures = 0
        self._not_before = 0.0
        self._move({S.FAILED}, S.CONFIGURED, job_id=job_id)
        self._gate.resume()
        return True

    def failed_before_launch(self, code: str, message: str, *, job_id: str | None) -> None:
        """A load (or an ``on_boot`` check) failed before any launch: ``preparing`` then
        ``failed`` in one step; a ``preparing`` or ready one only fails."""
        if self._state in (S.CONFIGURED, S.STOPPED):
            self._move({S.CONFIGURED, S.STOPPED}, S.PREPARING, job_id=job_id)
        self._move({S.PREPARING, S.READY}, S.FAILED, reason_code=code, error=message)

    def load_exhausted(self, job_id: str, message: str) -> None:
        """Its load job killed the host ``max_recoveries + 1`` times and ended
        ``recovery_exhausted``: ``failed`` with that code and the job's error, held there
        (no warm-up, request or fleet pass loads it again) until :meth:`reset` or
        :meth:`clear_exhausted` (an explicit load). A fresh load would die at the same
        point and take every other deployment of the host down with it."""
        self._exhausted_job = job_id
        self._job_id = job_id
        if self._state in (S.CONFIGURED, S.STOPPED):
            self._move({S.CONFIGURED, S.STOPPED}, S.PREPARING, job_id=job_id)
        self._move(
            {S.PREPARING, S.FAILED}, S.FAILED, reason_code="recovery_exhausted", error=message
        )

    def clear_exhausted(self) -> None:
        """An operator asked for a load: the ``recovery_exhausted`` hold is over (the
        deployment stays ``failed`` until that load launches)."""
        self._exhausted_job = None
