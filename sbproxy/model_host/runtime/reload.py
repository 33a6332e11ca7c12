"""Reload: the one prepare-and-commit transaction every desired-state change goes through.

The file watcher, ``SIGHUP``, ``POST /admin/reload``, ``sbproxy apply`` and the admin
``PUT /admin/model-host/deployments`` all run the durable ``reload`` workflow:

1. ``plan`` -- compare the candidate's deployments with the live ones: ``added``,
   ``changed``, ``removed``, ``preserved`` (identical definition and memory policy). A
   listener change (ports, bind addresses, admin settings, TLS), a cache-root change (the
   journal lives in the cache root) or, on a fleet member, a change of the fleet's timing or
   placement policy (its agent took them at start) is refused (``restart_required``, naming
   the dotted paths); a catalog or engine
   foundation change while any deployment is resident is refused (``foundation_change``:
   stop them first, then apply the new foundation).
2. ``prepare`` -- resolve every added or changed deployment against the candidate catalog,
   pull the artifacts that are ``warm`` or ``pull: on_boot`` (their pull jobs) and acquire
   the engine when something must start warm. Nothing live changes yet.
3. ``rollout`` -- for each added or changed deployment build a staged generation. ``recreate``
   drains and stops the old generation first; ``rolling`` keeps it serving while the new
   one starts (both must fit: every current reservation is protected from eviction while a
   reload stages, so a replacement that does not fit alongside is ``insufficient_capacity``).
   ``warm`` deployments start here (capacity reserved before the engine starts). On any
   failure the staged engines are stopped and recreated generations are restarted under
   their own generation numbers; the routes never changed.
4. ``store`` (``admin_managed`` only) -- compare-and-set the new revision into the revision
   store; when it is stale (``revision_conflict``) a ``discard`` step undoes the rollout.
   A failure after this point is reported as ``runtime_commit_failed`` with
   ``durable_state_advanced``: the store moved, the runtime did not, and the next start
   converges to the store.
5. ``commit`` -- swap the live deployments atomically (preserved ones keep their generation,
   port and process), hand the candidate to the gateway (routes, keys), drain and stop the
   superseded and removed generations within ``shutdown_deadline_ms``, and record the
   committed revision in the journal.

Every step converges rather than replays blindly: a host killed at any point restarts from
the authoritative desired state (``sb.yml``, or the revision store), the worker resumes the
interrupted ``reload`` job under its id, and its remaining steps find the deployments
already defined as the candidate says and only finish what is missing (a warm engine). A
resumed job whose candidate is no longer the authoritative state ends ``superseded``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
from pydantic import BaseModel, ConfigDict

from sbproxy.catalog import Catalog, ResolvedArtifact, load_catalog
from sbproxy.config import CompiledConfig, DeploymentConfig, load_config
from sbproxy.config.model_host import Authority, Rollout
from sbproxy.errors import SbproxyError
from sbproxy.model_host.engines import provision_llama_cpp
from sbproxy.model_host.registry import registry
from sbproxy.model_host.runtime.desired_store import DeploymentRevision, RevisionStore
from sbproxy.model_host.runtime.jobs import pull_artifact
from sbproxy.model_host.runtime.manager import (
    RuntimeManager,
    desired_digest,
    desired_of,
)
from sbproxy.model_host.runtime.state import DeploymentState
from sbproxy.store import JobStatus
from sbproxy.workflows import StepContext, WorkflowContext, step
from sbproxy.workflows.errors import StepFailed
from sbproxy.workflows.faults import fault_point

__all__ = [
    "ReloadInput",
    "ReloadPlan",
    "ReloadReport",
    "admin_desired",
    "foundation_changes",
    "listener_changes",
    "plan_reload",
    "refuse_restart_changes",
    "reload",
    "reload_from_source",
    "reload_workflow",
]

logger = logging.getLogger(__name__)

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class ReloadPlan(BaseModel):
    """What a reload does to each deployment id (each list sorted)."""

    model_config = _FROZEN

    added: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    preserved: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, list[str]]:
        """``{added, changed, removed, preserved}`` as JSON lists."""
        return {
            "added": list(self.added),
            "changed": list(self.changed),
            "removed": list(self.removed),
            "preserved": list(self.preserved),
        }


class ReloadInput(BaseModel):
    """A reload request: the candidate's desired deployments, identified by their digest."""

    model_config = _FROZEN

    source: str
    content_digest: str
    desired: dict[str, Any]
    use_store: bool = False
    expected_revision: int | None = None


