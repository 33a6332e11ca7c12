"""The ``remove``, ``gc`` and ``prune`` workflows.

``remove`` deletes one exact artifact (idempotency key ``remove:<digest>``); with ``stale`` it
first cancels the artifact's stale pull -- a pull job still ``running`` under an owner process
that is certainly gone (SIGKILLed, or from a previous boot) -- so that its partial download
can go and nothing resumes the job afterwards (a later pull is a new job that starts from
byte 0). A pull whose owner may be alive is never touched: the delete refuses it. ``gc`` brings
the cache under ``cache.budget_gib``, least recently used first, skipping protected
artifacts (key ``gc``); ``prune`` deletes blobs no artifact references (key ``prune``).

What the budget counts is every byte the cache holds on disk: the blob store (shared blobs
once) *and* ``partials/`` (unfinished downloads with their resume state). Abandoned partials
are deleted first; the partials of unfinished pulls are kept but still count, so ``gc``
makes room for them by collecting published artifacts, and ``before_bytes`` /
``after_bytes`` report what really occupies the disk.
Each deletion step re-checks protection under the exclusive cache-mutation lock, so a plan
made earlier never deletes something that became protected since.
"""

from __future__ import annotations

from functools import partial

import anyio
import anyio.to_thread
from pydantic import BaseModel, ConfigDict, Field

from sbproxy.model_host.artifacts.cache import ArtifactCache
from sbproxy.model_host.artifacts.collect import (
    Deletion,
    abandoned_partials,
    delete_artifact,
    delete_orphans,
    lease_or_lock_reason,
    orphan_blobs,
)
from sbproxy.model_host.artifacts.errors import RemovalBlocked
from sbproxy.model_host.artifacts.locks import hold
from sbproxy.model_host.registry import registry
from sbproxy.store import JobJournal, JobStatus, JobStore
from sbproxy.workflows import StepContext, WorkflowContext, owner_is_gone, step

__all__ = [
    "GcInput",
    "GcPreview",
    "GcReport",
    "PruneReport",
    "RemoveInput",
    "RemoveOutput",
    "active_pull_state",
    "artifact_subject",
    "cache_bytes",
    "gc_preview",
    "gc_workflow",
    "prune_workflow",
    "remove_workflow",
]

_ACTIVE = (JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.PARKED)


def cache_bytes(cache: ArtifactCache) -> int:
    """Bytes a cache budget counts: the blob store (shared blobs once) plus ``partials/``."""
    return cache.blob_bytes() + cache.partial_bytes()


def artifact_subject(digest: str) -> str:
    """Job subject of everything done to one artifact."""
    return f"artifact:sha256:{digest}"


async def active_pull_state(store: JobJournal, digest: str) -> str | None:
    """State of an unfinished pull job of ``digest`` (``queued``, ``running``, ``parked``)."""
    jobs = await store.list_jobs(statuses=_ACTIVE, kind="pull", subject=artifact_subject(digest))
    return jobs[0].status.value if jobs else None


class RemoveInput(BaseModel):
    """Remove one artifact; ``protected`` maps digests to reasons decided by the caller;
    ``stale`` also cancels a stale pull of it whose owner process is gone (see the module
    docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    digest: str
    protected: dict[str, str] = Field(default_factory=dict)
    stale: bool = False


class RemoveOutput(BaseModel):
    """Result of a removal.

    ``removed`` says whether a published artifact was deleted; ``reclaimed_bytes`` counts
    what was freed, a partial download included; ``cancelled_pulls`` are the stale pull jobs
    a ``stale`` removal cancelled.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    artifact_digest: str
    removed: bool
    reclaimed_bytes: int
    cancelled_pulls: tuple[str, ...] = ()


