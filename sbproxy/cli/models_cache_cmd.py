"""``sbproxy models remove|prune|gc|verify|partials``: keep the artifact cache honest and in
budget.

``remove``, ``prune`` and ``gc`` are durable jobs like pulls (``sbproxy jobs list`` shows
them) and fail closed: an artifact that a configured deployment (``-f``), a live runtime's
lease, an artifact lock or an unfinished pull protects is never deleted; ``remove`` says why
and exits 2, ``gc`` skips it and reports the reason. ``remove --stale`` also takes a pull
that a dead process left ``running`` (stale): its job cancels that pull durably, then
deletes the partial download; a pull whose process may be alive still refuses. Their byte
counts include partial downloads. ``verify`` only reads: it re-hashes published snapshots
(size + BLAKE3, or SHA-256 with ``--full``) and never repairs one. ``partials`` only reads:
it lists unfinished downloads with their bytes and the pull job that owns them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from sbproxy.cli._cache_text import gc_json, gc_lines, job_error, label, size_text
from sbproxy.cli._host import choose_host, run_with_service
from sbproxy.cli._options import (
    FiniteFloatRange,
    cache_dir_option,
    catalog_file_option,
    config_option,
    engine_option,
)
from sbproxy.cli._output import EXIT_RUNTIME, emit_json, fail, format_option
from sbproxy.config import MAX_CACHE_BUDGET_GIB
from sbproxy.errors import SbproxyError
from sbproxy.model_host.flows import GcReport, PruneReport, RemoveOutput
from sbproxy.model_host.flows.collect import cache_bytes
from sbproxy.model_host.service import ModelHostService, PartialReport, Selection
from sbproxy.store import JobRecord, JobStatus
from sbproxy.workflows import Staleness

__all__ = [
    "gc_command",
    "partials_command",
    "partials_json",
    "partials_lines",
    "prune_command",
    "remove_command",
    "verify_command",
]

GIB = 2**30
_BLOCKED_MARKER = "cannot be removed: "


def _job_failure(job: JobRecord) -> SbproxyError:
    """A failed job as an error to report (its code and message are the job's)."""
    error = job_error(job)
    return SbproxyError(
        f"job {job.id} failed: {error['message']}",
        code=error["code"],
        details={"job_id": job.id},
    )


_PULL_STATES = frozenset({"queued", "running", "parked"})


def _pull_hint(
    selection: Selection, pull: tuple[JobRecord, Staleness | None], *, stale_asked: bool
) -> tuple[str, str]:
    """What holds a removal that an unfinished pull blocks, and what to do: (the message's
    tail, the remediation)."""
    job, stale = pull
    again = f"sbproxy models remove {selection.artifact.logical_model} --variant "
    again += selection.artifact.variant_id
    pull_cmd = again.replace("models remove", "models pull", 1)
    if job.status != JobStatus.RUNNING:
        return (
            f"its pull job {job.id} is {job.status.value}",
            f"Finish it with `{pull_cmd}`, or cancel it with `sbproxy jobs cancel {job.id}` and "
            "remove the artifact again.",
        )
    owner = job.lease_owner or "(none)"
    pid = owner.split("/")[1] if owner.count("/") == 3 else owner
    if stale is not None and stale.reason == "owner_gone":
        return (
            f"its pull job {job.id} was left running by process {pid}, which is gone (stale)",
            f"`{pull_cmd}` resumes it; `{again} --stale` cancels it and deletes its partial "
            "download.",
        )
    if stale is not None:
        return (
            f"the lease of its pull job {job.id} lapsed, but its owner (process {pid}, {owner}) "
            "cannot be proven gone",
            "It may still be running (stopped, or on another machine): end that process, or "
            f"let `{pull_cmd}` take the job over.",
        )
    refused = "; --stale takes only a pull whose process is gone" if stale_asked else ""
    return (
        f"its pull job {job.id} is running in the live process {pid}{refused}",
        f"Wait for it to finish, or cancel it with `sbproxy jobs cancel {job.id}` and remove "
        "the artifact once it has stopped.",
    )


def _blocked(
    service: ModelHostService,
    digest: str,
    reason: str,
    job: JobRecord,
    *,
    pull: tuple[str, str] | None = None,
) -> SbproxyError:
    """``removal_blocked``; for ``configured``, naming the deployments and the config file;
    for an unfinished pull, naming its job and whether its process lives (``pull``: the
    message's tail and the remediation, from :func:`_pull_hint`)."""
    details: dict[str, str | int | float | bool | None] = {
        "reason": reason,
        "artifact_digest": digest,
        "job_id": job.id,
    }
    message = f"artifact '{digest}' {_BLOCKED_MARKER}{reason}"
    remediation = None
    if pull is not None:
        message += f" ({pull[0]})"
        remediation = pull[1]
    if reason == "configured":
        names = sorted(
            s.deployment
            for s in service.configured()
            if s.artifact.digest == digest and s.deployment
        )
        source = service.config.source if service.config is not None else None
        where = f" of {source}" if source is not None else ""
        plural = "s" if len(names) != 1 else ""
        message += f" (deployment{plural} {', '.join(names)}{where} use it)"
        details.update(deployments=",".join(names), config=str(source) if source else None)
        remediation = (
            f"Remove or change those deployments in {source or 'the config'}, then remove it again."
        )
    return SbproxyError(message, code="removal_blocked", remediation=remediation, details=details)


@click.command("remove")
@click.argument("model", metavar="MODEL")
@click.option("--variant", default=None, help="Exact variant id (default: this machine's pick).")
@click.option(
    "--stale",
    is_flag=True,
    help="Also take a pull of it left running by a process that is gone (a stale job): the "
    "removal cancels that job for good, then deletes its partial download. A pull whose "
    "process may be alive is still refused.",
)
@engine_option
@config_option
@catalog_file_option
@cache_dir_option
@format_option
def remove_command(
    *,
    model: str,
    variant: str | None,
    stale: bool,
    engine: str,
    config_path: Path | None,
    catalog_file: Path | None,
    cache_dir: Path | None,
    output_format: str,
) -> None:
    """Remove one cached artifact (idempotent: removing what is not cached succeeds).

    Refused, with the reason, while the artifact is protected: configured (a deployment of
    the -f config resolves to it), leased (a running engine uses it), locked, or while a
    pull of it is queued, running or parked. The partial download of a pull that failed or
    was cancelled is removed with it.

    --stale: a pull left running by a process that was killed (or died with the machine)
    is shown stale by `sbproxy jobs list` and `sbproxy models partials`; without --stale it
    refuses the removal like a live one (the next `sbproxy models pull` resumes it from its
    partial). With --stale the removal job cancels that pull first -- cancelled is final:
    no later pull, server or `jobs retry` resumes it, and the next pull of the artifact is
    a new job that downloads from byte 0 -- then deletes the partial. Only a pull whose
    owner process is certainly gone is taken; one whose process lives (or cannot be proven
    gone: a lapsed lease on another machine) is refused.

    Exit status: 0 removed or not cached; 1 the removal failed; 2 bad input or refused.
    """
    command = "models.remove"
    host = choose_host(
        command,
        config_path=config_path,
        cache_dir=cache_dir,
        catalog_file=catalog_file,
        output_format=output_format,
    )

    async def work(
        service: ModelHostService,
    ) -> tuple[Selection, RemoveOutput, JobRecord | None]:
        selection = service.select(model, variant=variant, engine=engine)
        digest = selection.artifact.digest
        output, job = await service.remove(selection, stale=stale)
        if job is not None and job.status != JobStatus.SUCCEEDED:
            if job.error is not None and job.error.code == "removal_blocked":
                reason = job.error.message.rpartition(_BLOCKED_MARKER)[2].strip() or "protected"
                pull = await service.unfinished_pull(digest) if reason in _PULL_STATES else None
                hint = _pull_hint(selection, pull, stale_asked=stale) if pull else None
                raise _blocked(service, digest, reason, job, pull=hint)
            raise _job_failure(job)
        return selection, output, job

    selection, output, job = run_with_service(command, output_format, host, work)
    if output_format == "json":
        emit_json(
            command,
            {
                "model": selection.artifact.logical_model,
                "variant": selection.artifact.variant_id,
                "artifact_digest": output.artifact_digest,
                "removed": output.removed,
                "reclaimed_bytes": output.reclaimed_bytes,
                "cancelled_pulls": list(output.cancelled_pulls),
                "job_id": job.id if job is not None else None,
            },
        )
    elif output.removed or output.reclaimed_bytes or output.cancelled_pulls:
        what = label(selection) if output.removed else f"the partial download of {label(selection)}"
        cancelled = "".join(
            f"; cancelled the stale pull job {job_id}" for job_id in output.cancelled_pulls
        )
        click.echo(
            f"removed {what} (sha256:{output.artifact_digest}); reclaimed "
            f"{size_text(output.reclaimed_bytes)}{cancelled}"
        )
    else:
        click.echo(f"{model} is not cached")


@click.command("prune")
@click.option("--dry-run", is_flag=True, help="Only report what would be deleted.")
@config_option
@cache_dir_option
@format_option
def prune_command(
    *, dry_run: bool, config_path: Path | None, cache_dir: Path | None, output_format: str
) -> None:
    """Delete blobs no published artifact references, and abandoned partial downloads.

    A partial download is abandoned once no unfinished pull owns it (its job failed or was
    cancelled); the partial of a pull that was killed stays, since rerunning it resumes.

    Exit status: 0 done; 1 the prune job failed; 2 bad input.
    """
    command = "models.prune"
    host = choose_host(
        command,
        config_path=config_path,
        cache_dir=cache_dir,
        catalog_file=None,
        output_format=output_format,
    )

    async def work(service: ModelHostService) -> tuple[PruneReport, int, str | None]:
        # What prune can free: blobs and partial downloads.
        before = cache_bytes(service.cache)
        if dry_run:
            return await service.prune_preview(), before, None
        report, job = await service.prune()
        if report is None:
            raise _job_failure(job)
        return report, before, job.id

    report, before, job_id = run_with_service(command, output_format, host, work)
    if output_format == "json":
        emit_json(
            command,
            {
                "dry_run": dry_run,
                "orphan_blobs": report.orphan_blobs,
                "abandoned_partials": report.abandoned_partials,
                "reclaimed_bytes": report.reclaimed_bytes,
                "before_bytes": before,
                "job_id": job_id,
            },
        )
        return
    verb = "would reclaim" if dry_run else "reclaimed"
    partials = (
        f" and {report.abandoned_partials} abandoned partial download(s)"
        if report.abandoned_partials
        else ""
    )
    click.echo(
        f"{verb} {size_text(report.reclaimed_bytes)} across {report.orphan_blobs} unreferenced "
        f"blob(s){partials} ({size_text(before)} cached before prune)"
    )


@click.command("gc")
@click.option(
    "--budget-gib",
    type=FiniteFloatRange(min=0, min_open=True, max=MAX_CACHE_BUDGET_GIB),
    default=None,
    help="Cache budget in GiB, above 0 and at most 2^33 (default: the config's "
    "proxy.model_host.cache.budget_gib).",
)
@config_option
@catalog_file_option
@cache_dir_option
@format_option
def gc_command(
    *,
    budget_gib: float | None,
    config_path: Path | None,
    catalog_file: Path | None,
    cache_dir: Path | None,
    output_format: str,
) -> None:
    """Bring the cache under its budget: unreferenced blobs first, then least recently used
    artifacts, keeping protected ones (configured via -f, leased, locked, being pulled).

    Exit status: 0 done (the report says if protected artifacts keep it above budget);
    1 the gc job failed; 2 bad input or no budget (neither --budget-gib nor the config's).
    """
    command = "models.gc"
    host = choose_host(
        command,
        config_path=config_path,
        cache_dir=cache_dir,
        catalog_file=catalog_file,
        output_format=output_format,
    )

    async def work(service: ModelHostService) -> tuple[GcReport, JobRecord]:
        # floor(GiB x 2^30), as the reference sizes the budget.
        budget = int(budget_gib * GIB) if budget_gib is not None else service.budget_bytes()
        if budget is None:
            raise SbproxyError(
                "no cache budget configured.",
                code="no_cache_budget",
                remediation="Pass --budget-gib, or set proxy.model_host.cache.budget_gib in "
                "the -f config.",
            )
        report, job = await service.gc(budget_bytes=budget)
        if report is None:
            raise _job_failure(job)
        return report, job

    report, job = run_with_service(command, output_format, host, work)
    if output_format == "json":
        emit_json(command, gc_json(report, job))
        return
    for line in gc_lines(report):
        click.echo(line)


@click.command("verify")
@click.argument("model", metavar="[MODEL]", required=False)
@click.option("--variant", default=None, help="Only this variant of MODEL.")
@click.option("--full", is_flag=True, help="Re-hash SHA-256 instead of size + BLAKE3.")
@config_option
@catalog_file_option
@cache_dir_option
@format_option
def verify_command(
    *,
    model: str | None,
    variant: str | None,
    full: bool,
    config_path: Path | None,
    catalog_file: Path | None,
    cache_dir: Path | None,
    output_format: str,
) -> None:
    """Re-verify published artifacts (all, or MODEL's) against their recorded digests.

    The fast check compares each file's size and BLAKE3 fingerprint; --full recomputes
    SHA-256 against the catalog. A corrupt artifact is reported, never repaired: remove it
    and pull again.

    Exit status: 0 all intact; 1 some artifact is corrupt; 2 bad input (MODEL unknown).
    """
    command = "models.verify"
    if variant is not None and model is None:
        fail(
            command,
            SbproxyError("--variant needs MODEL.", code="usage"),
            output_format=output_format,
        )
    host = choose_host(
        command,
        config_path=config_path,
        cache_dir=cache_dir,
        catalog_file=catalog_file,
        output_format=output_format,
    )

    async def work(service: ModelHostService) -> list[dict[str, object]]:
        chosen = [
            metadata
            for metadata in service.cached()
            if (model is None or metadata.logical_model == model)
            and (variant is None or metadata.variant_id == variant)
        ]
        if model is not None and not chosen:
            service.catalog.entry(model)  # an id the catalog does not know is bad input
        rows = []
        for metadata in chosen:
            problem = await service.verify(metadata, full=full)
            rows.append(
                {
                    "model": metadata.logical_model,
                    "variant": metadata.variant_id,
                    "artifact_digest": metadata.artifact_digest,
                    "ok": problem is None,
                    "problem": problem,
                }
            )
        if model is None:
            rows.extend(
                {
                    "model": None,
                    "variant": None,
                    "artifact_digest": marker.stem,
                    "ok": False,
                    "problem": f"its metadata {marker} is unreadable or names another artifact",
                }
                for marker in service.cache.unreadable_markers()
            )
        return rows

    rows = run_with_service(command, output_format, host, work)
    if output_format == "json":
        emit_json(command, {"full": full, "artifacts": rows})
    elif not rows:
        click.echo(f"no cached artifacts{f' of {model}' if model else ''}")
    for row in rows if output_format != "json" else ():
        name = f"{row['model']}:{row['variant']}" if row["model"] else "(unknown artifact)"
        if row["ok"]:
            click.echo(f"{name} ok (sha256:{row['artifact_digest']})")
        else:
            click.echo(f"{name} CORRUPT: {row['problem']} (sha256:{row['artifact_digest']})")
    if any(not row["ok"] for row in rows):
        sys.exit(EXIT_RUNTIME)


def _owner_text(report: PartialReport) -> str:
    """Who owns a partial and what becomes of it, for the text listing."""
    job = report.job
    if job is None:
        return "no pull job (abandoned: prune or gc deletes it)"
    state = job.status.value
    if not report.owned:
        return (
            f"job {job.id} {state} (abandoned: prune or gc deletes it; a new pull of the "
            "artifact resumes from it)"
        )
    if report.owner_alive is False:
        discard = (
            f"; `sbproxy models remove {report.model} --variant {report.variant} --stale` "
            "cancels it and deletes this partial"
            if report.model and report.variant
            else ""
        )
        return f"job {job.id} {state}, its process is gone (the next pull resumes it){discard}"
    return f"job {job.id} {state}"


def partials_json(reports: list[PartialReport]) -> dict[str, object]:
    """The body of ``models.partials``: ``{total_bytes, partials: [...]}``.

    Each entry: ``artifact_digest``, ``model`` and ``variant`` (``null`` when no job says),
    ``bytes`` (the directory, resume state included: what gc and prune count), ``owned``,
    ``job_id``, ``job_status``, ``job_owner_alive`` (running jobs only, else ``null``) and
    ``files`` (``path``, ``bytes``, ``expected_bytes`` or ``null``).
    """
    return {
        "total_bytes": sum(r.download.total_bytes for r in reports),
        "partials": [
            {
                "artifact_digest": r.download.digest,
                "model": r.model,
                "variant": r.variant,
                "bytes": r.download.total_bytes,
                "owned": r.owned,
                "job_id": r.job.id if r.job is not None else None,
                "job_status": r.job.status.value if r.job is not None else None,
                "job_owner_alive": r.owner_alive,
                "files": [
                    {
                        "path": f.path,
                        "bytes": f.bytes,
                        "expected_bytes": r.expected_bytes.get(f.path),
                    }
                    for f in r.download.files
                ],
            }
            for r in reports
        ],
    }


def partials_lines(reports: list[PartialReport], *, root: Path) -> list[str]:
    """Human lines: one per artifact, one per file under it, and a total."""
    if not reports:
        return [f"no partial downloads in {root}"]
    lines = []
    for report in reports:
        name = f"{report.model}:{report.variant}" if report.model else "(unknown artifact)"
        lines.append(
            f"{name} sha256:{report.download.digest} {size_text(report.download.total_bytes)}: "
            f"{_owner_text(report)}"
        )
        for item in report.download.files:
            expected = report.expected_bytes.get(item.path)
            of = f" of {expected}" if expected is not None else ""
            lines.append(f"  {item.path}: {item.bytes}{of} bytes")
    total = sum(r.download.total_bytes for r in reports)
    lines.append(f"{size_text(total)} in {len(reports)} partial download(s)")
    return lines


@click.command("partials")
@config_option
@cache_dir_option
@format_option
def partials_command(
    *, config_path: Path | None, cache_dir: Path | None, output_format: str
) -> None:
    """List unfinished downloads: their bytes, the pull job that owns each, and its state.

    A partial owned by a queued, running or parked pull is kept by gc and prune, and the
    next pull of its artifact resumes from it (also when the job's process was killed). One
    whose job failed or was cancelled is abandoned: prune and gc delete it.

    Exit status: 0; 1 the journal could not be read; 2 bad input.
    """
    command = "models.partials"
    host = choose_host(
        command,
        config_path=config_path,
        cache_dir=cache_dir,
        catalog_file=None,
        output_format=output_format,
    )

    async def work(service: ModelHostService) -> list[PartialReport]:
        return await service.partials()

    # A root without a journal has never had a pull: nothing to list, nothing to create.
    reports = run_with_service(command, output_format, host, work) if host.cache_used() else []
    if output_format == "json":
        emit_json(command, {"cache_root": str(host.layout.root), **partials_json(reports)})
        return
    for line in partials_lines(reports, root=host.layout.root):
        click.echo(line)