class Prepared(BaseModel):
    """What ``prepare`` resolved: artifacts by deployment id and the engine to start with."""

    model_config = _FROZEN

    artifacts: dict[str, ResolvedArtifact]
    executable: str | None = None


class StoreResult(BaseModel):
    """The revision an ``admin_managed`` reload wrote."""

    model_config = _FROZEN

    revision: int
    content_digest: str


class RolloutInput(BaseModel):
    """What ``rollout`` stages."""

    model_config = _FROZEN

    request: ReloadInput
    plan: ReloadPlan
    prepared: Prepared


class CommitInput(BaseModel):
    """What ``commit`` makes live."""

    model_config = _FROZEN

    request: ReloadInput
    plan: ReloadPlan


class ReloadReport(BaseModel):
    """A committed reload."""

    model_config = _FROZEN

    revision: int
    content_digest: str
    plan: ReloadPlan
    store_revision: int | None = None
    store_digest: str | None = None


# -- pure policy --------------------------------------------------------------------------


def plan_reload(
    current: Mapping[str, DeploymentConfig],
    candidate: Mapping[str, DeploymentConfig],
    *,
    policy_changed: bool = False,
) -> ReloadPlan:
    """Classify every deployment id of ``current`` and ``candidate``.

    ``preserved`` needs an identical definition (compared as JSON) and an unchanged memory
    policy (``policy_changed`` false: the safety margin feeds every estimate).
    """
    added, changed, removed, preserved = [], [], [], []
    for deployment in sorted(set(current) | set(candidate)):
        before, after = current.get(deployment), candidate.get(deployment)
        if before is None:
            added.append(deployment)
        elif after is None:
            removed.append(deployment)
        elif policy_changed or before.model_dump(mode="json") != after.model_dump(mode="json"):
            changed.append(deployment)
        else:
            preserved.append(deployment)
    return ReloadPlan(
        added=tuple(added),
        changed=tuple(changed),
        removed=tuple(removed),
        preserved=tuple(preserved),
    )


def _host_part(compiled: CompiledConfig, name: str) -> Any:
    host = compiled.model_host
    if host is None:
        return None
    value = getattr(host, name)
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


def listener_changes(current: CompiledConfig, candidate: CompiledConfig) -> list[str]:
    """Dotted paths of settings a running process cannot change (listeners, cache root,
    authority, revision store, CPU device split, and on a ``cluster_authority`` host the
    fleet's timing and placement policy: ``proxy.model_host.fleet.heartbeat_ms``, ...)."""
    before, after = current.config.proxy, candidate.config.proxy
    changes = [
        f"proxy.{name}"
        for name in ("http_bind_port", "bind_address", "admin")
        if getattr(before, name) != getattr(after, name)
    ]
    root_before = (_host_part(current, "cache") or {}).get("directory")
    root_after = (_host_part(candidate, "cache") or {}).get("directory")
    if root_before != root_after:
        changes.append("proxy.model_host.cache.directory")
    for name in ("authority", "store_path"):
        if _host_part(current, name) != _host_part(candidate, name):
            changes.append(f"proxy.model_host.{name}")
    # The CPU device split shapes the residency the host started with.
    if _cpu_devices(current) != _cpu_devices(candidate):
        changes.append("proxy.model_host.cpu_devices")
    changes.extend(_fleet_changes(current, candidate))
    return changes


# What a reload hands on to a running fleet member (the gateway's peer dispatch and the lease
# route read them at each use); every other fleet setting (timing, placement policy) the
# agent took once at start, so a change must not look applied while the old value runs.
_LIVE_FLEET_FIELDS = frozenset(
    {"credential", "peer_cooldown_ms", "join_token", "accept_shared_credential"}
)


def _fleet_changes(current: CompiledConfig, candidate: CompiledConfig) -> list[str]:
    """Dotted paths of the fleet settings that changed and that only a restart applies
    (``proxy.model_host.fleet.<field>`` but the credential and the peer cool-down, and
    ``proxy.model_host.node`` / ``journal``); only on a ``cluster_authority`` host
    (elsewhere they are unused)."""
    before, after = current.model_host, candidate.model_host
    if before is None or after is None or before.authority != Authority.CLUSTER_AUTHORITY:
        return []
    changes = [
        f"proxy.model_host.fleet.{name}"
        for name in type(before.fleet).model_fields
        if name not in _LIVE_FLEET_FIELDS
        and getattr(before.fleet, name) != getattr(after.fleet, name)
    ]
    # The node's identity and the fleet store's journal are the agent's from its start too.
    changes.extend(
        f"proxy.model_host.{name}"
        for name in ("node", "journal")
        if getattr(before, name) != getattr(after, name)  # a SecretStr compares its value
    )
    return changes