class Released(BaseModel):
    """Output of ``release``: the stale pull jobs it cancelled."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cancelled: tuple[str, ...] = ()


async def _delete(ctx: StepContext, digest: str, protected: dict[str, str]) -> Deletion | str:
    cache = ctx.resource(ArtifactCache)
    blocked = dict(protected)
    state = await active_pull_state(ctx.resource(JobStore), digest)
    if state is not None and digest not in blocked:
        blocked[digest] = state
    async with hold(cache.mutation_lock()):
        return await anyio.to_thread.run_sync(
            lambda: delete_artifact(cache, digest, blocked=blocked)
        )


@step("delete")
async def delete_step(ctx: StepContext, request: RemoveInput) -> RemoveOutput:
    """Delete the artifact or refuse with the reason that protects it.

    Idempotency: every piece of a deletion tolerates being absent; a second run of a
    finished deletion reports ``removed: false``.
    """
    outcome = await _delete(ctx, request.digest, request.protected)
    if isinstance(outcome, str):
        raise RemovalBlocked(
            f"artifact {request.digest} cannot be removed: {outcome}",
            details={"reason": outcome, "artifact_digest": request.digest},
        )
    return RemoveOutput(
        artifact_digest=request.digest,
        removed=outcome.removed,
        reclaimed_bytes=outcome.reclaimed_bytes,
    )


@step("release")
async def release_stale_pulls(ctx: StepContext, request: RemoveInput) -> Released:
    """Cancel the artifact's pull jobs left ``running`` by an owner process that is gone.

    Each is marked first (a ``cancel_requested`` event, and a ``discarded`` event naming
    this removal), taken from its dead owner as recovery would (``queued``), then cancelled
    while queued: ``cancelled`` is terminal, so no later pull, server or ``jobs retry``
    resumes it. Should another process recover it in between, its run sees the cancellation
    at its next check and stops, and the delete step refuses while it still runs. A pull
    whose owner may be alive (a live pid, or a lapsed lease of an owner that cannot be proven
    dead) is left for the delete step to refuse.

    Idempotency: a pull already cancelled no longer runs; a rerun cancels nothing more (and
    its output lists only what it cancelled itself).
    """
    store = ctx.resource(JobStore)
    running = await store.list_jobs(
        statuses=(JobStatus.RUNNING,),
        kind="pull",
        subject=artifact_subject(request.digest),
        limit=-1,
    )
    cancelled = []
    for job in running:
        owner = job.lease_owner
        if owner is None or not owner_is_gone(owner):
            continue
        await store.request_cancel(job.id)  # whoever runs it next stops at once
        await store.record_event(
            job.id,
            kind="discarded",
            data={"reason": "owner_gone", "owner": owner, "by_job": ctx.job_id},
        )
        if await store.recover_from(job.id, owner=owner, reason="owner_gone", max_recoveries=None):
            await store.request_cancel(job.id)  # queued now: cancelled at once
        final = await store.get(job.id)
        if final is not None and final.status == JobStatus.CANCELLED:
            cancelled.append(job.id)
    return Released(cancelled=tuple(cancelled))


@registry.workflow("remove", version=1)
async def remove_workflow(ctx: WorkflowContext, request: RemoveInput) -> RemoveOutput:
    """Remove one exact artifact (fails closed with ``removal_blocked``); a ``stale``
    removal first releases the artifact's stale pull (``release``)."""
    if not request.stale:
        return await ctx.step(delete_step, request)
    released = await ctx.step(release_stale_pulls, request)
    output = await ctx.step(delete_step, request)
    return output.model_copy(update={"cancelled_pulls": released.cancelled})


class GcInput(BaseModel):
    """Collect down to ``budget_bytes``; ``protected`` maps digests to reasons."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    budget_bytes: int = Field(ge=0)
    protected: dict[str, str] = Field(default_factory=dict)


class GcPlan(BaseModel):
    """Victims in deletion order, and why others were skipped."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    before_bytes: int
    victims: tuple[str, ...]
    skipped: dict[str, str]


class GcDeleteInput(BaseModel):
    """One deletion of a collection."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    digest: str
    protected: dict[str, str]


class GcDeleted(BaseModel):
    """Outcome of one deletion of a collection."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    digest: str
    reclaimed_bytes: int
    skipped_reason: str | None = None


class GcReport(BaseModel):
    """Result of a collection (the reference's GC report)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    before_bytes: int
    after_bytes: int
    reclaimed_bytes: int
    deleted_artifacts: list[str]
    skipped_artifacts: dict[str, str]
    budget_unsatisfied_bytes: int


class PruneReport(BaseModel):
    """Result of a prune: unreferenced blobs and abandoned partial downloads deleted."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    orphan_blobs: int
    reclaimed_bytes: int
    abandoned_partials: int = 0


async def owned_partials(store: JobJournal) -> set[str]:
    """Digests whose partial downloads an unfinished pull job owns (kept by prune and gc)."""
    jobs = await store.list_jobs(statuses=_ACTIVE, kind="pull", limit=-1)
    return {str(job.input.get("artifact", {}).get("digest", "")) for job in jobs} - {""}


@step("orphans")
async def orphans_step(ctx: StepContext, _: GcInput) -> PruneReport:
    """Delete abandoned partial downloads, blobs no artifact references, leftover work dirs.

    Idempotency: deleting what is already gone frees nothing and reports zero.
    """
    cache = ctx.resource(ArtifactCache)
    async with hold(cache.mutation_lock()):
        owned = await owned_partials(ctx.resource(JobStore))
        done = await anyio.to_thread.run_sync(partial(delete_orphans, cache, owned=owned))
    return PruneReport(
        orphan_blobs=done.orphan_blobs,
        reclaimed_bytes=done.reclaimed_bytes,
        abandoned_partials=done.abandoned_partials,
    )


