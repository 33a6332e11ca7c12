"""A journal holding jobs in every state the listings show, written through the real store.

Shared by the tests that hold :class:`~sbproxy.store.JournalReader` equal to the full store
and by ``benchmarks/cli.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

from sbproxy.store import Database, ErrorInfo, JobStatus, JobStore, LeaseTime, boot_id
from sbproxy.workflows import WorkerIdentity

__all__ = ["GONE_OWNER_PID", "fill_varied_journal"]

# A pid above Linux's pid_max: no process can have it, so its owner is certainly gone.
GONE_OWNER_PID = 4_194_305


async def fill_varied_journal(path: Path) -> dict[str, str]:
    """Create the journal at ``path`` with one job per label; returns label -> job id.

    Labels: ``succeeded`` (output, two steps), ``failed`` (error, a failed step),
    ``queued``, ``parked``, ``cancelled``, ``cancel_requested`` (running, live owner),
    ``running_live`` (this process's identity, a live lease), ``stale_gone`` (owner gone:
    ``owner_gone``), ``stale_other_boot`` (a live owner's lease stamped on another boot's
    clock: ``lease_expired``), and ``other_kind`` (queued, kind ``gc``, no subject).
    """
    database = await Database.open(path)
    this_boot = JobStore(database)
    other_boot = JobStore(database, lease_clock=lambda: LeaseTime(clock="another-boot", ms=5))
    live_owner = WorkerIdentity.current().owner
    gone_owner = f"{boot_id()}/{GONE_OWNER_PID}/1/gone"
    ids: dict[str, str] = {}
    try:
        for index, label in enumerate(
            (
                "succeeded",
                "failed",
                "queued",
                "parked",
                "cancelled",
                "cancel_requested",
                "running_live",
                "stale_gone",
                "stale_other_boot",
                "other_kind",
            )
        ):
            kind = "gc" if label == "other_kind" else "pull"
            submitted = await this_boot.submit(
                kind=kind,
                workflow_version=1,
                input_json=json.dumps({"n": index, "label": label}),
                idempotency_key=f"key-{label}",
                subject=None if label == "other_kind" else f"artifact:sha256:{index:064x}",
                trace_context={"traceparent": f"00-{index:032x}-{index + 1:016x}-01"},
            )
            job_id = ids[label] = submitted.job.id
            if label in ("queued", "other_kind"):
                continue
            owner = gone_owner if label == "stale_gone" else live_owner
            store = other_boot if label == "stale_other_boot" else this_boot
            claimed = await store.claim(owner=owner, lease_ms=600_000, job_id=job_id)
            assert claimed is not None
            attempt = claimed.attempt
            await store.begin_step(job_id, owner=owner, attempt=attempt, seq=0, name="plan")
            await store.end_step(
                job_id, owner=owner, attempt=attempt, seq=0, name="plan", output_json='{"a":1}'
            )
            await store.report_progress(
                job_id,
                owner=owner,
                attempt=attempt,
                progress={"done": 3, "total": 8, "unit": "bytes", "current": "f.gguf"},
                event=True,
            )
            if label == "failed":
                error = ErrorInfo("digest_mismatch", "the bytes were wrong")
                await store.begin_step(job_id, owner=owner, attempt=attempt, seq=1, name="fetch")
                await store.end_step(
                    job_id, owner=owner, attempt=attempt, seq=1, name="fetch", error=error
                )
                await store.finish(
                    job_id, owner=owner, attempt=attempt, status=JobStatus.FAILED, error=error
                )
            elif label == "succeeded":
                await store.begin_step(job_id, owner=owner, attempt=attempt, seq=1, name="fetch")
                await store.end_step(
                    job_id, owner=owner, attempt=attempt, seq=1, name="fetch", output_json="2"
                )
                await store.finish(
                    job_id,
                    owner=owner,
                    attempt=attempt,
                    status=JobStatus.SUCCEEDED,
                    output_json='{"digest": "abc"}',
                )
            elif label == "parked":
                await store.finish(
                    job_id,
                    owner=owner,
                    attempt=attempt,
                    status=JobStatus.PARKED,
                    error=ErrorInfo("engine_missing", "no engine"),
                )
            elif label == "cancelled":
                await store.finish(job_id, owner=owner, attempt=attempt, status=JobStatus.CANCELLED)
            elif label == "cancel_requested":
                await store.request_cancel(job_id)
    finally:
        await database.close()
    return ids
