"""The model host's use-case API: the one facade the CLI (offline) and a serving host's
admin API and console call alike (:meth:`ModelHostService.serving` takes it from the runtime).

A :class:`ModelHostService` binds one cache root (and its job journal), one catalog and,
optionally, one loaded configuration. Every mutation goes through a durable job: a pull
of an artifact that already has an unfinished pull joins that job (idempotency key = the
artifact digest), resuming it if its owner died.

Stale jobs are finished, never stepped over: before a verb decides what to do (or that
there is nothing to do) it resumes, under their own ids, the stale jobs of its kind and
subject (``running``, but their lease lapsed or their owner died: a killed CLI process). So a
``models remove`` killed after its delete step is finished by the next ``models remove``,
which then finds nothing cached, instead of leaving the killed job ``running`` for good.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from sbproxy.catalog import (
    ArtifactRequest,
    Catalog,
    ResolvedArtifact,
    WorkerProfile,
    load_catalog,
    resolve_artifact,
)
from sbproxy.config import CompiledConfig
from sbproxy.errors import SbproxyError
from sbproxy.model_host.artifacts import (
    ArtifactCache,
    CachedMetadata,
    CacheLayout,
    PartialDownload,
)
from sbproxy.model_host.artifacts.errors import CacheCorrupt, OfflineArtifactMissing
from sbproxy.model_host.engine_logs import LogTail, log_generations, read_tail
from sbproxy.model_host.flows import (
    GcInput,
    GcPreview,
    GcReport,
    PruneReport,
    PullInput,
    PullIntent,
    PullOutput,
    RemoveInput,
    RemoveOutput,
    artifact_subject,
    gc_preview,
    gc_workflow,
    network_files,
    prune_preview,
    prune_workflow,
    pull_workflow,
    registry,
    remove_workflow,
)
from sbproxy.model_host.flows.collect import cache_bytes
from sbproxy.model_host.runtime import probe_worker
from sbproxy.store import (
    ACTIVE_JOB_STATUSES,
    TERMINAL_JOB_STATUSES,
    DurationHistogram,
    EventRecord,
    JobRecord,
    JobStatus,
    StepRecord,
    UsageStore,
    journal_location,
    journal_node_id,
)
from sbproxy.workflows import Staleness, WorkflowEngine, owner_is_gone

if TYPE_CHECKING:
    from sbproxy.model_host.runtime.manager import RuntimeManager

__all__ = ["ArtifactJob", "ModelHostService", "PartialReport", "Selection", "open_service"]

GIB = 1024**3


@dataclass(frozen=True)
class Selection:
    """One artifact to act on, and why (the deployment or catalog entry behind it)."""

    artifact: ResolvedArtifact
    allow_pickle: bool = False
    pull_policy: str = "on_demand"
    deployment: str | None = None


@dataclass(frozen=True)
class ArtifactJob:
    """A finished job about one artifact, with its typed result when it succeeded."""

    selection: Selection
    job: JobRecord
    output: PullOutput | None = None


@dataclass(frozen=True)
class PartialReport:
    """One artifact's unfinished downloads and the pull job they belong to.

    Attributes:
        download: The ``partials/<digest>/`` directory and its files' bytes.
        job: The owner: the artifact's newest unfinished pull job, else its newest pull job
            of any state (``None`` when the journal has none, e.g. it was pruned).
        owned: Whether an unfinished (queued, running, parked) pull owns it: ``gc`` and
            ``prune`` keep it, and the next pull resumes from it. An unowned partial is
            abandoned: they delete it.
        owner_alive: For a ``running`` job, whether the process holding its lease lives
            (``False``: it was killed; the next pull of the artifact resumes the job);
            ``None`` for other states.
        model: The job's logical model, when the journal knows it.
        variant: The job's variant id, likewise.
        expected_bytes: Artifact path -> the catalog size of the file, from the job's input.
    """

    download: PartialDownload
    job: JobRecord | None
    owned: bool
    owner_alive: bool | None
    model: str | None = None
    variant: str | None = None
    expected_bytes: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class CacheOverview:
    """The artifact cache at a glance (the console's cache page).

    Attributes:
        published: Every published artifact, sorted by model and variant.
        used_bytes: Bytes a cache budget counts (blobs once, plus partials).
        budget_bytes: ``cache.budget_gib`` in bytes, if set.
        protected: Digest -> why removal and collection leave it alone.
        gc_preview: What a gc to the budget would delete now (``None``: no budget).
        orphans: What a prune would delete now.
    """

    published: list[CachedMetadata]
    used_bytes: int
    budget_bytes: int | None
    protected: dict[str, str]
    gc_preview: GcPreview | None
    orphans: PruneReport


@dataclass
class ModelHostService:
    """Model-host operations over one cache root: the one facade the CLI (offline) and the
    serving host's admin API and console use alike.

    Attributes:
        layout: The cache root's layout.
        catalog: The catalog in force (operator file or built-in).
        engine: The workflow engine over ``layout.journal``.
        config: The loaded configuration, if any.
        protection: Where a serving host's protection comes from (its runtime: configured
            and resident artifacts); ``None`` offline (the configured deployments).
        revision: On a serving host, the runtime's committed revision when the facade was
            taken (``None`` offline, or before the first commit).

    On a serving host, api/ takes a facade per request with :meth:`serving`: the runtime
    manager's cache root, journal, catalog and configuration are read there and nowhere else
    outside the runtime.
    """

    layout: CacheLayout
    catalog: Catalog
    engine: WorkflowEngine
    config: CompiledConfig | None = None
    protection: Callable[[], dict[str, str]] | None = None
    revision: int | None = None
    _usage: UsageStore | None = field(default=None, repr=False)
    _worker: WorkerProfile | None = field(default=None, repr=False)

    @classmethod
    def serving(cls, manager: RuntimeManager) -> ModelHostService:
        """The facade over a serving host's runtime as it is now: its cache root, journal,
        catalog, configuration and revision (a reload may change the last three, so take one
        per request), with the runtime's protection (configured and resident artifacts)."""
        return cls(
            layout=manager.layout,
            catalog=manager.catalog,
            engine=manager.engine,
            config=manager.compiled,
            protection=manager.artifact_protection,
            revision=manager.revision,
            _usage=UsageStore(manager.runtime_store.database),
            _worker=manager.worker,
        )

    @property
    def served(self) -> CompiledConfig:
        """The configuration in force (on a serving host: the one its runtime runs).

        Raises:
            SbproxyError: ``no_config_source`` when no configuration is loaded.
        """
        if self.config is None:
            raise SbproxyError(
                "no configuration is loaded",
                code="no_config_source",
                remediation="Start the host with a configuration file (`sbproxy serve -f`).",
            )
        return self.config

    def usage(self) -> UsageStore:
        """The per-key token usage kept in a serving host's journal database.

        Raises:
            SbproxyError: ``not_serving`` on a facade not taken with :meth:`serving`.
        """
        if self._usage is None:
            raise SbproxyError("token usage is kept by a serving host only", code="not_serving")
        return self._usage

    def with_config(self, candidate: CompiledConfig) -> ModelHostService:
        """This facade's cache root and journal under ``candidate`` and the catalog it names
        (operator file or built-in): what a reload guard checks a candidate with.

        Raises:
            CatalogError: ``invalid_catalog``.
        """
        host = candidate.model_host
        catalog_file = Path(host.catalog_file) if host is not None and host.catalog_file else None
        return ModelHostService(
            layout=self.layout,
            catalog=load_catalog(catalog_file),
            engine=self.engine,
            config=candidate,
        )

    @property
    def cache(self) -> ArtifactCache:
        """The artifact cache."""
        return ArtifactCache(self.layout)

    def worker(self) -> WorkerProfile:
        """This machine's worker profile (probed once)."""
        if self._worker is None:
            self._worker = probe_worker()
        return self._worker

    # -- selection -------------------------------------------------------------------------

    def select(self, model: str, *, variant: str | None = None, engine: str = "auto") -> Selection:
        """Resolve a catalog id to the exact artifact for this worker.

        Raises:
            ResolutionError: unknown model or variant, or nothing fits this worker.
        """
        request = ArtifactRequest.model_validate(
            {"model": model, "variant": variant, "engine": engine}
        )
        resolution = resolve_artifact(self.catalog, request, self.worker())
        entry = self.catalog.entry(model)
        return Selection(
            artifact=resolution.artifact,
            allow_pickle=entry.allow_pickle,
            pull_policy=str(entry.pull),
        )

    def configured(self) -> list[Selection]:
        """The artifacts of every configured deployment (empty without a configuration).

        Raises:
            ResolutionError: a deployment's model or variant is unknown, or nothing fits.
        """
        if self.config is None:
            return []
        return [self.deployment_selection(d) for d in self.config.deployments]

    def deployment_selection(self, deployment_id: str) -> Selection:
        """The artifact configured deployment ``deployment_id`` resolves to on this worker.

        Raises:
            KeyError: no configuration, or it has no such deployment.
            ResolutionError: its model or variant is unknown, or nothing fits this worker.
            CatalogError: ``unknown_catalog_model``.
        """
        if self.config is None:
            raise KeyError(deployment_id)
        deployment = self.config.deployments[deployment_id]
        request = ArtifactRequest.model_validate(
            {
                "model": deployment.model,
                "variant": deployment.variant,
                "engine": str(deployment.engine),
                "replicas": deployment.max_replicas,
                "heterogeneous_variants": deployment.heterogeneous_variants,
            }
        )
        resolution = resolve_artifact(self.catalog, request, self.worker())
        entry = self.catalog.entry(deployment.model)
        return Selection(
            artifact=resolution.artifact,
            allow_pickle=entry.allow_pickle,
            pull_policy=str(deployment.pull),
            deployment=deployment_id,
        )

    def on_boot_entries(self) -> list[Selection]:
        """Catalog entries whose own pull policy is ``on_boot``."""
        chosen = []
        for model_id, entry in self.catalog.models.items():
            if str(entry.pull) == "on_boot" and entry.variants:
                chosen.append(self.select(model_id))
        return chosen

    def protected(self) -> dict[str, str]:
        """Digests removal and collection must not touch, with why: ``configured``
        deployments' artifacts, and on a serving host ``resident`` ones (ready engines)."""
        if self.protection is not None:
            return self.protection()
        return {s.artifact.digest: "configured" for s in self.configured()}

    # -- jobs ------------------------------------------------------------------------------

    async def resume_stale(
        self, kind: str, *, subject: str | None = None, joining: str | None = None
    ) -> list[JobRecord]:
        """Finish the stale jobs of ``kind`` (and ``subject``) here, oldest first, before a
        verb of that kind decides anything; the jobs as they ended.

        A stale job holding the idempotency key ``joining`` is left for the caller's
        submission, which joins and runs it. One out of recoveries ends ``failed`` with
        ``recovery_exhausted`` (see ``WorkflowEngine.join``).
        """
        return await self.engine.resume_stale(kind, subject=subject, joining=joining)

    async def submit_pull(
        self,
        selection: Selection,
        *,
        offline: bool = False,
        intent: PullIntent = PullIntent.EXPLICIT,
        local_files: Mapping[str, str] | None = None,
    ) -> JobRecord:
        """Queue (or join) the pull job of ``selection``; returns the job.

        A stale pull of the artifact holds its digest as key, so the submission joins it and
        the caller's run resumes it; any other stale pull of the subject is finished first.
        """
        digest = selection.artifact.digest
        await self.resume_stale(
            pull_workflow.kind, subject=artifact_subject(digest), joining=digest
        )
        request = PullInput(
            artifact=selection.artifact,
            allow_pickle=selection.allow_pickle,
            offline=offline,
            intent=intent,
            pull_policy=selection.pull_policy,
            local_files=dict(local_files or {}),
        )
        submitted = await self.engine.submit(
            pull_workflow,
            request,
            idempotency_key=selection.artifact.digest,
            subject=artifact_subject(selection.artifact.digest),
        )
        if offline and not submitted.created:
            self._refuse_online_join(submitted.job)
        return submitted.job

    def _refuse_online_join(self, job: JobRecord) -> None:
        """An offline caller must not run an unfinished pull that still needs the network.

        Raises:
            OfflineArtifactMissing: ``offline_artifact_missing``; the job is left as it is,
                for a pull with network access to finish.
        """
        if job.status in TERMINAL_JOB_STATUSES:
            return
        joined = PullInput.model_validate(job.input)
        missing = [] if joined.offline else network_files(joined, self.cache)
        if missing:
            artifact = joined.artifact
            raise OfflineArtifactMissing(
                f"{artifact.logical_model}:{artifact.variant_id} is not cached: its pull "
                f"(job {job.id}) is unfinished and still needs the network for "
                f"{', '.join(missing)}, and network access is off",
                remediation="Run the same `sbproxy models pull` without --offline to finish "
                "that job.",
            )

    async def jobs(
        self,
        *,
        statuses: Sequence[JobStatus] = (),
        kind: str | None = None,
        limit: int = 100,
        node: str | None = None,
    ) -> list[JobRecord]:
        """Jobs in the journal, newest first, filtered by status, kind and the node that
        submitted them; at most ``limit`` (-1: all)."""
        return await self.engine.store.list_jobs(
            statuses=statuses, kind=kind, limit=limit, node=node
        )

    async def job(self, job_id: str) -> JobRecord:
        """The job ``job_id``.

        Raises:
            JobNotFound: ``job_not_found``.
        """
        return await self.engine.get(job_id)

    async def job_steps(self, job_id: str) -> list[StepRecord]:
        """The step journal of ``job_id``, in order."""
        return await self.engine.steps(job_id)

    async def job_events(
        self, job_id: str, *, after_seq: int = 0, limit: int = 500
    ) -> list[EventRecord]:
        """Up to ``limit`` events of ``job_id`` after sequence number ``after_seq``, oldest
        first."""
        return await self.engine.store.events(job_id, after_seq=after_seq, limit=limit)

    def follow_job(self, job_id: str, *, after_seq: int = 0) -> AsyncIterator[EventRecord]:
        """The events of ``job_id`` after ``after_seq`` as they are written, until the job
        is finished.

        Raises:
            JobNotFound: ``job_not_found``.
        """
        return self.engine.follow(job_id, after_seq=after_seq)

    async def cancel_job(self, job_id: str) -> JobRecord:
        """Request cancellation of ``job_id`` (at once when queued or parked, cooperative when
        running); the job after the request.

        Raises:
            JobNotFound: ``job_not_found``.
        """
        return await self.engine.cancel(job_id)

    async def retry_job(self, job_id: str) -> JobRecord:
        """Re-queue ``job_id`` when it failed or is parked (it resumes after its last
        completed step); the job after the request (unchanged when it was not retryable).

        Raises:
            JobNotFound: ``job_not_found``.
        """
        return await self.engine.retry(job_id)

    def job_outcomes(
        self,
    ) -> tuple[dict[tuple[str, str], int], dict[str, DurationHistogram]]:
        """Jobs this process brought to a terminal status: ``(workflow, status) -> count``
        and ``workflow -> histogram`` of seconds from first start to end (copies)."""
        outcomes = self.engine.store.outcomes
        return outcomes.counts(), outcomes.durations()

    def journal_writes(self) -> tuple[DurationHistogram, DurationHistogram, DurationHistogram]:
        """This process's journal writes: seconds waited before a transaction, seconds per
        commit, and writes per commit (copies)."""
        return self.engine.store.write_tallies.snapshot()

    async def run(self, job: JobRecord) -> JobRecord:
        """Run ``job`` here (or wait for its live owner) until it finishes."""
        return await self.engine.join(job.id)

    async def pull(
        self,
        selection: Selection,
        *,
        offline: bool = False,
        intent: PullIntent = PullIntent.EXPLICIT,
        local_files: Mapping[str, str] | None = None,
        on_submit: Callable[[JobRecord], Awaitable[None]] | None = None,
    ) -> ArtifactJob:
        """Pull (or import) one artifact and wait for the outcome."""
        job = await self.submit_pull(
            selection, offline=offline, intent=intent, local_files=local_files
        )
        if on_submit is not None:
            await on_submit(job)
        final = await self.run(job)
        output = (
            PullOutput.model_validate(final.output) if final.status == JobStatus.SUCCEEDED else None
        )
        return ArtifactJob(selection=selection, job=final, output=output)

    async def remove(
        self, selection: Selection, *, stale: bool = False
    ) -> tuple[RemoveOutput, JobRecord | None]:
        """Remove one artifact; no job when it is not cached and no removal of it was left
        unfinished (idempotent).

        With ``stale``, the removal job first cancels the artifact's stale pull -- one left
        ``running`` by an owner process that is gone -- so that its partial download is
        deleted and nothing resumes it (``release_stale_pulls``); a pull whose owner may be
        alive still refuses the removal (``removal_blocked``, ``running``).

        A stale removal of the artifact (a ``models remove`` killed mid-job) is resumed first
        and, when it succeeded and the artifact is gone, is the result: its job and output
        (``removed: false`` when the killed run had deleted everything before it died). A
        resumed removal that did not succeed is returned as it ended, for the caller to
        report, rather than tried again.
        """
        digest = selection.artifact.digest
        subject = artifact_subject(digest)
        resumed = await self.resume_stale(remove_workflow.kind, subject=subject)
        state = self.cache.lookup(selection.artifact)
        if resumed and (resumed[-1].status != JobStatus.SUCCEEDED or state.kind == "missing"):
            return self._removal(digest, resumed[-1])
        if state.kind == "missing":
            return RemoveOutput(artifact_digest=digest, removed=False, reclaimed_bytes=0), None
        return self._removal(digest, await self.remove_digest(digest, stale=stale))

    async def remove_digest(self, digest: str, *, stale: bool = False) -> JobRecord:
        """Run the ``remove`` job of the published artifact ``digest`` (joined when one is
        unfinished), leaving :meth:`protected` artifacts alone; the job as it ended (failed
        with ``removal_blocked`` when the artifact is protected or in use). ``stale`` as in
        :meth:`remove`."""
        submitted = await self.engine.submit(
            remove_workflow,
            RemoveInput(digest=digest, protected=self.protected(), stale=stale),
            idempotency_key=f"remove:{digest}",
            subject=artifact_subject(digest),
        )
        return await self.engine.join(submitted.job.id)

    @staticmethod
    def _removal(digest: str, job: JobRecord) -> tuple[RemoveOutput, JobRecord]:
        """A finished removal job and its output (nothing removed unless it succeeded)."""
        if job.status == JobStatus.SUCCEEDED:
            return RemoveOutput.model_validate(job.output), job
        return RemoveOutput(artifact_digest=digest, removed=False, reclaimed_bytes=0), job

    async def unfinished_pull(self, digest: str) -> tuple[JobRecord, Staleness | None] | None:
        """The newest queued, running or parked pull job of ``digest`` and, when it is
        stale, why (what a refused removal tells the operator)."""
        jobs = await self.engine.store.list_jobs(
            statuses=tuple(ACTIVE_JOB_STATUSES),
            kind=pull_workflow.kind,
            subject=artifact_subject(digest),
        )
        if not jobs:
            return None
        return jobs[0], await self.engine.staleness(jobs[0])

    async def gc(self, *, budget_bytes: int) -> tuple[GcReport | None, JobRecord]:
        """Collect the cache down to ``budget_bytes`` (protected artifacts stay).

        Stale collections for other budgets are finished first (one for this budget is
        joined and resumed by the submission).
        """
        key = f"gc:{budget_bytes}"
        await self.resume_stale(gc_workflow.kind, joining=key)
        submitted = await self.engine.submit(
            gc_workflow,
            GcInput(budget_bytes=budget_bytes, protected=self.protected()),
            idempotency_key=key,
        )
        job = await self.engine.join(submitted.job.id)
        report = GcReport.model_validate(job.output) if job.status == JobStatus.SUCCEEDED else None
        return report, job

    async def prune(self) -> tuple[PruneReport | None, JobRecord]:
        """Delete blobs that no published artifact references (a stale prune holds the key
        ``prune``: the submission joins and resumes it)."""
        await self.resume_stale(prune_workflow.kind, joining="prune")
        submitted = await self.engine.submit(
            prune_workflow, GcInput(budget_bytes=0), idempotency_key="prune"
        )
        job = await self.engine.join(submitted.job.id)
        report = (
            PruneReport.model_validate(job.output) if job.status == JobStatus.SUCCEEDED else None
        )
        return report, job

    async def prune_preview(self) -> PruneReport:
        """What :meth:`prune` would delete."""
        return await prune_preview(self.cache, self.engine.store)

    def budget_bytes(self) -> int | None:
        """``cache.budget_gib`` of the configuration in bytes (floor), if set."""
        host = self.config.model_host if self.config else None
        if host is None or host.cache.budget_gib is None:
            return None
        return int(host.cache.budget_gib * GIB)

    # -- inspection ------------------------------------------------------------------------

    def cached(self) -> list[CachedMetadata]:
        """Every published artifact."""
        return self.cache.published()

    def artifact_names(self) -> dict[str, str]:
        """Published artifact digest -> ``model:variant``. Blocking: reads the cache."""
        return {m.artifact_digest: f"{m.logical_model}:{m.variant_id}" for m in self.cached()}

    async def overview(self) -> CacheOverview:
        """The cache, its budget use, its protection and what gc and prune would delete."""
        cache = self.cache
        published, used = await anyio.to_thread.run_sync(
            lambda: (cache.published(), cache_bytes(cache))
        )
        protected = self.protected()
        budget = self.budget_bytes()
        preview = (
            await gc_preview(
                cache, self.engine.store, GcInput(budget_bytes=budget, protected=protected)
            )
            if budget is not None
            else None
        )
        return CacheOverview(
            published=sorted(published, key=lambda m: (m.logical_model, m.variant_id)),
            used_bytes=used,
            budget_bytes=budget,
            protected=protected,
            gc_preview=preview,
            orphans=await self.prune_preview(),
        )

    def status_of(self, model_id: str) -> str:
        """``cached`` when some published artifact is a variant of ``model_id``."""
        for metadata in self.cached():
            if (
                metadata.logical_model == model_id
                and self.cache.snapshot(metadata.artifact_digest).is_dir()
            ):
                return "cached"
        return "not-pulled"

    async def partials(self) -> list[PartialReport]:
        """Every unfinished download in the cache with its owning pull job, by digest.

        A job owns the partial of the artifact digest in its input (as ``gc`` and ``prune``
        decide ownership): the newest unfinished pull of that digest, else its newest pull.
        """
        downloads = await anyio.to_thread.run_sync(self.cache.partial_downloads)
        if not downloads:
            return []
        unfinished: dict[str, JobRecord] = {}
        newest: dict[str, JobRecord] = {}
        for record in await self.engine.store.list_jobs(kind="pull", limit=-1):  # newest first
            digest = str(record.input.get("artifact", {}).get("digest", ""))
            newest.setdefault(digest, record)
            if record.status in ACTIVE_JOB_STATUSES:
                unfinished.setdefault(digest, record)
        reports = []
        for download in downloads:
            owner = unfinished.get(download.digest)
            job = owner or newest.get(download.digest)
            alive = None
            if job is not None and job.status == JobStatus.RUNNING:
                alive = job.lease_owner is not None and not owner_is_gone(job.lease_owner)
            artifact = None
            if job is not None:
                with contextlib.suppress(ValueError):  # a job of an older, other input shape
                    artifact = PullInput.model_validate(job.input).artifact
            reports.append(
                PartialReport(
                    download=download,
                    job=job,
                    owned=owner is not None,
                    owner_alive=alive,
                    model=artifact.logical_model if artifact else None,
                    variant=artifact.variant_id if artifact else None,
                    expected_bytes={f.path: f.size_bytes for f in artifact.files}
                    if artifact
                    else {},
                )
            )
        return reports

    def engine_logs(self) -> dict[str, list[int]]:
        """Deployment -> the engine generations whose output is kept, newest first.
        Blocking: lists the logs directory."""
        return log_generations(self.layout.logs)

    def engine_log(self, deployment: str, generation: int) -> LogTail:
        """The redacted end of ``deployment``'s engine generation ``generation`` output (an
        empty tail when there is none). Blocking: reads the file."""
        return read_tail(self.layout.engine_log(deployment, generation))

    async def verify(self, metadata: CachedMetadata, *, full: bool) -> str | None:
        """Re-verify one published artifact; the corruption reason, or None when intact."""
        try:
            await anyio.to_thread.run_sync(lambda: self.cache.verify(metadata, full=full))
        except CacheCorrupt as exc:
            return exc.message
        return None

    async def close(self) -> None:
        """Close the journal."""
        await self.engine.close()


