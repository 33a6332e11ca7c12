"""The ``pull`` workflow: make one exact artifact ready in the cache.

Steps (each journaled; a crash resumes after the last completed one):

1. ``plan`` -- a verified hit ends the job (size + BLAKE3 re-check, ``cache_corrupt`` on
   tampering, never repaired); a miss is checked against the pull policy (``manual``,
   ``--offline``, pickle opt-in), lists the files whose blobs are not yet stored, and checks
   that the cache file system has room for them (their sizes less what their partials
   already hold, plus 1 MiB kept for the journal): ``disk_full`` with the figures otherwise,
   before anything is written.
2. ``fetch:<path>`` per missing file -- the same space check for this file, then download
   (``hf:``, resumable from the partial's length, hashed while it streams) or copy
   (``file:`` and imports), verify size and SHA-256, scan pickles, promote the partial into
   ``blobs/sha256``. On a fleet a download asks the members that hold the artifact first
   (:mod:`~sbproxy.model_host.artifacts.peers`) and the upstream only when none delivers the
   file whole and verified; the step's output names the source (``source``: a node id or
   ``upstream``) and the job's ``source`` events say which source served how many bytes and
   which peers failed, why.
3. ``publish`` -- assemble the snapshot from blobs atomically and write the ready marker.
   A blob this job did not fetch itself (shared with another artifact, or left by an
   earlier run) is re-hashed first and must match its SHA-256 (``cache_corrupt``
   otherwise), so nothing unverified is ever published.

One job per artifact: the idempotency key is the artifact digest, so a second pull of the
same artifact (another CLI process, the server) joins the running job. Credentials are read
from the environment inside ``fetch`` and never enter the job input or journal.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Awaitable, Callable
from enum import StrEnum
from functools import partial
from pathlib import Path

import anyio
import anyio.to_thread
from blake3 import blake3
from pydantic import BaseModel, ConfigDict, Field

from sbproxy.catalog import ArtifactFormat, ResolvedArtifact
from sbproxy.model_host.artifacts.cache import ArtifactCache
from sbproxy.model_host.artifacts.download import (
    DownloadResult,
    RemoteFile,
    download_file,
    hash_file,
    partial_length,
)
from sbproxy.model_host.artifacts.errors import (
    CacheCorrupt,
    DigestMismatch,
    DiskFull,
    ManualArtifactMissing,
    OfflineArtifactMissing,
    PickleRefused,
    SizeMismatch,
    SourceError,
)
from sbproxy.model_host.artifacts.peers import PeerFailure, PeerSources, download_from_peers
from sbproxy.model_host.artifacts.pickle_scan import scan_pickle_file
from sbproxy.model_host.artifacts.sources import (
    FileSource,
    HfSource,
    hf_endpoint,
    hf_token,
    parse_source,
)
from sbproxy.model_host.artifacts.space import disk_full_errors, require_space
from sbproxy.model_host.registry import registry
from sbproxy.workflows import RetryPolicy, StepContext, WorkflowContext, step

__all__ = [
    "PullInput",
    "PullIntent",
    "PullOutput",
    "network_files",
    "pull_workflow",
    "reused_blob_fingerprint",
]

# Transient network failures (cut streams, timeouts, 5xx) retry inside the fetch step; each
# retry resumes from the partial. Delays 0.5 s doubling up to 10 s: a minute of patience.
FETCH_RETRY = RetryPolicy(max_attempts=6, initial_delay_s=0.5, max_delay_s=10.0)
COPY_BLOCK_BYTES = 4 * 1024 * 1024


class PullIntent(StrEnum):
    """Why the artifact is wanted: an operator's pull overrides ``manual``."""

    EXPLICIT = "explicit"
    STARTUP = "startup"
    RUNTIME = "runtime"


class PullInput(BaseModel):
    """Input of a pull (or import) job. Never holds credentials."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    artifact: ResolvedArtifact
    allow_pickle: bool = False
    offline: bool = False
    intent: PullIntent = PullIntent.EXPLICIT
    pull_policy: str = Field(default="on_demand", description="on_boot, on_demand or manual")
    local_files: dict[str, str] = Field(
        default_factory=dict,
        description="Import: relative path -> absolute local file to copy instead of fetching.",
    )


class FileTask(BaseModel):
    """One file the job must fetch or copy."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    digest: str
    path: str
    sha256: str
    size_bytes: int
    url: str | None = None
    local_path: str | None = None
    offset_bytes: int = 0
    total_bytes: int = 0
    pickle: bool = False