def refuse_restart_changes(current: CompiledConfig, candidate: CompiledConfig) -> None:
    """Refuse a candidate that changes what only a restart applies (:func:`listener_changes`).

    Raises:
        SbproxyError: ``restart_required``, the dotted paths in the message and in
            ``details.paths`` (comma-separated).
    """
    changes = listener_changes(current, candidate)
    if changes:
        raise SbproxyError(
            f"{', '.join(changes)} cannot change while sbproxy runs",
            code="restart_required",
            remediation="Restart `sbproxy serve` to apply these changes.",
            details={"paths": ", ".join(changes)},
        )


def _cpu_devices(compiled: CompiledConfig) -> int:
    return compiled.model_host.cpu_devices if compiled.model_host else 1


def foundation_changes(current: CompiledConfig, candidate: CompiledConfig) -> list[str]:
    """Dotted paths of the catalog and engine foundation that differ between the two."""
    return [
        f"proxy.model_host.{name}"
        for name in ("catalog_file", "engines")
        if _host_part(current, name) != _host_part(candidate, name)
    ]


def _margin(compiled: CompiledConfig) -> float:
    return compiled.model_host.safety_margin if compiled.model_host else 0.10


# -- candidates ---------------------------------------------------------------------------


def _candidate(manager: RuntimeManager, request: ReloadInput) -> CompiledConfig:
    """The full candidate of ``request``: in memory while its reload runs; after a restart,
    the authoritative state the host started with, if it is the same desired state."""
    found = manager.staging.candidate(request.content_digest)
    if found is not None:
        return found
    if desired_digest(desired_of(manager.compiled)) == request.content_digest:
        return manager.compiled
    raise SbproxyError(
        "this reload was superseded: the authoritative desired state changed before it "
        "finished (the host restarted with another revision)",
        code="superseded",
        remediation="Nothing to do; the host runs its current desired state.",
    )


def _catalog_for(manager: RuntimeManager, candidate: CompiledConfig) -> Catalog:
    if _host_part(candidate, "catalog_file") == _host_part(manager.compiled, "catalog_file"):
        return manager.catalog
    catalog_file = candidate.model_host.catalog_file if candidate.model_host else None
    return load_catalog(Path(catalog_file) if catalog_file else None)


def _resident(manager: RuntimeManager) -> list[str]:
    return sorted(
        found.deployment
        for found in manager.deployments.values()
        if found.process is not None
        or found.state in (DeploymentState.PREPARING, DeploymentState.DRAINING)
    )


# -- steps --------------------------------------------------------------------------------


@step("plan")
async def plan_step(ctx: StepContext, request: ReloadInput) -> ReloadPlan:
    """Classify the deployments and refuse changes this process cannot make live.

    Idempotency: pure over the live deployments; the journal keeps the first answer.

    Raises:
        SbproxyError: ``restart_required``, ``foundation_change`` or ``superseded``.
    """
    manager = ctx.resource(RuntimeManager)
    candidate = _candidate(manager, request)
    refuse_restart_changes(manager.compiled, candidate)
    foundation = foundation_changes(manager.compiled, candidate)
    resident = _resident(manager)
    if foundation and resident:
        raise SbproxyError(
            f"{', '.join(foundation)} cannot change under resident deployments "
            f"({', '.join(resident)})",
            code="foundation_change",
            remediation="Apply a desired state without these deployments (or stop them), "
            "then apply the new foundation.",
            details={"paths": ", ".join(foundation), "resident": ", ".join(resident)},
        )
    return plan_reload(
        {d: found.config for d, found in manager.deployments.items()},
        candidate.deployments,
        policy_changed=_margin(manager.compiled) != _margin(candidate),
    )


class PrepareInput(BaseModel):
    """What ``prepare`` works on."""

    model_config = _FROZEN

    request: ReloadInput
    plan: ReloadPlan