@asynccontextmanager
async def open_service(
    layout: CacheLayout,
    *,
    config: CompiledConfig | None = None,
    catalog_file: Path | None = None,
) -> AsyncIterator[ModelHostService]:
    """Open the cache's journal and catalog for the duration of a ``with`` block.

    The catalog is ``catalog_file`` if given, else the configuration's ``catalog_file``,
    else the built-in one.

    Raises:
        CatalogError: ``invalid_catalog`` (checked before the cache root is touched).
        SbproxyError: ``invalid_cache_dir`` when the cache root cannot be created or written
            (a read-only file system, no permission, a file in the way);
            ``invalid_journal_url`` when ``$SBPROXY_JOURNAL_URL`` names no PostgreSQL server
            (the journal is :func:`~sbproxy.store.journal_location`'s, as ``serve``'s).
    """
    host = config.model_host if config else None
    chosen = catalog_file or (Path(host.catalog_file) if host and host.catalog_file else None)
    catalog = load_catalog(chosen)
    cache = ArtifactCache.open(layout)
    location = journal_location(layout.journal, host)
    # On a shared PostgreSQL journal the cache's own node id, never the host name.
    node = journal_node_id(location, layout.root, host.node.id if host else None)
    engine = await WorkflowEngine.open(location, registry, resources=[cache], node=node)
    service = ModelHostService(layout=layout, catalog=catalog, engine=engine, config=config)
    try:
        yield service
    finally:
        await service.close()
