"""Durable token usage: tokens per API key name and UTC hour (table ``token_usage``).

The gateway aggregates usage in memory and hands it here in batches (:meth:`UsageStore.add`,
one ``BEGIN IMMEDIATE`` transaction per batch), so the request path never waits for a
commit. Rows are only ever incremented (``ON CONFLICT ... DO UPDATE SET x = x + ...``), so
two writers, or a batch retried after "database is locked", add up instead of overwriting.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sbproxy.store.database import Database, Transaction
from sbproxy.store.records import wall_clock_ms

__all__ = ["HOUR_MS", "UsageDelta", "UsageStore", "UsageTotals"]

HOUR_MS = 3_600_000


@dataclass(frozen=True)
class UsageTotals:
    """Token counts over some window.

    Attributes:
        prompt_tokens: Tokens of the prompts (and of embedding inputs).
        completion_tokens: Generated tokens.
        requests: Answered requests counted.
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    requests: int = 0

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class UsageDelta:
    """Tokens to add to one key's hour.

    Attributes:
        key_name: The API key's configured name (never the key itself).
        hour_start_ms: Start of the UTC hour, epoch milliseconds (a multiple of
            :data:`HOUR_MS`).
        prompt_tokens: Prompt tokens to add.
        completion_tokens: Completion tokens to add.
        requests: Requests to add.
    """

    key_name: str
    hour_start_ms: int
    prompt_tokens: int
    completion_tokens: int
    requests: int


class UsageStore:
    """Repository of per-key hourly token usage over the journal database."""

    def __init__(self, database: Database, *, clock: Callable[[], int] = wall_clock_ms) -> None:
        self.database = database
        self.clock = clock

    async def add(self, deltas: Sequence[UsageDelta]) -> None:
        """Add ``deltas`` in one transaction (nothing to do for an empty batch).

        Raises:
            ValueError: an ``hour_start_ms`` that is not the start of an hour.
            StoreError: ``store_failed`` when the journal stays locked.
        """
        if not deltas:
            return
        for delta in deltas:
            if delta.hour_start_ms % HOUR_MS:
                raise ValueError(f"{delta.hour_start_ms} is not the start of a UTC hour")
        now = self.clock()
        rows = [
            {
                "key": delta.key_name,
                "hour": delta.hour_start_ms,
                "prompt": delta.prompt_tokens,
                "completion": delta.completion_tokens,
                "requests": delta.requests,
                "now": now,
            }
            for delta in deltas
        ]

        def work(tx: Transaction) -> None:
            tx.executemany(
                "INSERT INTO token_usage (key_name, hour_start_ms, prompt_tokens,"
                " completion_tokens, requests, updated_at_ms)"
                " VALUES (:key, :hour, :prompt, :completion, :requests, :now)"
                " ON CONFLICT (key_name, hour_start_ms) DO UPDATE SET"
                " prompt_tokens = token_usage.prompt_tokens + excluded.prompt_tokens,"
                " completion_tokens = token_usage.completion_tokens + excluded.completion_tokens,"
                " requests = token_usage.requests + excluded.requests,"
                " updated_at_ms = excluded.updated_at_ms",
                rows,
            )

        await self.database.write(work)

    async def totals(self, key_name: str, *, since_ms: int, until_ms: int) -> UsageTotals:
        """The usage of ``key_name`` in the hours starting in ``[since_ms, until_ms)``."""
        params = {"key": key_name, "since": since_ms, "until": until_ms}
        row = await self.database.read(
            lambda tx: tx.one(
                "SELECT COALESCE(SUM(prompt_tokens), 0),"
                " COALESCE(SUM(completion_tokens), 0), COALESCE(SUM(requests), 0)"
                " FROM token_usage"
                " WHERE key_name = :key AND hour_start_ms >= :since"
                " AND hour_start_ms < :until",
                params,
            )
        )
        assert row is not None  # noqa: S101 - an aggregate returns one row
        return UsageTotals(
            prompt_tokens=int(row[0]), completion_tokens=int(row[1]), requests=int(row[2])
        )