class Plan(BaseModel):
    """Output of ``plan``: a verified hit, or the files still to fetch."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hit: bool
    snapshot_path: str | None = None
    fetch: tuple[FileTask, ...] = ()


class FetchResult(BaseModel):
    """Output of one ``fetch:<path>`` step."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    blake3: str
    size_bytes: int
    resumed_from: int = 0
    transferred_bytes: int = 0
    source: str = "upstream"
    """Where the bytes came from: ``upstream`` (the catalog's source, or a local file), or
    the node id of the fleet member that served them."""


class PublishInput(BaseModel):
    """Input of ``publish``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    artifact: ResolvedArtifact
    allow_pickle: bool
    fingerprints: dict[str, str]


class PullOutput(BaseModel):
    """Result of a pull job."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    artifact_digest: str
    snapshot_path: str
    verified_bytes: int
    cache_hit: bool
    transferred_bytes: int = 0
    sources: dict[str, int] = Field(default_factory=dict)
    """Bytes transferred by source (``upstream`` or a member's node id) for this job."""


def _remediation(artifact: ResolvedArtifact) -> str:
    return (
        f"Run `sbproxy models pull {artifact.logical_model} --variant {artifact.variant_id}` first."
    )


def _check_policy(request: PullInput, cache: ArtifactCache) -> None:
    """Refuse a miss the pull policy, the network setting or the pickle rules forbid."""
    artifact = request.artifact
    if artifact.format == ArtifactFormat.PICKLE and not request.allow_pickle:
        raise PickleRefused(
            f"{artifact.logical_model}:{artifact.variant_id} is a pickle artifact and its "
            "catalog entry does not set allow_pickle: true",
            remediation="Prefer a safetensors or GGUF variant.",
        )
    if request.pull_policy == "manual" and request.intent != PullIntent.EXPLICIT:
        raise ManualArtifactMissing(
            f"{artifact.logical_model}:{artifact.variant_id} is not cached and its pull "
            "policy is manual",
            remediation=_remediation(artifact),
        )
    if request.offline:
        missing = network_files(request, cache)
        if missing:
            raise OfflineArtifactMissing(
                f"{artifact.logical_model}:{artifact.variant_id} is not cached and network "
                f"access is off (missing: {', '.join(missing)})",
                remediation="Pull it without --offline, or import the files with "
                "`sbproxy models import`.",
            )


def network_files(request: PullInput, cache: ArtifactCache) -> list[str]:
    """Paths of ``request``'s files that only a download can provide (no blob stored yet)."""
    artifact = request.artifact
    if request.local_files or not isinstance(parse_source(artifact.source), HfSource):
        return []
    return [f.path for f in artifact.files if not cache.blob_ok(f.sha256, f.size_bytes)]


def reused_blob_fingerprint(cache: ArtifactCache, *, path: str, sha256: str) -> str:
    """BLAKE3 of a stored blob about to serve a new snapshot, after checking its SHA-256.

    A blob found in the store (left by another artifact, or by an earlier run) is only
    trusted for its size until then: its bytes are hashed once, SHA-256 and BLAKE3 in one
    read, so a damaged blob is never published as verified. Blocking; run it on a thread.

    Raises:
        CacheCorrupt: ``cache_corrupt``: the blob's bytes no longer match its name.
    """
    blob = cache.blob(sha256)
    sha, b3 = hash_file(blob)
    if sha.hexdigest() != sha256:
        raise CacheCorrupt(
            f"the stored blob {blob} (for {path}) no longer matches its SHA-256; "
            "nothing was published",
            remediation="Run `sbproxy models verify --full` to find the artifacts that share "
            "it, remove them with `sbproxy models remove`, run `sbproxy models prune`, then "
            "pull again.",
        )
    fingerprint: str = b3.hexdigest()
    return fingerprint


