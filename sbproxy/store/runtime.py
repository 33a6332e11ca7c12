"""Durable runtime bookkeeping: deployment generations and committed desired revisions.

Generations are handed out by an atomic increment, so a deployment's generation grows
across restarts and is never reused. The last committed revision is what a restarted host
converges to.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sbproxy.store.database import Database, Transaction
from sbproxy.store.records import wall_clock_ms

__all__ = ["CommittedRevision", "RuntimeStore"]


@dataclass(frozen=True)
class CommittedRevision:
    """A desired state the runtime committed to."""

    revision: int
    content_digest: str
    desired: Mapping[str, Any]
    committed_at_ms: int


class RuntimeStore:
    """Repository of generations and revisions over the journal database."""

    def __init__(self, database: Database, *, clock: Callable[[], int] = wall_clock_ms) -> None:
        self.database = database
        self.clock = clock

    async def next_generation(self, deployment: str) -> int:
        """A new generation number for ``deployment`` (1, 2, ...), durable before returned."""
        params = {"d": deployment, "now": self.clock()}

        def work(tx: Transaction) -> int:
            return int(
                tx.scalar(
                    "INSERT INTO deployment_generations (deployment, generation, updated_at_ms)"
                    " VALUES (:d, 1, :now) ON CONFLICT (deployment) DO UPDATE SET"
                    " generation = deployment_generations.generation + 1,"
                    " updated_at_ms = :now RETURNING generation",
                    params,
                )
            )

        return await self.database.write(work)

    async def commit_revision(self, *, content_digest: str, desired: Mapping[str, Any]) -> int:
        """Record a committed desired state; returns its revision number (1, 2, ...)."""
        params = {
            "digest": content_digest,
            "desired": json.dumps(desired, sort_keys=True),
            "now": self.clock(),
        }

        def work(tx: Transaction) -> int:
            return int(
                tx.scalar(
                    "INSERT INTO runtime_revisions (content_digest, desired_json,"
                    " committed_at_ms) VALUES (:digest, :desired, :now) RETURNING revision",
                    params,
                )
            )

        return await self.database.write(work)

    async def latest_revision(self) -> CommittedRevision | None:
        """The last committed revision, if any."""
        row = await self.database.read(
            lambda tx: tx.one("SELECT * FROM runtime_revisions ORDER BY revision DESC LIMIT 1")
        )
        if row is None:
            return None
        return CommittedRevision(
            revision=row["revision"],
            content_digest=row["content_digest"],
            desired=json.loads(row["desired_json"]),
            committed_at_ms=row["committed_at_ms"],
        )
