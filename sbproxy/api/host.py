"""Assembly of one serving host from a loaded configuration.

:func:`open_host` builds the artifact cache, the catalog, the workflow engine (whose steps
may use the cache and the manager), the runtime store and the runtime manager; it starts the
manager (orphan reaping, warm loads, maintenance) and the job worker loop in one task group.
On exit it shuts the manager down -- loads settle or are left for the next start, every
deployment is drained within ``shutdown_deadline_ms`` and its engine stopped -- then cancels
the worker loop and closes the journal. After a stop signal the manager gets only what is
left of the one shutdown budget (:meth:`~sbproxy.api.shutdown.Shutdown.engine_budget_s`).
Jobs that did not finish stay ``queued`` or ``running`` in the journal and resume at the
next start under their original ids.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.abc
import anyio.to_thread

import sbproxy.model_host.runtime.jobs  # registers the load/drain/reset workflows
import sbproxy.model_host.runtime.reload  # noqa: F401 - registers the reload workflow
from sbproxy.api.config_state import ConfigState
from sbproxy.api.shutdown import Shutdown
from sbproxy.catalog import Catalog, WorkerProfile, load_catalog, resolve_artifact
from sbproxy.config import CompiledConfig, ModelHostConfig
from sbproxy.errors import ConfigError, ConfigIssue, SbproxyError, sole_error
from sbproxy.fleet.agent import FleetAgent
from sbproxy.fleet.cluster import fleet_store, is_cluster, open_agent, start_node, starting_state
from sbproxy.model_host.artifacts import ArtifactCache, CacheLayout, resolve_cache_root
from sbproxy.model_host.artifacts.locks import HostLock
from sbproxy.model_host.engines import reap_orphans
from sbproxy.model_host.engines.guard import EngineGuard
from sbproxy.model_host.flows import registry
from sbproxy.model_host.runtime import HostDevices, probe_host
from sbproxy.model_host.runtime.manager import (
    RUNTIME_JOB_KINDS,
    RuntimeManager,
    artifact_request,
)
from sbproxy.model_host.runtime.reload import admin_desired
from sbproxy.store import JobStore, RuntimeStore, journal_location, journal_node_id, open_journal
from sbproxy.store.fleet import FleetStore
from sbproxy.workflows import WorkflowEngine

__all__ = ["ServedHost", "open_host"]

logger = logging.getLogger(__name__)

# Jobs the worker loop runs at once (pulls, loads, drains of different deployments).
WORKER_CONCURRENCY = 4
# Pause before the worker loop starts again after a journal failure, doubling per failure.
WORKER_RESTART_MIN_S = 1.0
WORKER_RESTART_MAX_S = 30.0


@dataclass
class ServedHost:
    """A running host: the manager, its workflow engine, the task group they live in, and
    the state of its configuration file (active content, last reload)."""

    manager: RuntimeManager
    engine: WorkflowEngine
    layout: CacheLayout
    group: anyio.abc.TaskGroup
    config: ConfigState
    stop: Shutdown | None = None
    fleet: FleetAgent | None = None


def _probe(layout: CacheLayout, cpu_devices: int) -> tuple[WorkerProfile, HostDevices]:
    """This host's worker and device table (:func:`probe_host`), probed once the engines a
    crashed run of this host left behind are gone: they still hold device memory, and the
    probe measures what each GPU has free (the runtime's budget per device). Called with
    the cache's host lock held (they are this cache's engines, no live host's).

    Raises:
        SbproxyError: ``device_probe_failed``, ``invalid_environment``.
    """
    reaped = reap_orphans(layout.owned_engines)
    if reaped.killed:
        logger.warning("reaped orphan engines before the device probe: %s", reaped.killed)
    return probe_host(cpu_devices)


@asynccontextmanager
async def open_host(
    compiled: CompiledConfig, *, cache_dir: Path | None = None, stop: Shutdown | None = None
) -> AsyncIterator[ServedHost]:
    """Build, start and (on exit) shut down the host of ``compiled``.

    With ``stop``, a shutdown that follows a stop signal fits the manager's drain and engine
    stop into what is left of the signal's budget.

    Under ``authority: admin_managed`` the deployments come from the revision store
    (:func:`~sbproxy.model_host.runtime.reload.admin_desired`).

    Raises:
        SbproxyError: ``invalid_cache_dir``, ``cache_in_use`` (another host serves this
            cache), ``invalid_catalog``, ``store_failed``,
            ``invalid_desired``, ``invalid_config`` (a deployment that does not resolve on
            this worker) or a device probe failure, before anything starts.
    """
    compiled, _ = await admin_desired(compiled)
    host_config = compiled.model_host
    layout = resolve_cache_root(
        cache_dir, configured=host_config.cache.directory if host_config else None
    )
    store, node, compiled = await _cluster_start(compiled, layout)
    catalog_file = host_config.catalog_file if host_config else None
    catalog = load_catalog(Path(catalog_file) if catalog_file else None)
    cpu_devices = host_config.cpu_devices if host_config else 1
    cache = ArtifactCache(layout)
    cache.ensure_dirs()
    # One serving host per cache: its journal's runtime jobs and its engines have one owner.
    host_lock = HostLock.acquire(layout.locks / "host.lock", cache_root=layout.root)
    try:
        worker, devices = await anyio.to_thread.run_sync(_probe, layout, cpu_devices)
        _check_resolvable(compiled, catalog, worker)
        journal = await _open_journal(host_config, layout)
    except BaseException:
        host_lock.release()
        raise
    # A serving host outlasts a journal that cannot record (its server away, its disk
    # full): its runs hold their claims and resume, its loads wait instead of failing.
    engine = WorkflowEngine(journal, registry, resources=[cache], wait_out_journal_faults=True)
    try:
        manager = RuntimeManager(
            compiled=compiled,
            layout=layout,
            catalog=catalog,
            engine=engine,
            runtime_store=RuntimeStore(journal.database),
            worker=worker,
            devices=devices,
        )
        engine.add_resource(manager)
        engine.add_resource(manager.port)
        if stop is not None:
            stop.on_hurry(lambda: _kill_engines(manager))
        agent, guard = await _join_fleet(compiled, manager, store, node)
        async with anyio.create_task_group() as group:
            await manager.start(group)
            config = ConfigState.of(compiled, revision=manager.revision)
            manager.on_commit.append(config.on_commit)
            group.start_soon(_worker, engine)
            if agent is not None:
                group.start_soon(agent.run, group)
                if stop is not None:
                    group.start_soon(_leave_on_stop, agent, stop)
            try:
                yield ServedHost(
                    manager=manager,
                    engine=engine,
                    layout=layout,
                    group=group,
                    config=config,
                    stop=stop,
                    fleet=agent,
                )
            finally:
                await _stop_serving(agent, manager, stop)
                if guard is not None:
                    guard.close()
                group.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await engine.close()
        if store is not None:
            store.close()
        host_lock.release()


async def _open_journal(host_config: ModelHostConfig | None, layout: CacheLayout) -> JobStore:
    """The host's journal: ``proxy.model_host.journal.url``, else the cache's SQLite file;
    on PostgreSQL its jobs record the cache's own node id (issue 30, item 12)."""
    location = journal_location(layout.journal, host_config)
    node = journal_node_id(location, layout.root, host_config.node.id if host_config else None)
    return await open_journal(location, node=node)


async def _cluster_start(
    compiled: CompiledConfig, layout: CacheLayout
) -> tuple[FleetStore | None, str | None, CompiledConfig]:
    """A cluster host's fleet store, node id, and the deployments placed on it (it starts
    with those: none on a new node); ``(None, None, compiled)`` for any other host."""
    if not is_cluster(compiled):
        return None, None, compiled
    store = fleet_store(compiled)
    layout.root.mkdir(parents=True, exist_ok=True)
    node = start_node(compiled, layout.root)
    try:
        return store, node, await starting_state(compiled, store, node)
    except BaseException:
        store.close()
        raise


async def _join_fleet(
    compiled: CompiledConfig, manager: RuntimeManager, store: FleetStore | None, node: str | None
) -> tuple[FleetAgent | None, EngineGuard | None]:
    """A cluster host's agent, joined, and its engine guard -- a process of its own that
    kills this host's engines should this one be paused past ``fence_after_ms`` (it cannot
    fence itself then); ``(None, None)`` for any other host.

    Raises:
        SbproxyError: ``journal_unavailable``, ``node_id_in_use``, ``node_removed``.
    """
    if store is None or node is None:
        return None, None
    agent = open_agent(compiled, manager, store, node)
    await agent.join()
    guard = EngineGuard(
        manager.owned_dir,
        owner=manager.identity.owner,
        deadline_s=agent.timing.fence_after_ms / 1000,
    )
    return agent, guard


async def _leave_on_stop(agent: FleetAgent, stop: Shutdown) -> None:
    """Mark this fleet member leaving the moment its stop is requested: out of every
    gateway's rotation while its requests in flight drain, not once they have (issue 30,
    item 5); its replicas are re-placed ``rejoin_grace_ms`` after the mark."""
    await stop.wait_requested()
    with anyio.CancelScope(shield=True):
        await agent.leave()


async def _stop_serving(
    agent: FleetAgent | None, manager: RuntimeManager, stop: Shutdown | None
) -> None:
    """A graceful stop: a fleet member is marked leaving first -- by the stop's request
    (:func:`_leave_on_stop`; waited for here), else now -- out of every gateway's rotation
    before its engines stop, re-placed after ``rejoin_grace_ms`` rather than
    ``lost_after_ms`` (issue 30, item 5); then the runtime shuts down."""
    if agent is not None:
        with anyio.CancelScope(shield=True):
            await agent.leave()
    await _shutdown_runtime(manager, budget_s=stop.engine_budget_s() if stop else None)
    if agent is not None:
        # The RPC workers of splits last: a split this host leads drained above.
        with anyio.CancelScope(shield=True):
            await agent.close_splits()


async def _shutdown_runtime(manager: RuntimeManager, *, budget_s: float | None) -> None:
    """Shut ``manager`` down; with ``budget_s`` (seconds), within that long (0: at once).

    After a stop signal the budget is what is left of the signal's one deadline, which the
    manager divides between its phases instead of starting a fresh deadline per phase.
    """
    await manager.shutdown(deadline_s=budget_s)


def _kill_engines(manager: RuntimeManager) -> None:
    """SIGKILL every engine this host started (a second stop signal): the ones the manager
    holds, and -- from the ownership records -- any still starting or stopping. The
    manager's shutdown then sees them exit instead of waiting out their SIGTERM grace."""
    killed = manager.kill_every_engine(stopping=True)
    if killed:
        logger.warning("killed engine process groups %s", sorted(killed))


def _check_resolvable(compiled: CompiledConfig, catalog: Catalog, worker: WorkerProfile) -> None:
    """Startup prepares the whole candidate like a reload: every deployment must resolve to
    an exact artifact on this worker before anything starts.

    Raises:
        ConfigError: ``invalid_config`` listing each deployment that does not resolve, with
            its dotted path and the catalog's reason (unknown model or variant, no variant
            for this worker).
    """
    issues = []
    for deployment_id, deployment in compiled.deployments.items():
        try:
            resolve_artifact(catalog, artifact_request(deployment), worker)
        except SbproxyError as exc:
            path = compiled.lowered_from.get(deployment_id) or (
                f"proxy.model_host.deployments.{deployment_id}"
            )
            issues.append(ConfigIssue(f"{path}.model", f"{exc.message} ({exc.code})"))
    if issues:
        source = str(compiled.source) if compiled.source else None
        raise ConfigError(issues, source=source)


async def _worker(engine: WorkflowEngine) -> None:
    """Run the job worker loop for the server's lifetime, restarting it when it fails.

    The loop stops when a journal write fails under it (``disk_full`` when the journal's
    file system is full, ``store_failed``): the server stays up and serves what it can,
    logs the reason once per failure, and starts the loop again after a pause (1 s doubling
    to 30 s), so that the jobs left unfinished resume once the journal can be written again.
    Anything but an :class:`SbproxyError` is a bug and stops the host as before.
    """
    pause_s = WORKER_RESTART_MIN_S
    while True:
        started = anyio.current_time()
        try:
            # The manager runs its deployments' jobs itself, in command order.
            await engine.run_worker(concurrency=WORKER_CONCURRENCY, exclude=RUNTIME_JOB_KINDS)
            return
        except Exception as exc:
            error = sole_error(exc)
            if error is None:
                raise
            if anyio.current_time() - started > WORKER_RESTART_MAX_S:
                pause_s = WORKER_RESTART_MIN_S  # it had recovered: a new failure starts over
            logger.error(
                "job worker stopped: [%s] %s; restarting it in %.0f s", error.code, error, pause_s
            )
        await anyio.sleep(pause_s)
        pause_s = min(pause_s * 2, WORKER_RESTART_MAX_S)
