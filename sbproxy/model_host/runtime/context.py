"""What the runtime manager's parts share: :class:`RuntimeContext`.

The parts (``snapshots.py``, ``requests.py``, ``command_runner.py``, ``launches.py``,
``swaps.py``, ``spawner.py``, ``retire.py``, ``supervision.py``, ``transaction.py``,
``steps.py``) each own their own state; what they all read -- the live deployments, the
desired state, the residency, the command lanes, the staging, the clock -- and the few
things every one of them does (journal the queued transitions, wake a swap waiting for
capacity) live here, once. Only a reload's commit (``transaction.py``) replaces the
deployments, the desired state and the catalog.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import anyio

from sbproxy.catalog import Catalog, ResolvedArtifact, WorkerProfile, resolve_artifact
from sbproxy.config import CompiledConfig, DeploymentConfig
from sbproxy.errors import SbproxyError
from sbproxy.model_host.artifacts import ArtifactCache, CacheLayout
from sbproxy.model_host.runtime.admission import AdmissionGate
from sbproxy.model_host.runtime.clock import Clock
from sbproxy.model_host.runtime.definitions import artifact_request
from sbproxy.model_host.runtime.deployment import Deployment, Outbox, Transition, UnknownDeployment
from sbproxy.model_host.runtime.devices import HostDevices
from sbproxy.model_host.runtime.lanes import CommandLanes
from sbproxy.model_host.runtime.launcher import Engine, EngineLauncher, Launcher
from sbproxy.model_host.runtime.policy import backoff_of
from sbproxy.model_host.runtime.residency import Residency, ResidencyKey
from sbproxy.model_host.runtime.staging import Staging
from sbproxy.model_host.runtime.state import DeploymentState, LaunchBackoff
from sbproxy.model_host.runtime.tasks import HostTasks
from sbproxy.model_host.runtime.upstream import RuntimeTallies
from sbproxy.store import RuntimeStore, journal_fault
from sbproxy.workflows import JobCancelled, WorkerIdentity, WorkflowEngine

__all__ = ["RuntimeContext"]

logger = logging.getLogger(__name__)

S = DeploymentState


@dataclass(frozen=True)
class SplitLaunch:
    """How a deployment this host leads as a split launches: ``--rpc`` through these
    loopback tunnel ``endpoints``, reserving ``reserved_bytes`` here (its share, not the
    whole model's estimate; docs/cluster.md, "One model over several hosts")."""

    endpoints: tuple[tuple[str, int], ...]
    reserved_bytes: int
    probe: Callable[[], Awaitable[None]] | None = None
    """Checks, before each launch, that every worker answers through its tunnel (raises
    ``EngineError`` ``rpc_worker_unavailable`` and the like): llama.cpp would otherwise
    load the whole model onto the workers it reaches."""
    placement: str | None = None
    """The fleet placement of the split (its engine serves that placement, and no later
    one of the same deployment: those have other workers)."""


class LaunchHold:
    """Deployments whose launches wait: a fleet node that fenced itself launches nothing it
    held then -- a restart after its engine's death included -- until its agent has seen
    which of them the fleet still places here (:meth:`release`); the others are stopped by
    the reload that follows, which cancels their waiting launch."""

    def __init__(self) -> None:
        self._held: dict[str, anyio.Event] = {}
        self.waiting: set[str] = set()
        """Deployments whose launch waits on the hold now."""

    @property
    def held(self) -> frozenset[str]:
        """The deployments held now."""
        return frozenset(self._held)

    def hold(self, deployments: Iterable[str]) -> None:
        """Hold the launches of ``deployments`` (those already held stay so)."""
        for name in deployments:
            self._held.setdefault(name, anyio.Event())

    def release(self, deployments: Iterable[str]) -> None:
        """Let the launches of ``deployments`` go on (a waiting one proceeds)."""
        for name in deployments:
            event = self._held.pop(name, None)
            if event is not None:
                event.set()

    def end_waiting(self, deployments: Iterable[str]) -> None:
        """The fleet no longer places ``deployments`` here: end the launches waiting on
        their hold (each ends cancelled, freeing its deployment's command lane for the stop
        that follows); the holds stay, for any later launch."""
        for name in deployments:
            event = self._held.get(name)
            if event is not None and name in self.waiting:
                self._held[name] = anyio.Event()
                event.set()

    async def wait(self, deployment: str) -> None:
        """Return once ``deployment`` is not held (at once when it is not).

        Raises:
            JobCancelled: ``cancelled`` -- :meth:`end_waiting` ended this launch.
        """
        event = self._held.get(deployment)
        if event is None:
            return
        logger.warning(
            "%s: launch held: this node fenced itself, and waits to see whether its fleet "
            "still places the deployment here",
            deployment,
        )
        self.waiting.add(deployment)
        try:
            await event.wait()
        finally:
            self.waiting.discard(deployment)
        if deployment in self._held:  # woken, but still held: ended
            raise JobCancelled(
                f"{deployment}: its launch held since the fence ended: the fleet no longer "
                "places it on this node"
            )


class RuntimeContext:
    """The runtime's shared state and the operations every part uses on it.

    Args (keyword-only) are the manager's, see
    :class:`~sbproxy.model_host.runtime.manager.RuntimeManager`; ``launcher`` is already
    chosen (a fake one in unit tests) or ``None`` for real llama-server children.

    Attributes:
        compiled: The desired state (replaced by a reload's commit).
        catalog: The catalog deployments resolve against (replaced with it).
        live: The live deployments by id (replaced, in one step, by a reload's commit).
        revision: The committed desired-state revision (``None`` before start).
        safety_margin: The memory estimate's margin (``model_host.safety_margin``).
        shutdown_deadline_s: ``model_host.shutdown_deadline_ms``, in seconds.
    """

    def __init__(
        self,
        *,
        compiled: CompiledConfig,
        layout: CacheLayout,
        catalog: Catalog,
        engine: WorkflowEngine,
        runtime_store: RuntimeStore,
        worker: WorkerProfile,
        devices: HostDevices,
        clock: Clock,
        jitter: Callable[[], float],
        launcher: Launcher | None,
        backoff: LaunchBackoff | None,
        ready_timeout_s: float | None,
    ) -> None:
        self.compiled = compiled
        self.catalog = catalog
        self.layout = layout
        self.cache = ArtifactCache(layout)
        self.engine = engine
        self.runtime_store = runtime_store
        self.worker = worker
        self.devices = devices
        self.clock = clock
        self.jitter = jitter
        self.backoff_override = backoff
        self.ready_timeout_s = ready_timeout_s
        self.identity = WorkerIdentity.current()
        self.launcher: Launcher = launcher or EngineLauncher(
            owned_dir=layout.owned_engines, identity=self.identity
        )
        self.tallies = RuntimeTallies()
        self.take_host_policies(compiled)
        self.residency = self._residency_for(compiled)
        self.lanes = CommandLanes()
        self.staging = Staging()
        self.outbox = Outbox()
        self.tasks = HostTasks()
        self.launch_hold = LaunchHold()
        self.split_launched: dict[str, str | None] = {}
        """``{deployment: split placement}`` its running generation was launched for
        (``None``: not as a split)."""
        self.splits: dict[str, SplitLaunch] = {}
        """``{deployment: split}`` of the deployments this host leads as a split over
        several hosts' RPC workers (the fleet sets it before it loads one)."""
        self.revision: int | None = None
        self._tick = 0
        self._capacity = anyio.Event()
        self.live: dict[str, Deployment] = {
            name: self.new_deployment(name, config) for name, config in compiled.deployments.items()
        }

    def _residency_for(self, compiled: CompiledConfig) -> Residency:
        host = compiled.model_host
        cache_config = host.cache if host else None
        return Residency(
            self.devices.capacities(),
            max_resident_models=cache_config.max_resident_models if cache_config else None,
            eviction=cache_config.eviction if cache_config else "lru",
            is_protected=self.protected,
            demand=self.demand,
        )

    def take_host_policies(self, compiled: CompiledConfig) -> None:
        """The host-wide settings a running host takes at once (and at a reload)."""
        host = compiled.model_host
        self.safety_margin = host.safety_margin if host else 0.10
        self.shutdown_deadline_s = (host.shutdown_deadline_ms if host else 30_000) / 1000

    # -- the deployments --------------------------------------------------------------------

    def deployment(self, deployment: str) -> Deployment:
        """The live deployment ``deployment``.

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        found = self.live.get(deployment)
        if found is None:
            raise UnknownDeployment(
                f"no deployment {deployment!r}",
                remediation="Check proxy.model_host.deployments; `sbproxy models ps` lists them.",
                details={"deployment": deployment},
            )
        return found

    def current(self, key: ResidencyKey) -> Deployment | None:
        """The live deployment that runs ``key``'s generation now, if any."""
        found = self.live.get(key.deployment)
        return found if found is not None and found.generation == key.generation else None

    def new_deployment(self, deployment: str, config: DeploymentConfig) -> Deployment:
        """A fresh deployment of ``config``: its gate on the runtime's clock, its
        transitions counted and queued to the runtime's outbox."""
        gate = AdmissionGate(
            deployment,
            max_active=config.max_concurrency,
            max_queue=config.max_queue_depth,
            queue_timeout_s=config.queue_timeout_ms / 1000,
            clock=self.clock.now,
        )
        gate.on_idle = self.capacity_changed
        return Deployment(deployment, config, gate=gate, outbox=self.outbox, on_move=self._moved)

    def engines(self) -> list[Engine]:
        """Every engine child the runtime holds (current and staged deployments)."""
        every = [*self.live.values(), *self.staging.staged.values()]
        return [found.process for found in every if found.process is not None]

    def resolve_config(self, config: DeploymentConfig, catalog: Catalog) -> ResolvedArtifact:
        """Resolve one deployment definition against ``catalog`` on this worker.

        Raises:
            ResolutionError: ``unknown_catalog_model``, ``unknown_catalog_variant``, ...
            NoCompatibleVariantError: ``no_compatible_variant``.
        """
        return resolve_artifact(catalog, artifact_request(config), self.worker).artifact

    def backoff(self, found: Deployment) -> LaunchBackoff:
        """The deployment's launch and restart backoff (its config, unless the manager's)."""
        return backoff_of(found.config, self.backoff_override)

    def reserved_devices(self, found: Deployment) -> tuple[int, ...]:
        """The devices the deployment's generation holds memory on (empty when none)."""
        reservation = self.residency.get(found.key) if found.generation else None
        return reservation.devices if reservation is not None else ()

    # -- transitions and capacity -----------------------------------------------------------

    def _moved(self, transition: Transition) -> None:
        """Every transition, synchronously: count it, wake a swap waiting on a transient
        generation."""
        key = (transition.deployment, transition.before.value, transition.after.value)
        self.tallies.transitions[key] += 1
        self.capacity_changed()

    async def publish(self) -> None:
        """Journal the queued transitions, oldest first (a journal write never wedges the
        runtime: a failed one is logged). The journal away (``journal_unavailable``,
        ``disk_full``, ``store_failed``) is one warning line, and the rest of the batch is
        not tried: each would wait out the same outage (a stop would wait for all of them)."""
        with anyio.CancelScope(shield=True):
            transitions = [(t.job_id, t) for t in self.outbox.take() if t.job_id is not None]
            for index, (job_id, transition) in enumerate(transitions):
                try:
                    await self.engine.store.record_event(
                        job_id, kind="deployment", data=transition.event_data()
                    )
                except Exception as exc:
                    if isinstance(exc, SbproxyError) and journal_fault(exc):
                        logger.warning(
                            "could not record %d deployment transition(s) on their jobs: [%s] %s",
                            len(transitions) - index,
                            exc.code,
                            exc,
                        )
                        return
                    logger.exception("could not record the transition on %s", job_id)

    @property
    def capacity(self) -> anyio.Event:
        """Set at the next change of capacity (a gate idle, a reservation freed, a state
        changed): what a swap waits on."""
        return self._capacity

    def capacity_changed(self) -> None:
        """Wake whoever waits on :attr:`capacity`."""
        self._capacity.set()
        self._capacity = anyio.Event()

    def next_tick(self) -> int:
        """The next use tick (the residency's recency order)."""
        self._tick += 1
        return self._tick

    # -- residency callbacks ----------------------------------------------------------------

    def protected(self, key: ResidencyKey, *, transient: bool = True) -> bool:
        """Whether ``key``'s generation may not be evicted now: staged, pinned, or (with
        ``transient``, the normal rule) busy, preparing or draining."""
        if self.staging.protects(key):
            return True
        found = self.current(key)
        if found is None:
            return False
        gate = found.gate
        # A held gate admits nobody new: its queue waits for the swap, so only the requests
        # already running keep it resident. Requests waiting for it to become ready count.
        busy = gate.active > 0 or (gate.queued > 0 and not gate.held) or found.waiting > 0
        settling = busy or found.state in (S.PREPARING, S.DRAINING)
        return found.config.pinned or (transient and settling)

    def demand(self, key: ResidencyKey) -> int:
        """Requests active, queued or waiting for ``key``'s generation: each would wait for
        a relaunch if it were evicted (the residency evicts the least wanted first)."""
        found = self.current(key)
        if found is None:
            return 0
        return found.gate.active + found.gate.queued + found.waiting