def _tasks(request: PullInput, cache: ArtifactCache) -> tuple[FileTask, ...]:
    """One task per file whose blob is not stored yet, with where to get it."""
    artifact = request.artifact
    unknown = set(request.local_files) - {f.path for f in artifact.files}
    if unknown:
        raise SourceError(f"{', '.join(sorted(unknown))} is not a file of this artifact")
    source = parse_source(artifact.source)
    single = len(artifact.files) == 1
    tasks = []
    offset = 0
    for item in artifact.files:
        if not cache.blob_ok(item.sha256, item.size_bytes):
            url = local = None
            if item.path in request.local_files:
                local = request.local_files[item.path]
            elif isinstance(source, FileSource):
                local = str(source.file(item.path, single=single))
            else:
                url = source.url(revision=artifact.revision, path=item.path, endpoint=hf_endpoint())
            tasks.append(
                FileTask(
                    digest=artifact.digest,
                    path=item.path,
                    sha256=item.sha256,
                    size_bytes=item.size_bytes,
                    url=url,
                    local_path=local,
                    offset_bytes=offset,
                    total_bytes=artifact.total_size_bytes,
                    pickle=artifact.format == ArtifactFormat.PICKLE,
                )
            )
        offset += item.size_bytes
    return tuple(tasks)


def bytes_to_fetch(cache: ArtifactCache, tasks: tuple[FileTask, ...]) -> int:
    """Bytes the cache file system must still take for ``tasks``: each file's size less what
    its partial already holds (a download resumes from it; a copy rewrites it in place)."""
    return sum(
        task.size_bytes
        - min(partial_length(cache.partial(task.digest, task.path)), task.size_bytes)
        for task in tasks
    )


def _corrupt(artifact: ResolvedArtifact, reason: str, cache: ArtifactCache) -> CacheCorrupt:
    """``cache_corrupt`` for a published artifact, with the commands that repair it.

    Blobs are shared: when another published artifact links the same bytes, removing this
    one alone keeps the damaged blob, so the advice names every artifact that shares one.
    """
    model, variant = artifact.logical_model, artifact.variant_id
    mine = {item.sha256 for item in artifact.files}
    sharing = [
        f"{other.logical_model}:{other.variant_id}"
        for other in cache.published()
        if other.artifact_digest != artifact.digest and mine & {f.sha256 for f in other.files}
    ]
    options = "(with the same --cache-dir, --catalog-file or -f options)"
    if sharing:
        remediation = (
            f"Its files are shared with {', '.join(sharing)}: remove each of them and "
            f"{model}:{variant} with `sbproxy models remove MODEL --variant VARIANT`, run "
            f"`sbproxy models prune`, then pull again {options}."
        )
    else:
        remediation = (
            f"Remove it with `sbproxy models remove {model} --variant {variant}`, then pull it "
            f"again with `sbproxy models pull {model} --variant {variant}` {options}."
        )
    return CacheCorrupt(
        f"the cached artifact {artifact.digest} ({model}:{variant}) is corrupt: {reason}",
        remediation=remediation,
        details={"artifact_digest": artifact.digest, "model": model, "variant": variant},
    )


@step("plan")
async def plan_pull(ctx: StepContext, request: PullInput) -> Plan:
    """Classify the cache and decide what to fetch.

    Idempotency: reads the cache and writes only ``last_accessed_ms`` of a hit (and the
    pending manifest, rewritten whole).

    Raises:
        CacheCorrupt: ``cache_corrupt`` for a published artifact that no longer verifies.
        DiskFull: ``disk_full`` naming the partials directory, the bytes needed and free.
        ManualArtifactMissing, OfflineArtifactMissing, PickleRefused: the pull policy.
    """
    cache = ctx.resource(ArtifactCache)
    artifact = request.artifact
    state = cache.lookup(artifact)
    if state.kind == "corrupt":
        raise _corrupt(artifact, str(state.reason), cache)
    metadata = state.metadata
    if state.kind == "ready" and metadata is not None:
        try:
            await anyio.to_thread.run_sync(lambda: cache.verify(metadata))
        except CacheCorrupt as exc:
            raise _corrupt(artifact, exc.message, cache) from exc
        if request.local_files:
            # An import of a cached artifact must still be the file the catalog pins.
            await anyio.to_thread.run_sync(_check_local_files, request)
        cache.touch(metadata)
        return Plan(hit=True, snapshot_path=str(cache.snapshot(artifact.digest)))
    _check_policy(request, cache)
    tasks = _tasks(request, cache)
    require_space(
        cache.layout.partials,
        needed_bytes=bytes_to_fetch(cache, tasks),
        action=f"pulling {artifact.logical_model}:{artifact.variant_id}",
    )
    cache.record_pending(artifact)
    return Plan(hit=False, fetch=tasks)


def _require_regular_file(path: Path) -> None:
    """Refuse a local file that is a symbolic link, missing, or not a regular file."""
    if path.is_symlink():
        raise SourceError(
            f"{path} is a symbolic link; imports and file: sources must be real files",
            remediation="Pass the file the link points to, or copy it into place.",
        )
    if not path.is_file():
        kind = "does not exist" if not path.exists() else "is not a regular file"
        raise SourceError(f"{path} {kind}; only regular files can be imported")


