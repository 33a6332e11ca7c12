"""``sbproxy models``: the catalog as this machine would resolve it, and the artifact cache.

``list`` and ``show`` load the built-in catalog, or the ``--catalog-file`` (or the ``-f``
config's ``catalog_file``) that replaces it, probe this host's worker (GPU with the most free
memory, else CPU), and run automatic artifact resolution (engine ``auto``, one replica) for
each model, so the output says which exact variant would be served here and why the others
would not, and whether it is already in the cache. The cache verbs (``pull``, ``import``,
``remove``, ``prune``, ``gc``, ``verify``, ``partials``) live in ``models_pull_cmd`` and
``models_cache_cmd``, the lockfile verbs (``lock``, ``verify-lock``) in ``models_lock_cmd``,
and are attached to the group here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import click

from sbproxy.catalog import (
    ArtifactRequest,
    ArtifactVariant,
    Catalog,
    CatalogEntry,
    NoCompatibleVariantError,
    RejectedCandidate,
    RejectionKind,
    Resolution,
    WorkerProfile,
    load_catalog,
    resolve_artifact,
    variant_digest,
)
from sbproxy.cli._host import HostChoice, choose_host, exit_code_for
from sbproxy.cli._job_text import size_text
from sbproxy.cli._lazy import LazyCommand, LazyGroup, resume_collection
from sbproxy.cli._options import cache_dir_option, catalog_file_option, config_option
from sbproxy.cli._output import EXIT_RUNTIME, emit_json, fail, format_option
from sbproxy.errors import CatalogError, ResolutionError, SbproxyError
from sbproxy.model_host.artifacts import ArtifactCache
from sbproxy.model_host.runtime import probe_worker

__all__ = ["models_group"]

NOT_PULLED = "not-pulled"


class _Outcome:
    """Automatic resolution of one model on the probed worker, as the CLI reports it."""

    __slots__ = ("error", "fit", "rejected", "resolution")

    def __init__(
        self,
        *,
        resolution: Resolution | None,
        rejected: tuple[RejectedCandidate, ...],
        fit: str,
        error: SbproxyError | None,
    ) -> None:
        self.resolution = resolution
        self.rejected = rejected
        self.fit = fit
        self.error = error


@dataclass(frozen=True)
class _CacheView:
    """What the cache holds, as ``list`` and ``show`` report it.

    Attributes:
        statuses: Model id -> ``cached`` (models absent here are ``not-pulled``).
        snapshots: Artifact digest -> snapshot path of every published artifact.
    """

    statuses: dict[str, str] = field(default_factory=dict)
    snapshots: dict[str, str] = field(default_factory=dict)

    def status(self, model_id: str) -> str:
        return self.statuses.get(model_id, NOT_PULLED)


# The cache verbs are imported when they run (`models pull` needs neither the admin client
# nor the cache-report code), and `sbproxy models --help` imports none of them.
_VERBS = {
    "pull": LazyCommand(
        "sbproxy.cli.models_pull_cmd:pull_command",
        "Download and verify exact catalog artifacts into the cache.",
    ),
    "import": LazyCommand(
        "sbproxy.cli.models_pull_cmd:import_command",
        "Import local files as a catalog artifact, verified like a download.",
    ),
    "remove": LazyCommand(
        "sbproxy.cli.models_cache_cmd:remove_command",
        "Remove one cached artifact (idempotent: removing what is not cached succeeds).",
    ),
    "prune": LazyCommand(
        "sbproxy.cli.models_cache_cmd:prune_command",
        "Delete blobs no published artifact references, and abandoned partial downloads.",
    ),
    "gc": LazyCommand(
        "sbproxy.cli.models_cache_cmd:gc_command",
        "Bring the cache under its budget: unreferenced blobs first, then least recently used "
        "artifacts, keeping protected ones (configured via -f, leased, locked, being pulled).",
    ),
    "verify": LazyCommand(
        "sbproxy.cli.models_cache_cmd:verify_command",
        "Re-verify published artifacts (all, or MODEL's) against their recorded digests.",
    ),
    "partials": LazyCommand(
        "sbproxy.cli.models_cache_cmd:partials_command",
        "List unfinished downloads: their bytes, the pull job that owns each, and its state.",
    ),
    "ps": LazyCommand(
        "sbproxy.cli.models_admin_cmd:ps_command",
        "Show running deployments: state, port, active and queued requests, reason.",
    ),
    "load": LazyCommand(
        "sbproxy.cli.models_admin_cmd:load_command",
        "Prepare and warm DEPLOYMENT in the running server (pull, engine, launch).",
    ),
    "stop": LazyCommand(
        "sbproxy.cli.models_admin_cmd:stop_command",
        "Drain DEPLOYMENT and stop its engine (the artifact stays cached).",
    ),
    "lock": LazyCommand(
        "sbproxy.cli.models_lock_cmd:lock_command",
        "Write the exact artifact every configured deployment resolves to on this machine.",
    ),
    "verify-lock": LazyCommand(
        "sbproxy.cli.models_lock_cmd:verify_lock_command",
        "Check a lockfile against the config, the catalog and the cache.",
    ),
}


@click.group("models", cls=LazyGroup, lazy_commands=_VERBS, invoke_without_command=True)
@click.pass_context
def models_group(ctx: click.Context) -> None:
    """List, inspect, pull and manage catalog models (bare `sbproxy models` lists them)."""
    if ctx.invoked_subcommand is None:
        resume_collection()  # the group runs as a command: nothing more to import
        ctx.invoke(list_command)


@models_group.command("list")
@config_option
@catalog_file_option
@cache_dir_option
@format_option
def list_command(
    config_path: Path | None = None,
    catalog_file: Path | None = None,
    cache_dir: Path | None = None,
    output_format: str = "text",
) -> None:
    """List catalog models with the variant each would resolve to on this machine.

    FIT is fits, too-large (no variant fits this worker's memory), capability-refused
    (accelerator, compute capability, engine or pickle policy) or unknown (the entry has no
    catalog v2 variants). MEMORY is the selected variant's catalog minimum. STATUS is cached
    when some variant of the model is published in the cache, else not-pulled.
    """
    command = "models.list"
    host = _host(command, config_path, cache_dir, catalog_file, output_format)
    catalog, worker = _prepare(command, host.catalog_path, output_format)
    view = _cache_view(command, host, catalog, output_format)
    rows = [
        {**_list_row(catalog, model_id, entry, worker), "status": view.status(model_id)}
        for model_id, entry in sorted(catalog.models.items())
    ]
    if output_format == "json":
        emit_json(
            command,
            {
                "catalog_revision": catalog.catalog_revision,
                "worker": _worker_json(worker),
                "models": rows,
            },
        )
        return
    headers = (
        "MODEL",
        "VARIANT",
        "FORMAT",
        "SIZE",
        "STABILITY",
        "FIT",
        "MEMORY",
        "ENGINE",
        "STATUS",
    )
    table = [
        (
            str(row["id"]),
            _text(row["selected_variant"]),
            _text(row["format"]),
            _size_text(row["exact_size_bytes"]),
            _text(row["stability"]),
            str(row["fit"]),
            _size_text(row["estimated_memory_bytes"]),
            _text(row["engine"]),
            str(row["status"]),
        )
        for row in rows
    ]
    for line in _align(headers, table):
        click.echo(line)
    click.echo(f"\nworker: {worker.describe()}; catalog {catalog.catalog_revision}")


@models_group.command("show")
@click.argument("model_id", metavar="ID")
@config_option
@catalog_file_option
@cache_dir_option
@format_option
def show_command(
    model_id: str,
    config_path: Path | None,
    catalog_file: Path | None,
    cache_dir: Path | None,
    output_format: str,
) -> None:
    """Show one catalog model: its variants, their digests, which one this machine picks and
    which are in the cache.

    Exit status 2 if ID is not in the catalog.
    """
    command = "models.show"
    host = _host(command, config_path, cache_dir, catalog_file, output_format)
    catalog, worker = _prepare(command, host.catalog_path, output_format)
    try:
        entry = catalog.entry(model_id)
    except CatalogError as exc:
        fail(command, exc, output_format=output_format)
    outcome = _auto_resolve(catalog, model_id, worker)
    view = _cache_view(command, host, catalog, output_format)
    payload = _show_payload(catalog, model_id, entry, worker, outcome, view)
    if output_format == "json":
        emit_json(command, payload)
        return
    for line in _show_text(catalog, model_id, entry, worker, outcome, view):
        click.echo(line)


# --- shared steps ---------------------------------------------------------------------------


def _host(
    command: str,
    config_path: Path | None,
    cache_dir: Path | None,
    catalog_file: Path | None,
    output_format: str,
) -> HostChoice:
    return choose_host(
        command,
        config_path=config_path,
        cache_dir=cache_dir,
        catalog_file=catalog_file,
        output_format=output_format,
    )


def _cache_view(command: str, host: HostChoice, catalog: Catalog, output_format: str) -> _CacheView:
    """What the cache holds. A root without a journal has never had a pull: nothing is
    cached, and nothing is created there just to say so.

    The cache is prepared as ``open_service`` prepares it (directories created, the root
    found writable: the same ``invalid_cache_dir`` errors) but the journal is not opened:
    what is cached is the ready markers and snapshots, not the jobs.
    """
    if not host.cache_used():
        return _CacheView()
    try:
        cache = ArtifactCache.open(host.layout)
    except SbproxyError as exc:
        fail(command, exc, output_format=output_format, exit_code=exit_code_for(exc))
    published = [
        metadata
        for metadata in cache.published()
        if cache.snapshot(metadata.artifact_digest).is_dir()
    ]
    snapshots = {m.artifact_digest: str(cache.snapshot(m.artifact_digest)) for m in published}
    # ``ModelHostService.status_of``: cached when some published artifact is a variant of it.
    statuses = {m.logical_model: "cached" for m in published if m.logical_model in catalog.models}
    return _CacheView(statuses=statuses, snapshots=snapshots)


def _prepare(
    command: str, catalog_file: Path | None, output_format: str
) -> tuple[Catalog, WorkerProfile]:
    try:
        catalog = load_catalog(catalog_file)
    except CatalogError as exc:
        fail(command, exc, output_format=output_format)
    try:
        worker = probe_worker()
    except SbproxyError as exc:
        fail(command, exc, output_format=output_format, exit_code=EXIT_RUNTIME)
    return catalog, worker


def _auto_resolve(catalog: Catalog, model_id: str, worker: WorkerProfile) -> _Outcome:
    try:
        resolution = resolve_artifact(catalog, ArtifactRequest(model=model_id), worker)
    except NoCompatibleVariantError as exc:
        too_large = any(r.kind is RejectionKind.INSUFFICIENT_MEMORY for r in exc.rejected)
        fit = "too-large" if too_large else "capability-refused"
        return _Outcome(resolution=None, rejected=exc.rejected, fit=fit, error=exc)
    except ResolutionError as exc:
        return _Outcome(resolution=None, rejected=(), fit="unknown", error=exc)
    return _Outcome(resolution=resolution, rejected=resolution.rejected, fit="fits", error=None)


def _list_row(
    catalog: Catalog, model_id: str, entry: CatalogEntry, worker: WorkerProfile
) -> dict[str, object]:
    outcome = _auto_resolve(catalog, model_id, worker)
    artifact = outcome.resolution.artifact if outcome.resolution else None
    return {
        "id": model_id,
        "params": entry.params,
        "license": entry.license,
        "family": entry.family,
        "modality": entry.modality,
        "quants": list(entry.listed_quants()),
        "selected_variant": artifact.variant_id if artifact else None,
        "format": artifact.format.value if artifact else None,
        "stability": artifact.stability.value if artifact else None,
        # Whether /v1/chat/completions works: "none" marks a completion-only (base) model.
        "chat_template": artifact.chat_template if artifact else None,
        "exact_size_bytes": artifact.total_size_bytes if artifact else None,
        "engine": artifact.engine.value if artifact else None,
        "fit": outcome.fit,
        # Until the memory planner lands this is the catalog's declared minimum.
        "estimated_memory_bytes": artifact.min_memory_bytes if artifact else None,
    }


def _show_payload(
    catalog: Catalog,
    model_id: str,
    entry: CatalogEntry,
    worker: WorkerProfile,
    outcome: _Outcome,
    view: _CacheView,
) -> dict[str, object]:
    artifact = outcome.resolution.artifact if outcome.resolution else None
    return {
        "id": model_id,
        "catalog_revision": catalog.catalog_revision,
        "params": entry.params,
        "license": entry.license,
        "family": entry.family,
        "modality": entry.modality,
        "context_length": entry.context_length,
        "allow_pickle": entry.allow_pickle,
        "quants": list(entry.listed_quants()),
        "hf_repo": entry.hf_repo,
        "variants": [_variant_json(catalog, model_id, v, view) for v in entry.variants],
        "worker": _worker_json(worker),
        "fit": outcome.fit,
        "selected_variant": artifact.variant_id if artifact else None,
        "engine": artifact.engine.value if artifact else None,
        "artifact_digest": artifact.digest if artifact else None,
        "rejected": [
            {"variant": r.variant_id, "reason_code": r.kind.value, "reason": r.reason}
            for r in outcome.rejected
        ],
        "resolution_error": (
            {"code": outcome.error.code, "error": outcome.error.message}
            if outcome.error is not None
            else None
        ),
        "cached": view.status(model_id) != NOT_PULLED,
    }


def _variant_json(
    catalog: Catalog, model_id: str, variant: ArtifactVariant, view: _CacheView
) -> dict[str, object]:
    out: dict[str, object] = variant.model_dump(mode="json")
    out["exact_size_bytes"] = variant.total_size_bytes
    digest = variant_digest(
        catalog_revision=catalog.catalog_revision, logical_model=model_id, variant=variant
    )
    out["artifact_digest"] = digest
    out["cached"] = digest in view.snapshots
    if digest in view.snapshots:
        out["snapshot_path"] = view.snapshots[digest]
    return out


def _worker_json(worker: WorkerProfile) -> dict[str, object]:
    capability = worker.compute_capability
    return {
        "accelerator": worker.accelerator.value,
        "memory_bytes": worker.memory_bytes,
        "compute_capability": f"{capability[0]}.{capability[1]}" if capability else None,
        "engines": sorted(e.value for e in worker.engines),
    }


# --- text rendering -------------------------------------------------------------------------


def _show_text(
    catalog: Catalog,
    model_id: str,
    entry: CatalogEntry,
    worker: WorkerProfile,
    outcome: _Outcome,
    view: _CacheView,
) -> list[str]:
    context = f"{entry.context_length} tokens" if entry.context_length else "-"
    lines = [
        f"{model_id}  (catalog {catalog.catalog_revision})",
        f"  params {entry.params}, license {entry.license}, family {entry.family}, "
        f"modality {entry.modality}",
        f"  context {context}, allow_pickle {str(entry.allow_pickle).lower()}",
        f"  worker  {worker.describe()}",
        f"  cache   {view.status(model_id)}",
    ]
    if outcome.resolution is not None:
        artifact = outcome.resolution.artifact
        lines.append(
            f"  selected {artifact.variant_id} via {artifact.engine.value} ({outcome.fit})"
        )
    else:
        detail = outcome.error.message if outcome.error is not None else ""
        lines.append(f"  selected none ({outcome.fit}): {detail}")
    for candidate in outcome.rejected:
        lines.append(f"    rejected {candidate.render()}")
    if not entry.variants:
        lines.append(f"  legacy v1 entry: {entry.hf_repo}, quants {', '.join(entry.quants)}")
    for variant in entry.variants:
        digest = variant_digest(
            catalog_revision=catalog.catalog_revision, logical_model=model_id, variant=variant
        )
        lines.extend(
            [
                "",
                f"  variant {variant.id}: {variant.format.value} {variant.quant}, "
                f"{_size_text(variant.total_size_bytes)}, {variant.stability.value}, "
                f"engines {', '.join(e.value for e in variant.engines)}",
                f"    source   {variant.source} @ {variant.revision}",
                f"    digest   {digest}",
                f"    cached   {_cached_text(view, digest)}",
                f"    needs    {', '.join(a.value for a in variant.requirements.accelerators)}, "
                f"{_size_text(variant.requirements.min_memory_bytes)} memory",
            ]
        )
        lines.extend(
            f"    file     {f.path}  {f.size_bytes} bytes  sha256 {f.sha256}" for f in variant.files
        )
    return lines


def _align(headers: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=False)]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in (headers, *rows)
    ]


def _cached_text(view: _CacheView, digest: str) -> str:
    snapshot = view.snapshots.get(digest)
    return f"yes, at {snapshot}" if snapshot is not None else "no"


def _text(value: object) -> str:
    return "-" if value is None else str(value)


def _size_text(value: object) -> str:
    """Text output only (JSON keeps exact bytes): ``512 B``, ``12.0 KiB``, ``4.4 GiB``."""
    return size_text(value) if isinstance(value, int) else "-"
