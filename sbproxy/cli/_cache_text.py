"""How the cache verbs of ``sbproxy models`` report artifacts, sizes and collections.

Pure functions from results to JSON-ready dicts and human lines, shared by ``pull``,
``import``, ``remove``, ``gc`` and ``prune`` so one artifact or one GC report reads the same
wherever it appears.
"""

from __future__ import annotations

from sbproxy.model_host.flows import GcReport, PullOutput
from sbproxy.model_host.service import Selection
from sbproxy.store import JobRecord, JobStatus

__all__ = [
    "artifact_line",
    "artifact_row",
    "gc_json",
    "gc_lines",
    "job_error",
    "label",
    "size_text",
]

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def size_text(value: int) -> str:
    """``512 bytes``, ``4.0 KiB``, ``1.5 GiB`` (binary units)."""
    for unit, scale in _UNITS:
        if abs(value) >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value} bytes"


def label(selection: Selection) -> str:
    """``<model>:<variant>``."""
    return f"{selection.artifact.logical_model}:{selection.artifact.variant_id}"


def artifact_row(selection: Selection, job: JobRecord) -> dict[str, object]:
    """One entry of ``artifacts`` in ``models.pull`` / ``models.import`` JSON.

    Every key is always present; a failed pull has ``error: {code, message}`` and nulls where
    a result would be.
    """
    artifact = selection.artifact
    row: dict[str, object] = {
        "model": artifact.logical_model,
        "variant": artifact.variant_id,
        "engine": artifact.engine.value,
        "artifact_digest": artifact.digest,
        "snapshot_path": None,
        "verified_bytes": None,
        "job_id": job.id,
        "cache_hit": None,
        "error": None,
    }
    if job.status == JobStatus.SUCCEEDED:
        output = PullOutput.model_validate(job.output)
        row.update(
            snapshot_path=output.snapshot_path,
            verified_bytes=output.verified_bytes,
            cache_hit=output.cache_hit,
        )
    else:
        row["error"] = job_error(job)
    return row


def job_error(job: JobRecord) -> dict[str, str]:
    """``{code, message}`` of a job that did not succeed."""
    if job.error is not None:
        return {"code": job.error.code, "message": job.error.message}
    return {"code": job.status.value, "message": f"job {job.id} ended {job.status.value}"}


def artifact_line(row: dict[str, object]) -> tuple[str, bool]:
    """The human line for one ``artifact_row`` and whether it reports a success."""
    name = f"{row['model']}:{row['variant']}"
    error = row["error"]
    if isinstance(error, dict):
        return (
            f"{name} failed (job {row['job_id']}): {error['code']}: {error['message']}",
            False,
        )
    return (
        f"{name} verified {row['verified_bytes']} bytes at {row['snapshot_path']} "
        f"(sha256:{row['artifact_digest']})",
        True,
    )


def gc_json(report: GcReport, job: JobRecord) -> dict[str, object]:
    """The GC report with its job id (``gc`` in ``models.pull``, the body of ``models.gc``)."""
    return {**report.model_dump(mode="json"), "job_id": job.id}


def gc_lines(report: GcReport) -> list[str]:
    """``cache GC: A -> B bytes (R reclaimed, U still above budget)`` and what it did."""
    lines = [
        f"cache GC: {report.before_bytes} -> {report.after_bytes} bytes "
        f"({report.reclaimed_bytes} reclaimed, {report.budget_unsatisfied_bytes} still above "
        "budget)"
    ]
    lines.extend(f"  deleted sha256:{digest}" for digest in report.deleted_artifacts)
    lines.extend(
        f"  kept sha256:{digest}: {reason}"
        for digest, reason in sorted(report.skipped_artifacts.items())
    )
    return lines
