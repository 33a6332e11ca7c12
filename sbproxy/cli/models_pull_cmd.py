"""``sbproxy models pull`` and ``sbproxy models import``: make exact artifacts ready in the cache.

Both submit one durable pull job per artifact (idempotency key = artifact digest, so a pull
already unfinished elsewhere is joined, and one whose process died is resumed) and run it in
this process with its progress on stderr. ``import`` is a pull whose files come from local
paths instead of the network; either way every byte is verified against the catalog's
SHA-256 and size before the snapshot is published.

Selection for ``pull`` (reference 1.4): with ids, ``--variant`` pins the exact variant, else
configured deployments of that model (``-f``) give their variant and replicas (``--engine``
overrides their engine), else the catalog picks automatically for this machine. Without ids,
every configured deployment plus catalog entries marked ``pull: on_boot``; ``--all`` takes
every catalog model that has variants, skipping those that cannot be resolved here. The same
artifact selected twice is pulled once.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import click

from sbproxy.catalog import ArtifactRequest, resolve_artifact
from sbproxy.cli._cache_text import (
    artifact_line,
    artifact_row,
    gc_json,
    gc_lines,
    job_error,
    label,
)
from sbproxy.cli._host import choose_host, run_with_service
from sbproxy.cli._live import run_followed
from sbproxy.cli._options import (
    cache_dir_option,
    catalog_file_option,
    config_option,
    engine_option,
)
from sbproxy.cli._output import EXIT_RUNTIME, emit_json, fail, format_option
from sbproxy.config import DeploymentConfig
from sbproxy.errors import CatalogError, ResolutionError, SbproxyError
from sbproxy.model_host.artifacts.proxies import proxy_settings
from sbproxy.model_host.artifacts.sources import hf_endpoint
from sbproxy.model_host.service import ModelHostService, Selection
from sbproxy.store import JobRecord, JobStatus

__all__ = ["import_command", "local_files_for", "pull_command", "select_for_pull"]


@dataclass
class _Outcome:
    """What a pull or import run produced, ready to print."""

    rows: list[dict[str, object]] = field(default_factory=list)
    gc: dict[str, object] | None = None
    gc_lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    failed: bool = False


# --- selection ------------------------------------------------------------------------------


def _deployment_selection(
    service: ModelHostService, deployment_id: str, deployment: DeploymentConfig, *, engine: str
) -> Selection:
    """The artifact of one configured deployment, its engine replaced unless ``auto``."""
    request = ArtifactRequest.model_validate(
        {
            "model": deployment.model,
            "variant": deployment.variant,
            "engine": str(deployment.engine) if engine == "auto" else engine,
            "replicas": deployment.max_replicas,
            "heterogeneous_variants": deployment.heterogeneous_variants,
        }
    )
    resolution = resolve_artifact(service.catalog, request, service.worker())
    return Selection(
        artifact=resolution.artifact,
        allow_pickle=service.catalog.entry(deployment.model).allow_pickle,
        pull_policy=str(deployment.pull),
        deployment=deployment_id,
    )


def _for_id(
    service: ModelHostService, model: str, *, variant: str | None, engine: str
) -> list[Selection]:
    if variant is not None:
        return [service.select(model, variant=variant, engine=engine)]
    deployments = service.config.deployments if service.config is not None else {}
    configured = [
        _deployment_selection(service, deployment_id, deployment, engine=engine)
        for deployment_id, deployment in sorted(deployments.items())
        if deployment.model == model
    ]
    return configured or [service.select(model, engine=engine)]


def _every_model(service: ModelHostService, *, engine: str) -> list[Selection]:
    chosen = []
    for model_id, entry in sorted(service.catalog.models.items()):
        if not entry.variants:
            continue
        try:
            chosen.append(service.select(model_id, engine=engine))
        except (ResolutionError, CatalogError) as exc:
            click.echo(f"sbproxy models pull: skip {model_id}: {exc}", err=True)
    return chosen


def select_for_pull(
    service: ModelHostService,
    models: tuple[str, ...],
    *,
    variant: str | None,
    engine: str,
    all_models: bool,
) -> list[Selection]:
    """The artifacts a ``pull`` invocation means, each once (see the module docstring).

    Raises:
        ResolutionError: an id is unknown, its variant is unknown, or nothing fits here.
        CatalogError: ``unknown_catalog_model``.
    """
    if all_models:
        chosen = _every_model(service, engine=engine)
    elif models:
        chosen = [s for m in models for s in _for_id(service, m, variant=variant, engine=engine)]
    else:
        chosen = [*service.configured(), *service.on_boot_entries()]
    unique: dict[str, Selection] = {}
    for selection in chosen:
        unique.setdefault(selection.artifact.digest, selection)
    return list(unique.values())


# --- running --------------------------------------------------------------------------------


async def _acquire(
    service: ModelHostService,
    selection: Selection,
    *,
    offline: bool,
    local_files: dict[str, str] | None = None,
) -> JobRecord:
    """Submit (or join) the pull job of ``selection`` and run it here with live progress."""
    job = await service.submit_pull(selection, offline=offline, local_files=local_files)
    click.echo(
        f"{label(selection)}: job {job.id} for artifact sha256:{selection.artifact.digest}",
        err=True,
    )
    return await run_followed(service.engine, job.id)


async def _collect(service: ModelHostService, outcome: _Outcome) -> None:
    """Enforce the configured ``cache.budget_gib`` after pulls, if one is set."""
    budget = service.budget_bytes()
    if budget is None:
        return
    report, job = await service.gc(budget_bytes=budget)
    if report is None:
        error = job_error(job)
        outcome.gc = {"job_id": job.id, "error": error}
        outcome.problems.append(
            f"cache GC failed (job {job.id}): {error['code']}: {error['message']}"
        )
        outcome.failed = True
        return
    outcome.gc = gc_json(report, job)
    outcome.gc_lines = gc_lines(report)


def _report(command: str, outcome: _Outcome, output_format: str) -> None:
    if output_format == "json":
        payload: dict[str, object] = {"artifacts": outcome.rows}
        if outcome.gc is not None:
            payload["gc"] = outcome.gc
        emit_json(command, payload)
    else:
        for row in outcome.rows:
            line, ok = artifact_line(row)
            if ok:
                click.echo(line)
            else:
                click.echo(f"sbproxy {command.replace('.', ' ')}: {line}", err=True)
        for line in outcome.gc_lines:
            click.echo(line)
        for line in outcome.problems:
            click.echo(f"sbproxy {command.replace('.', ' ')}: {line}", err=True)
    if outcome.failed:
        sys.exit(EXIT_RUNTIME)


# --- verbs ----------------------------------------------------------------------------------


@click.command("pull")
@click.argument("models", nargs=-1, metavar="[MODEL]...")
@click.option("--variant", default=None, help="Exact variant id (only with exactly one MODEL).")
@engine_option
@click.option(
    "--all", "all_models", is_flag=True, help="Every catalog model with catalog v2 variants."
)
@click.option(
    "--offline",
    is_flag=True,
    help="No network: verified cache hits and file: sources only; a miss fails.",
)
@config_option
@catalog_file_option
@cache_dir_option
@format_option
def pull_command(
    *,
    models: tuple[str, ...],
    variant: str | None,
    engine: str,
    all_models: bool,
    offline: bool,
    config_path: Path | None,
    catalog_file: Path | None,
    cache_dir: Path | None,
    output_format: str,
) -> None:
    """Download and verify exact catalog artifacts into the cache.

    Each artifact is a durable job (progress on stderr): a pull interrupted by a crash
    resumes from its partial download when run again, and a pull already running elsewhere
    is joined. After the pulls, a configured cache.budget_gib is enforced (least recently
    used first, configured deployments kept).

    Before it downloads, a pull checks that the cache has room for what is still missing
    (less what a partial download already holds); a full disk, there or under the job
    journal, fails with disk_full naming the path, the bytes needed and the bytes free.

    Downloads go through the forward proxy in HTTPS_PROXY or HTTP_PROXY (or ALL_PROXY;
    http://[user:password@]host:port) unless NO_PROXY lists the host.

    Exit status: 0 when every artifact is ready; 1 when a pull failed (its error is in the
    output); 2 for bad input (unknown model or variant, invalid config or catalog, an
    HF_ENDPOINT with credentials: put the token in HF_TOKEN; a proxy variable that cannot
    be used: invalid_proxy).
    """
    command = "models.pull"
    if variant is not None and len(models) != 1:
        fail(command, _usage("--variant needs exactly one MODEL."), output_format=output_format)
    if all_models and models:
        fail(command, _usage("--all takes no MODEL arguments."), output_format=output_format)
    try:
        hf_endpoint()  # credentials in HF_ENDPOINT: refused before anything is written
        proxy_settings()  # a proxy variable that cannot be used: refused the same way
    except SbproxyError as exc:
        fail(command, exc, output_format=output_format)
    host = choose_host(
        command,
        config_path=config_path,
        cache_dir=cache_dir,
        catalog_file=catalog_file,
        output_format=output_format,
    )
    if host.config is not None and host.config.model_host is None and not models:
        fail(
            command,
            SbproxyError(
                f"{config_path} declares no proxy.model_host (and no serve: entries), so it "
                "configures nothing to pull.",
                code="no_model_host",
                remediation="Name the models to pull, or add deployments to the config.",
            ),
            output_format=output_format,
        )

    async def work(service: ModelHostService) -> _Outcome:
        selections = select_for_pull(
            service, models, variant=variant, engine=engine, all_models=all_models
        )
        outcome = _Outcome()
        if not selections:
            click.echo("sbproxy models pull: no catalog v2 artifacts selected", err=True)
            return outcome
        for selection in selections:
            job = await _acquire(service, selection, offline=offline)
            outcome.rows.append(artifact_row(selection, job))
            outcome.failed |= job.status != JobStatus.SUCCEEDED
        await _collect(service, outcome)
        return outcome

    _report(command, run_with_service(command, output_format, host, work), output_format)


@click.command("import")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--model", required=True, help="Catalog model id the files belong to.")
@click.option("--variant", default=None, help="Exact variant id (default: this machine's pick).")
@engine_option
@config_option
@catalog_file_option
@cache_dir_option
@format_option
def import_command(
    *,
    path: Path,
    model: str,
    variant: str | None,
    engine: str,
    config_path: Path | None,
    catalog_file: Path | None,
    cache_dir: Path | None,
    output_format: str,
) -> None:
    """Import local files as a catalog artifact, verified like a download.

    PATH is the file of a one-file variant, or a directory holding every file of the variant
    at its catalog path. Nothing is fetched from the network; each file is copied into the
    cache while its SHA-256 is computed, and nothing is published unless every file matches
    the catalog's size and SHA-256.

    Exit status: 0 imported (or already cached); 1 a file does not match (digest_mismatch,
    size_mismatch) or could not be read; 2 for bad input (unknown model or variant, a PATH
    that lacks a file of the variant).
    """
    command = "models.import"
    host = choose_host(
        command,
        config_path=config_path,
        cache_dir=cache_dir,
        catalog_file=catalog_file,
        output_format=output_format,
    )

    async def work(service: ModelHostService) -> _Outcome:
        selection = service.select(model, variant=variant, engine=engine)
        local_files = local_files_for(selection, path)
        job = await _acquire(service, selection, offline=True, local_files=local_files)
        row = artifact_row(selection, job)
        return _Outcome(rows=[row], failed=job.status != JobStatus.SUCCEEDED)

    _report(command, run_with_service(command, output_format, host, work), output_format)


def local_files_for(selection: Selection, path: Path) -> dict[str, str]:
    """Map each file of the artifact to its local copy under ``path``.

    Symbolic links (the path itself, or anything between it and a file) and anything that
    is not a regular file (a FIFO, a device) are refused here, as bad input; the import job
    checks again when it copies.

    Raises:
        SbproxyError: ``invalid_import_path`` when ``path`` does not exist, is a link or not
            a regular file, is a file for a multi-file variant, or lacks one of the
            variant's files.
    """
    artifact = selection.artifact
    root = path.absolute()
    if not root.exists() and not root.is_symlink():
        raise _bad_path(f"{path} does not exist.")
    if root.is_dir() and root.is_symlink():
        # As for file: sources: links inside what is imported are refused, the directory
        # itself included (directories above it may be links, e.g. /tmp on some systems).
        raise _bad_path(f"{path} is a symbolic link to a directory; pass the real directory.")
    if not root.is_dir():
        if len(artifact.files) != 1:
            raise _bad_path(
                f"{label(selection)} has {len(artifact.files)} files; pass the directory "
                "that holds them."
            )
        _regular(root)
        return {artifact.files[0].path: str(root)}
    found: dict[str, str] = {}
    missing = []
    for item in artifact.files:
        candidate = root / item.path
        linked = [p for p in candidate.parents if p.is_relative_to(root) and p != root]
        if any(p.is_symlink() for p in linked):
            raise _bad_path(f"{candidate} is reached through a symbolic link; links are refused.")
        if candidate.exists() or candidate.is_symlink():
            _regular(candidate)
            found[item.path] = str(candidate)
        else:
            missing.append(item.path)
    if missing:
        raise _bad_path(f"{path} lacks {', '.join(missing)} of {label(selection)}.")
    return found


def _regular(path: Path) -> None:
    if path.is_symlink():
        raise _bad_path(f"{path} is a symbolic link; pass the file it points to.")
    if not path.is_file():
        raise _bad_path(f"{path} is not a regular file.")


def _bad_path(message: str) -> SbproxyError:
    return SbproxyError(
        message,
        code="invalid_import_path",
        remediation="Pass the file (one-file variants) or a directory with every file of the "
        "variant at its catalog path (`sbproxy models show` lists them).",
    )


def _usage(message: str) -> SbproxyError:
    return SbproxyError(message, code="usage", remediation="See `sbproxy models pull --help`.")