def _check_local_files(request: PullInput) -> None:
    """Refuse import files that are not the catalog's (size first, then SHA-256)."""
    pinned = {item.path: item for item in request.artifact.files}
    for relpath, local in request.local_files.items():
        item = pinned[relpath]
        path = Path(local)
        _require_regular_file(path)
        if path.stat().st_size != item.size_bytes:
            raise SizeMismatch(
                f"{path} has {path.stat().st_size} bytes, the catalog says {item.size_bytes}"
            )
        sha, _ = hash_file(path)
        if sha.hexdigest() != item.sha256:
            raise DigestMismatch(
                f"{path}: SHA-256 {sha.hexdigest()} does not match the catalog's {item.sha256}",
                remediation="This is not the file the catalog pins; nothing was imported.",
            )


def _copy_verified(
    task: FileTask, part: Path, check_cancelled: Callable[[], None]
) -> tuple[str, str, int]:
    """Copy a local file into ``part``, hashing it in the same pass; refuses symlinks."""
    source = Path(task.local_path or "")
    _require_regular_file(source)
    size = source.stat().st_size
    if size != task.size_bytes:
        raise SizeMismatch(f"{source} has {size} bytes, the catalog says {task.size_bytes}")
    sha, b3 = hashlib.sha256(), blake3()
    try:
        with disk_full_errors(
            f"copying {source}", path=part, kept="nothing was imported", needed_bytes=size
        ):
            part.parent.mkdir(parents=True, exist_ok=True)
            with source.open("rb") as reader, part.open("wb") as writer:
                while block := reader.read(COPY_BLOCK_BYTES):
                    check_cancelled()
                    sha.update(block)
                    b3.update(block)
                    writer.write(block)
                writer.flush()
                os.fsync(writer.fileno())
    except DiskFull:
        part.unlink(missing_ok=True)  # a copy restarts from 0: its bytes are of no use
        raise
    return sha.hexdigest(), b3.hexdigest(), size


@step("fetch", retry=FETCH_RETRY)
async def fetch_file(ctx: StepContext, task: FileTask) -> FetchResult:
    """Download or copy one file, verify it, scan it if it is a pickle, promote it. On a
    fleet a download asks the members that hold the artifact first (the engine's
    :class:`~sbproxy.model_host.artifacts.peers.PeerSources`), the upstream last.

    Idempotency: a blob that is already stored (an earlier run got this far) is reused; a
    partial download resumes from its length when its resume state names the same source
    URL (another source's discards it; the final SHA-256 decides either way); promotion is
    an atomic rename under the blob lock. A rerun may take the file from another source
    than the first run: the bytes are the same, checked against the catalog's SHA-256.

    Raises:
        DiskFull: ``disk_full`` when the file system lacks room for the rest of this file
            (checked first), or fills while it is written.
        TransportError, HttpStatusError, SizeMismatch, DigestMismatch: see ``download_file``.
    """
    cache = ctx.resource(ArtifactCache)
    part = cache.partial(task.digest, task.path)
    if cache.blob_ok(task.sha256, task.size_bytes):
        fingerprint = await anyio.to_thread.run_sync(
            partial(reused_blob_fingerprint, cache, path=task.path, sha256=task.sha256)
        )
        return FetchResult(path=task.path, blake3=fingerprint, size_bytes=task.size_bytes)

    # Checked on every attempt: a resumed job replays its plan, and space changes meanwhile.
    require_space(
        cache.layout.partials,
        needed_bytes=bytes_to_fetch(cache, (task,)),
        action=f"fetching {task.path}",
    )

    async def progress(done: int) -> None:
        await ctx.report_progress(
            done=task.offset_bytes + done, total=task.total_bytes, current=task.path
        )

    resumed = transferred = 0
    source = "upstream"
    if task.local_path is not None:
        sha, fingerprint, size = await anyio.to_thread.run_sync(
            _copy_verified, task, part, ctx.check_cancelled
        )
        if sha != task.sha256:
            part.unlink(missing_ok=True)
            raise DigestMismatch(
                f"{task.local_path}: SHA-256 {sha} does not match the catalog's {task.sha256}",
                remediation="This is not the file the catalog pins; nothing was imported.",
            )
        await progress(size)
    else:
        assert task.url is not None  # noqa: S101 - plan gives every task a url or a path
        served = await _from_peers(ctx, task, part, progress)
        if served is not None:
            source, result = served
        else:
            remote = RemoteFile(
                url=task.url, path=task.path, sha256=task.sha256, size=task.size_bytes
            )
            result = await download_file(
                remote,
                part=part,
                token=hf_token(),
                on_progress=progress,
                check_cancelled=ctx.check_cancelled,
            )
        fingerprint = result.blake3
        resumed, transferred = result.resumed_from, result.downloaded_bytes
        await ctx.record_event(
            "source",
            {"path": task.path, "source": source, "bytes": transferred, "resumed_from": resumed},
        )
    if task.pickle:
        try:
            await anyio.to_thread.run_sync(scan_pickle_file, part)
        except Exception:
            part.unlink(missing_ok=True)
            raise
    await cache.promote(part, sha256=task.sha256, size=task.size_bytes)
    return FetchResult(
        path=task.path,
        blake3=fingerprint,
        size_bytes=task.size_bytes,
        resumed_from=resumed,
        transferred_bytes=transferred,
        source=source,
    )