@step("prepare")
async def prepare_step(ctx: StepContext, request: PrepareInput) -> Prepared:
    """Resolve added and changed deployments, pull what must be ready, acquire the engine.

    Idempotency: resolution is pure; pull jobs are keyed by artifact digest (a hit is
    verified, not fetched again); engine detection finds an engine acquired earlier.

    Raises:
        SbproxyError: resolution (``unknown_catalog_model``, ``unknown_catalog_variant``,
            ``no_compatible_variant``), pull (``manual_artifact_missing``,
            ``digest_mismatch``, ...) and engine acquisition failures.
    """
    manager = ctx.resource(RuntimeManager)
    candidate = _candidate(manager, request.request)
    catalog = _catalog_for(manager, candidate)
    artifacts: dict[str, ResolvedArtifact] = {}
    warm = False
    for deployment in (*request.plan.added, *request.plan.changed):
        config = candidate.deployments[deployment]
        try:
            artifact = manager.resolve_config(config, catalog)
        except SbproxyError as exc:
            exc.details.setdefault("deployment", deployment)
            raise
        artifacts[deployment] = artifact
        if config.warm or str(config.pull) == "on_boot":
            await pull_artifact(
                manager.engine, catalog, artifact, pull_policy=str(config.pull), intent="startup"
            )
        warm = warm or config.warm
    executable = None
    if warm:
        host = candidate.model_host
        executable = str(
            await provision_llama_cpp(
                host.engines.llama_cpp if host else None,
                engine=manager.engine,
                layout_root=manager.layout.root,
            )
        )
    return Prepared(artifacts=artifacts, executable=executable)


@step("store")
async def store_step(ctx: StepContext, request: ReloadInput) -> StoreResult:
    """Compare-and-set the candidate into the ``admin_managed`` revision store.

    Idempotency: a resumed job (the step's second run or later) finds the store already at
    this digest and reports it; a first run always compares and sets, so of two hosts
    writing the same content at once one wins and the other gets ``revision_conflict``.

    Raises:
        RevisionConflict: ``revision_conflict``.
        SbproxyError: ``store_failed``.
    """
    manager = ctx.resource(RuntimeManager)
    _candidate(manager, request)  # a resumed job whose candidate was never stored is over
    store = revision_store(manager.compiled)
    current = await anyio.to_thread.run_sync(store.load)
    if (
        ctx.attempt > 1  # a first run wrote nothing: an equal revision is another writer's
        and current is not None
        and desired_digest(current.deployments) == request.content_digest
        and current.revision == (request.expected_revision or 0) + 1
    ):  # written by this job before a crash
        return StoreResult(revision=current.revision, content_digest=current.content_digest)
    written: DeploymentRevision = await anyio.to_thread.run_sync(
        lambda: store.compare_and_set(
            expected_revision=request.expected_revision,
            catalog_revision=manager.catalog.catalog_revision,
            deployments=request.desired,
        )
    )
    return StoreResult(revision=written.revision, content_digest=written.content_digest)


@step("rollout")
async def rollout_step(ctx: StepContext, request: RolloutInput) -> list[str]:
    """Stage the new generations (see the module docstring); the deployments staged.

    Runs in a turn on every changed and removed deployment: loads, stops and resets that
    arrived earlier finish first, later ones wait for the reload.

    Idempotency: a deployment whose live definition already is the candidate's (a resumed
    job after a restart) is only made ready when it is ``warm``.

    Raises:
        EngineError / AdmissionRejected: the first staging failure, after rollback.
    """
    manager = ctx.resource(RuntimeManager)
    candidate = _candidate(manager, request.request)
    prepared = request.prepared
    executable = Path(prepared.executable) if prepared.executable else None
    plan = request.plan
    touched = (*plan.added, *plan.changed, *plan.removed)
    staging = manager.staging
    async with manager.exclusive(touched, job_id=ctx.job_id):
        staging.begin()
        try:
            for deployment in sorted((*plan.added, *plan.changed)):
                config = candidate.deployments[deployment]
                live = manager.deployments.get(deployment)
                artifact = prepared.artifacts[deployment]
                if live is not None and live.config == config:
                    manager.use_artifact(live, artifact)
                    if config.warm and executable is not None:
                        await manager.launch_generation(
                            live, executable=executable, job_id=ctx.job_id
                        )
                    continue
                if live is not None and config.rollout == Rollout.RECREATE:
                    await manager.recreate_stop(live, job_id=ctx.job_id)
                    fault_point("reload.recreate.stopped")
                fresh = manager.stage(deployment, config, artifact)
                if config.warm and executable is not None:
                    await manager.launch_generation(fresh, executable=executable, job_id=ctx.job_id)
        except BaseException:
            await manager.roll_back()
            raise
        finally:
            staging.end()
        return sorted(staging.staged)