class GcPreview(BaseModel):
    """What a collection would delete now (a dry run): nothing is changed.

    ``reclaim_bytes`` counts a shared blob once, when its last referencing victim goes.
    The real ``gc`` deletes abandoned partials and orphan blobs first (:func:`prune_preview`
    says how much), so its plan can need fewer victims than this one.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    budget_bytes: int
    before_bytes: int
    victims: tuple[str, ...]
    skipped: dict[str, str]
    reclaim_bytes: int


async def _plan(cache: ArtifactCache, store: JobJournal, request: GcInput) -> tuple[GcPlan, int]:
    """The plan of a collection and the bytes its victims free (reads only)."""
    before = cache_bytes(cache)
    excess = before - request.budget_bytes
    victims: list[str] = []
    skipped: dict[str, str] = {}
    by_age = sorted(cache.published(), key=lambda m: (m.last_accessed_ms, m.artifact_digest))
    referenced_by: dict[str, int] = {}
    for metadata in by_age:
        for item in metadata.files:
            referenced_by[item.sha256] = referenced_by.get(item.sha256, 0) + 1
    freed = 0
    for metadata in by_age:
        if excess <= 0:
            break
        digest = metadata.artifact_digest
        reason = request.protected.get(digest) or await active_pull_state(store, digest)
        reason = reason or lease_or_lock_reason(cache, digest)
        if reason is not None:
            skipped[digest] = reason
            continue
        victims.append(digest)
        for item in metadata.files:
            referenced_by[item.sha256] -= 1
            if referenced_by[item.sha256] == 0:  # a shared blob frees its bytes only once
                excess -= item.size_bytes
                freed += item.size_bytes
    return GcPlan(before_bytes=before, victims=tuple(victims), skipped=skipped), freed


async def gc_preview(cache: ArtifactCache, store: JobJournal, request: GcInput) -> GcPreview:
    """What ``gc`` to ``request.budget_bytes`` would delete now (``--dry-run``, the console's
    cache page): the same plan as the job's ``plan`` step, nothing changed."""
    plan, freed = await _plan(cache, store, request)
    return GcPreview(
        budget_bytes=request.budget_bytes,
        before_bytes=plan.before_bytes,
        victims=plan.victims,
        skipped=plan.skipped,
        reclaim_bytes=freed,
    )


@step("plan")
async def gc_plan(ctx: StepContext, request: GcInput) -> GcPlan:
    """Choose victims, least recently used first, until the budget would hold.

    Idempotency: reads only.
    """
    plan, _ = await _plan(ctx.resource(ArtifactCache), ctx.resource(JobStore), request)
    return plan


@step("delete")
async def gc_delete(ctx: StepContext, request: GcDeleteInput) -> GcDeleted:
    """Delete one victim unless it became protected since the plan.

    Idempotency: as ``remove``'s delete; a victim already gone frees nothing.
    """
    outcome = await _delete(ctx, request.digest, request.protected)
    if isinstance(outcome, str):
        return GcDeleted(digest=request.digest, reclaimed_bytes=0, skipped_reason=outcome)
    return GcDeleted(digest=request.digest, reclaimed_bytes=outcome.reclaimed_bytes)


@step("measure")
async def gc_measure(ctx: StepContext, _: GcInput) -> int:
    """Bytes the cache holds after the collection (blobs and partials).

    Idempotency: reads only.
    """
    return cache_bytes(ctx.resource(ArtifactCache))


@registry.workflow("gc", version=1)
async def gc_workflow(ctx: WorkflowContext, request: GcInput) -> GcReport:
    """Bring the cache under its budget: orphan blobs first, then LRU artifacts."""
    orphans = await ctx.step(orphans_step, request)
    plan = await ctx.step(gc_plan, request)
    skipped = dict(plan.skipped)
    deleted: list[str] = []
    for digest in plan.victims:
        done = await ctx.step(
            gc_delete,
            GcDeleteInput(digest=digest, protected=request.protected),
            name=f"delete:{digest}",
        )
        if done.skipped_reason is not None:
            skipped[digest] = done.skipped_reason
        else:
            deleted.append(digest)
    after = await ctx.step(gc_measure, request)
    before = plan.before_bytes + orphans.reclaimed_bytes
    return GcReport(
        before_bytes=before,
        after_bytes=after,
        reclaimed_bytes=max(before - after, 0),
        deleted_artifacts=deleted,
        skipped_artifacts=skipped,
        budget_unsatisfied_bytes=max(after - request.budget_bytes, 0),
    )


@registry.workflow("prune", version=1)
async def prune_workflow(ctx: WorkflowContext, request: GcInput) -> PruneReport:
    """Delete blobs that no published artifact references."""
    return await ctx.step(orphans_step, request)


async def prune_preview(cache: ArtifactCache, store: JobJournal) -> PruneReport:
    """What a prune would delete (``--dry-run``): nothing is changed.

    Blobs that only an abandoned partial's manifest protects are counted with the blobs a
    prune would free, as the prune deletes the partial first.
    """
    abandoned = abandoned_partials(cache, await owned_partials(store))
    kept = cache.pending_blobs(excluding=set(abandoned))
    orphans = orphan_blobs(cache, pending=kept)
    return PruneReport(
        orphan_blobs=len(orphans),
        reclaimed_bytes=sum(orphans.values()) + sum(abandoned.values()),
        abandoned_partials=len(abandoned),
    )