async def _from_peers(
    ctx: StepContext,
    task: FileTask,
    part: Path,
    progress: Callable[[int], Awaitable[None]],
) -> tuple[str, DownloadResult] | None:
    """``(node, verified partial)`` from the first fleet member that holds ``task``'s
    artifact and delivers the file whole; ``None`` on a single host, when no member holds
    it, or when every one failed (each failure is a ``peer_failed`` event)."""
    sources = ctx.find_resource(PeerSources)
    if sources is None:
        return None

    async def failed(failure: PeerFailure) -> None:
        await ctx.record_event(
            "peer_failed",
            {"path": task.path, "node": failure.node, "code": failure.code,
             "error": failure.message},
        )  # fmt: skip

    served = await download_from_peers(
        sources,
        artifact_digest=task.digest,
        path=task.path,
        sha256=task.sha256,
        size=task.size_bytes,
        part=part,
        on_progress=progress,
        check_cancelled=ctx.check_cancelled,
        on_failure=failed,
    )
    if served is None:
        return None
    holder, result = served
    return holder.node, result


@step("publish")
async def publish_snapshot(ctx: StepContext, request: PublishInput) -> PullOutput:
    """Publish the snapshot and its ready marker.

    Idempotency: publishing an already published artifact returns it unchanged; a
    half-built staging directory from a crash is discarded and rebuilt.
    """
    cache = ctx.resource(ArtifactCache)
    fingerprints = dict(request.fingerprints)
    for item in request.artifact.files:
        if item.path not in fingerprints:
            fingerprints[item.path] = await anyio.to_thread.run_sync(
                partial(reused_blob_fingerprint, cache, path=item.path, sha256=item.sha256)
            )
    metadata = await cache.publish(
        request.artifact, fingerprints=fingerprints, pickle_allowed=request.allow_pickle
    )
    return PullOutput(
        artifact_digest=metadata.artifact_digest,
        snapshot_path=str(cache.snapshot(metadata.artifact_digest)),
        verified_bytes=metadata.total_size_bytes,
        cache_hit=False,
    )


@registry.workflow("pull", version=1)
async def pull_workflow(ctx: WorkflowContext, request: PullInput) -> PullOutput:
    """Make ``request.artifact`` ready in the cache (see the module docstring)."""
    plan = await ctx.step(plan_pull, request)
    if plan.hit:
        assert plan.snapshot_path is not None  # noqa: S101 - a hit carries its path
        return PullOutput(
            artifact_digest=request.artifact.digest,
            snapshot_path=plan.snapshot_path,
            verified_bytes=request.artifact.total_size_bytes,
            cache_hit=True,
        )
    fingerprints: dict[str, str] = {}
    transferred = 0
    sources: dict[str, int] = {}
    for task in plan.fetch:
        fetched = await ctx.step(fetch_file, task, name=f"fetch:{task.path}")
        fingerprints[task.path] = fetched.blake3
        transferred += fetched.transferred_bytes
        sources[fetched.source] = sources.get(fetched.source, 0) + fetched.transferred_bytes
    published = await ctx.step(
        publish_snapshot,
        PublishInput(
            artifact=request.artifact,
            allow_pickle=request.allow_pickle,
            fingerprints=fingerprints,
        ),
    )
    return published.model_copy(update={"transferred_bytes": transferred, "sources": sources})