@step("commit")
async def commit_step(ctx: StepContext, request: CommitInput) -> ReloadReport:
    """Swap the live deployments, hand the candidate to listeners, retire the superseded
    generations, and record the committed revision (a new one only when the desired
    deployments changed).

    Idempotency: a resumed job whose deployments already match finds nothing to swap or retire
    and records the revision.
    """
    manager = ctx.resource(RuntimeManager)
    candidate = _candidate(manager, request.request)
    plan = request.plan
    async with manager.exclusive((*plan.added, *plan.changed, *plan.removed), job_id=ctx.job_id):
        retired = manager.apply(
            added=plan.added,
            changed=plan.changed,
            removed=plan.removed,
            candidate=candidate,
            catalog=_catalog_for(manager, candidate),
        )
        manager.staging.committed(request.request.content_digest)
        for listener in manager.on_commit:
            listener(candidate)
        fault_point("reload.committed")
        for old in retired:
            if old.process is not None or old.state == DeploymentState.DRAINING:
                await manager.drain_deployment(old, job_id=ctx.job_id)
    cache = candidate.model_host.cache if candidate.model_host else None
    await manager.enforce_resident_limit(
        cache.max_resident_models if cache else None, job_id=ctx.job_id
    )
    digest = request.request.content_digest
    revision = await manager.record_revision(content_digest=digest, desired=request.request.desired)
    return ReloadReport(revision=revision, content_digest=digest, plan=plan)


@step("discard")
async def discard_step(ctx: StepContext, request: ReloadInput) -> list[str]:
    """Undo a rollout whose revision could not be stored: stop the staged engines, restart
    the generations a ``recreate`` stopped. The deployments discarded.

    Idempotency: after a restart nothing is staged and nothing is discarded.
    """
    manager = ctx.resource(RuntimeManager)
    return await manager.roll_back()


@registry.workflow("reload", version=1)
async def reload_workflow(ctx: WorkflowContext, request: ReloadInput) -> ReloadReport:
    """Plan, prepare, roll out, (store,) and commit one candidate (module docstring)."""
    plan = await ctx.step(plan_step, request)
    prepared = await ctx.step(prepare_step, PrepareInput(request=request, plan=plan))
    await ctx.step(rollout_step, RolloutInput(request=request, plan=plan, prepared=prepared))
    stored: StoreResult | None = None
    if request.use_store:
        try:
            stored = await ctx.step(store_step, request)
        except StepFailed:
            await ctx.step(discard_step, request)
            raise
    try:
        report = await ctx.step(commit_step, CommitInput(request=request, plan=plan))
    except StepFailed as exc:
        if stored is None:
            raise
        raise SbproxyError(
            f"revision {stored.revision} is stored but the runtime did not commit it: {exc}",
            code="runtime_commit_failed",
            remediation="The next start converges to the stored revision; fix the cause "
            "and PUT again, or restart sbproxy.",
            details={
                "durable_state_advanced": True,
                "revision": stored.revision,
                "content_digest": stored.content_digest,
                "cause": exc.code,
            },
        ) from exc
    if stored is not None:
        report = report.model_copy(
            update={"store_revision": stored.revision, "store_digest": stored.content_digest}
        )
    return report


# -- entry points -------------------------------------------------------------------------


def revision_store(compiled: CompiledConfig) -> RevisionStore:
    """The revision store of an ``admin_managed`` host, or the fleet's of a
    ``cluster_authority`` host (the shared journal's ``desired_revisions``).

    Raises:
        SbproxyError: ``authority_read_only`` when the host is ``file_managed``.
    """
    host = compiled.model_host
    if host is not None and host.authority == Authority.CLUSTER_AUTHORITY and host.journal:
        # The fleet's desired state: the revision rows of the shared journal.
        return RevisionStore(
            Path(host.store_path or "fleet-revisions.json"),
            journal_url=host.journal.url.get_secret_value(),
        )
    if host is None or host.authority != Authority.ADMIN_MANAGED or host.store_path is None:
        raise SbproxyError(
            "deployments are read-only here: the authority is "
            f"{host.authority.value if host else 'file_managed'}",
            code="authority_read_only",
            remediation="Edit sb.yml and reload, or set authority: admin_managed.",
        )
    journal = host.journal.url.get_secret_value() if host.journal else None
    return RevisionStore(Path(host.store_path), journal_url=journal)


