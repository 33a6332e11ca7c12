"""The autoscaler's records in the fleet's PostgreSQL journal (migration 12): the replica
count each ``fleet.scale`` decision set (``fleet_scale``) and the demand a gateway records
for a deployment at zero replicas (``fleet_demand``).

A decision is written like a placement: in one transaction fenced by the controller's epoch
(:meth:`~sbproxy.store.fleet.FleetStore.fenced`), with a finished ``fleet.scale`` job whose
input is the load figures the controller saw and the reason, and a compare-and-set on the
count it changes, so that a deposed controller's late decision, or two decisions made from
one stale count, are refused rather than applied twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sbproxy.store.fleet import ControllerLease, FleetStore

__all__ = ["SCALE_JOB_KIND", "record_demand", "record_scale"]

SCALE_JOB_KIND = "fleet.scale"
"""The kind of the job each scaling decision records (``sbproxy jobs list``)."""


def record_scale(
    store: FleetStore,
    lease: ControllerLease,
    decision: Mapping[str, Any],
) -> str | None:
    """Record one scaling decision; the ``fleet.scale`` job's id, or ``None`` when the
    deployment's recorded count is no longer ``decision["from_replicas"]`` (another decision
    came first: nothing written).

    Args:
        store: The fleet's store.
        lease: This controller's lease (the write is fenced by its epoch).
        decision: A :class:`~sbproxy.fleet.autoscale.ScaleDecision` as JSON: ``deployment``,
            ``from_replicas``, ``to_replicas``, ``reason``, ``direction``, ``message`` and
            ``figures`` (the load it saw). A deployment with no row yet counts as being at
            ``from_replicas`` (its range's initial count).

    The deployment's demand row, if any, is consumed in the same transaction: one decision
    answers every request that waited.

    Raises:
        Deposed: ``controller_deposed`` -- the lease is no longer this controller's.
        JournalUnavailable: ``journal_unavailable``.
    """
    deployment = str(decision["deployment"])
    with store.fenced(lease) as (cursor, now):
        row = cursor.execute(
            "SELECT replicas FROM fleet_scale WHERE deployment = %s FOR UPDATE", (deployment,)
        ).fetchone()
        if row is not None and int(row[0]) != int(decision["from_replicas"]):
            return None
        job_id = FleetStore.record_job(
            cursor,
            now,
            kind=SCALE_JOB_KIND,
            subject=f"deployment:{deployment}",
            node=lease.holder,
            body={**decision, "epoch": lease.epoch},
        )
        cursor.execute(
            "INSERT INTO fleet_scale (deployment, replicas, decided_at_ms, reason, epoch,"
            " job_id) VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (deployment) DO UPDATE SET"
            " replicas = EXCLUDED.replicas, decided_at_ms = EXCLUDED.decided_at_ms,"
            " reason = EXCLUDED.reason, epoch = EXCLUDED.epoch, job_id = EXCLUDED.job_id",
            (
                deployment,
                int(decision["to_replicas"]),
                now,
                decision["reason"],
                lease.epoch,
                job_id,
            ),
        )
        cursor.execute("DELETE FROM fleet_demand WHERE deployment = %s", (deployment,))
        FleetStore.record_event(
            cursor,
            now,
            "scaled",
            deployment,
            {
                "from": decision["from_replicas"],
                "to": decision["to_replicas"],
                "reason": decision["reason"],
                "job_id": job_id,
                "epoch": lease.epoch,
            },
        )
    return job_id


def record_demand(store: FleetStore, deployment: str, *, node: str) -> bool:
    """Record that a request on ``node``'s gateway wants ``deployment``, which has no
    replica; whether this call wrote the row (``False``: one was already waiting -- however
    many requests wait, the controller sees one demand and makes one decision -- or the
    fleet's count of it is above zero already: a gateway whose view was a heartbeat old
    must not leave a demand behind that would wake the deployment at its next idle).

    Raises:
        JournalUnavailable: ``journal_unavailable``.
    """
    with store.transaction() as (cursor, now):
        written = cursor.execute(
            "INSERT INTO fleet_demand (deployment, at_ms, node) SELECT %s, %s, %s"
            " WHERE NOT EXISTS (SELECT 1 FROM fleet_scale WHERE deployment = %s"
            " AND replicas > 0) ON CONFLICT (deployment) DO NOTHING",
            (deployment, now, node, deployment),
        ).rowcount
    return bool(written)