def with_deployments(
    compiled: CompiledConfig, deployments: Mapping[str, DeploymentConfig]
) -> CompiledConfig:
    """``compiled`` with its deployments replaced."""
    host = compiled.model_host
    if host is None:
        return compiled
    return replace(compiled, model_host=host.model_copy(update={"deployments": dict(deployments)}))


async def admin_desired(compiled: CompiledConfig) -> tuple[CompiledConfig, int | None]:
    """The effective desired state of ``compiled`` and the store revision it came from.

    ``file_managed``: ``compiled`` as is (revision ``None``). ``admin_managed``: the
    deployments of the revision store; an empty store is seeded with ``sb.yml``'s
    deployments (revision 1) when it declares any.

    Raises:
        SbproxyError: ``store_failed`` (unreadable store), ``invalid_desired`` (a stored
            deployment no longer validates).
    """
    host = compiled.model_host
    if host is None or host.authority != Authority.ADMIN_MANAGED:
        return compiled, None
    store = revision_store(compiled)
    current = await anyio.to_thread.run_sync(store.load)
    if current is None:
        if not compiled.deployments:
            return compiled, None
        catalog_file = host.catalog_file
        catalog = load_catalog(Path(catalog_file) if catalog_file else None)
        current = await anyio.to_thread.run_sync(
            lambda: store.compare_and_set(
                expected_revision=None,
                catalog_revision=catalog.catalog_revision,
                deployments=desired_of(compiled),
            )
        )
    deployments = {}
    for deployment, body in current.deployments.items():
        try:
            deployments[deployment] = DeploymentConfig.model_validate(body)
        except ValueError as exc:
            raise SbproxyError(
                f"stored deployment {deployment!r} is invalid: {exc}",
                code="invalid_desired",
                remediation="PUT a corrected desired state to /admin/model-host/deployments.",
            ) from exc
    return with_deployments(compiled, deployments), current.revision


async def reload(
    manager: RuntimeManager,
    candidate: CompiledConfig,
    *,
    source: str,
    use_store: bool = False,
    expected_revision: int | None = None,
) -> tuple[str, ReloadReport]:
    """Run the reload transaction to ``candidate``; ``(job_id, report)``.

    Reloads are serialized. The job runs here and is awaited.

    Raises:
        SbproxyError: the job's failure, with its reason code and ``job_id`` in details
            (``restart_required``, ``foundation_change``, ``revision_conflict``,
            ``insufficient_capacity``, ``crash_loop``, ``runtime_commit_failed``, ...).
    """
    desired = desired_of(candidate)
    digest = desired_digest(desired)
    async with manager.reload_lock:
        with manager.staging.offering(digest, candidate):
            submitted = await manager.engine.submit(
                reload_workflow,
                ReloadInput(
                    source=source,
                    content_digest=digest,
                    desired=desired,
                    use_store=use_store,
                    expected_revision=expected_revision,
                ),
                subject="runtime:reload",
            )
            job = await manager.engine.join(submitted.job.id)
    if job.status != JobStatus.SUCCEEDED or job.output is None:
        error = job.error
        raise SbproxyError(
            error.message if error else f"reload job {job.id} {job.status.value}",
            code=error.code if error else "prepare_failed",
            details={"job_id": job.id},
        )
    return job.id, ReloadReport.model_validate(job.output)


async def reload_from_source(manager: RuntimeManager, *, source: str) -> tuple[str, ReloadReport]:
    """Re-read the configuration file the host started from and reload to it.

    Raises:
        ConfigError: ``invalid_config`` (the file does not validate; nothing changes).
        SbproxyError: ``no_config_source`` when the host was not started from a file;
            ``lock_drift`` when the host serves ``--locked`` and the file drifts from the
            lockfile (nothing changes); any :func:`reload` failure.
    """
    path = manager.compiled.source
    if path is None:
        raise SbproxyError(
            "this host was not started from a configuration file",
            code="no_config_source",
            remediation="Start it with `sbproxy serve -f sb.yml` to reload from the file.",
        )
    loaded = await anyio.to_thread.run_sync(load_config, path)
    if manager.config_guard is not None:
        await manager.config_guard(loaded)
    host = loaded.model_host
    if host is not None and host.authority == Authority.CLUSTER_AUTHORITY:
        # The fleet places the deployments: this host keeps the ones placed on it.
        candidate = with_deployments(loaded, manager.compiled.deployments)
    else:
        candidate, _ = await admin_desired(loaded)
    return await reload(manager, candidate, source=source)
