"""Per-key token usage and token budgets of the gateway.

Usage comes from the engine's own ``usage`` object (``prompt_tokens``, ``completion_tokens``)
of each answer: the JSON body of a plain answer, and the event of a stream that carries it
(see :mod:`sbproxy.api.gateway` for how streams are made to carry it). It is counted under
the caller's key *name* (never the key), per UTC hour, in memory first:

* the request path only adds integers to a dict (no I/O, no commit);
* a background task writes the batch of changed ``(key, hour)`` rows every
  :data:`FLUSH_INTERVAL_S` in one transaction (:class:`~sbproxy.store.UsageStore`), and once
  more at shutdown; a failed write keeps the batch for the next try;
* at start, each key's current budget window is summed from the store, so counting
  survives a restart. Usage of the last second before a crash (SIGKILL) can be lost; a
  graceful stop loses nothing.

Budgets (``proxy.api_keys[].token_budget``: ``max_tokens`` per ``period``) are counted per
UTC calendar period -- hour, day, week (Monday 00:00 UTC) or month (the 1st, 00:00 UTC) --
and checked **before** a request is admitted: a key whose usage in the current period is at
or over ``max_tokens`` gets 429 ``token_budget_exceeded`` with ``Retry-After`` (seconds until
the period resets). The check is a pre-check: a request admitted at 90 of 100 tokens may end
at 140, and the key is refused from then on. Usage of a key without a budget is counted per
UTC day.

Keyless mode (no ``api_keys``, ``sbproxy run``): usage is counted under the reserved name
:data:`KEYLESS_ACCOUNT` (``(keyless)``, which no configured key can be named: key names
match ``[A-Za-z0-9._-]``); there is no budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final

import anyio
from litestar import get
from litestar.handlers import HTTPRouteHandler

from sbproxy.api.errors import ApiError
from sbproxy.config import BudgetPeriod, TokenBudget
from sbproxy.errors import SbproxyError
from sbproxy.store import HOUR_MS, UsageDelta, UsageStore

__all__ = [
    "FLUSH_INTERVAL_S",
    "KEYLESS_ACCOUNT",
    "TokenBudgetExceeded",
    "UsageLedger",
    "period_window",
    "usage_handlers",
]

logger = logging.getLogger(__name__)

KEYLESS_ACCOUNT: Final = "(keyless)"
# How often pending usage is written: at most one commit per second, whatever the traffic.
FLUSH_INTERVAL_S: Final = 1.0


def wall_ms() -> int:
    """Milliseconds since the epoch (UTC)."""
    return time.time_ns() // 1_000_000


def period_window(period: BudgetPeriod, now_ms: int) -> tuple[int, int]:
    """The UTC calendar period holding ``now_ms``: ``(start_ms, end_ms)``, end exclusive.

    Hours and days are epoch-aligned; a week starts on Monday 00:00 UTC (ISO 8601); a month
    on its 1st at 00:00 UTC. Every boundary is a whole UTC hour.
    """
    if period == BudgetPeriod.HOUR:
        start = now_ms - now_ms % HOUR_MS
        return start, start + HOUR_MS
    day_ms = 24 * HOUR_MS
    if period == BudgetPeriod.DAY:
        start = now_ms - now_ms % day_ms
        return start, start + day_ms
    moment = datetime.fromtimestamp(now_ms / 1000, tz=UTC)
    midnight = moment.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == BudgetPeriod.WEEK:
        first = midnight - timedelta(days=midnight.weekday())
        following = first + timedelta(days=7)
    else:
        first = midnight.replace(day=1)
        following = (first + timedelta(days=32)).replace(day=1)
    return int(first.timestamp() * 1000), int(following.timestamp() * 1000)


class TokenBudgetExceeded(ApiError):
    """A key has used its token budget for the current period (``token_budget_exceeded``).

    Retryable after ``retry_after_ms`` (the end of the period): the gateway answers 429 with
    ``Retry-After``.
    """

    default_code = "token_budget_exceeded"
    default_retryable = True


@dataclass
class _Account:
    """One key's usage in its current window, and since this process started."""

    name: str
    period: BudgetPeriod
    max_tokens: int | None
    start_ms: int = 0
    end_ms: int = 0
    prompt: int = 0
    completion: int = 0
    requests: int = 0
    # Since process start, for the Prometheus counter (never reset by a new window).
    lifetime_prompt: int = 0
    lifetime_completion: int = 0

    def roll(self, now_ms: int) -> None:
        """Start a new window when ``now_ms`` is past the current one."""
        if now_ms >= self.end_ms or now_ms < self.start_ms:
            self.start_ms, self.end_ms = period_window(self.period, now_ms)
            self.prompt = self.completion = self.requests = 0

    @property
    def total(self) -> int:
        return self.prompt + self.completion


class UsageLedger:
    """Token usage of every key: in-memory totals, budget checks, batched durable writes.

    Args:
        store: Where usage is persisted (``None``: memory only, nothing survives a restart).
        budgets: Configured key names and their budgets (``None``: no budget).
        clock: Wall clock in epoch milliseconds (tests move it across period boundaries).
        flush_interval_s: Seconds between batched writes.
    """

    def __init__(
        self,
        store: UsageStore | None,
        budgets: Mapping[str, TokenBudget | None],
        *,
        clock: Callable[[], int] = wall_ms,
        flush_interval_s: float = FLUSH_INTERVAL_S,
    ) -> None:
        self.store = store
        self.clock = clock
        self.flush_interval_s = flush_interval_s
        self._accounts: dict[str, _Account] = {
            name: _Account(
                name=name,
                period=budget.period if budget else BudgetPeriod.DAY,
                max_tokens=budget.max_tokens if budget else None,
            )
            for name, budget in budgets.items()
        }
        # (key name, hour start) -> [prompt, completion, requests] not yet written.
        self._pending: dict[tuple[str, int], list[int]] = {}
        self._task: asyncio.Task[None] | None = None

    def _account(self, name: str) -> _Account:
        account = self._accounts.get(name)
        if account is None:  # the keyless account, made on first use
            account = _Account(name=name, period=BudgetPeriod.DAY, max_tokens=None)
            account.roll(self.clock())
            self._accounts[name] = account
        return account

    # -- lifecycle -------------------------------------------------------------------------

    async def load(self) -> None:
        """Sum each configured key's current window from the store (before serving).

        Raises:
            StoreError: ``store_failed`` when the journal cannot be read.
        """
        now = self.clock()
        for account in self._accounts.values():
            account.roll(now)
            if self.store is None:
                continue
            totals = await self.store.totals(
                account.name, since_ms=account.start_ms, until_ms=account.end_ms
            )
            account.prompt = totals.prompt_tokens
            account.completion = totals.completion_tokens
            account.requests = totals.requests

    async def reconfigure(self, budgets: Mapping[str, TokenBudget | None]) -> None:
        """Take new key records (a committed reload): keys and budgets as given, each
        window re-summed from the store (pending usage is written first, so nothing is lost
        or counted twice); this process's token counters are kept.

        Raises:
            StoreError: ``store_failed`` when the journal cannot be written or read.
        """
        await self.flush()
        lifetime = self._accounts
        accounts = {
            name: _Account(
                name=name,
                period=budget.period if budget else BudgetPeriod.DAY,
                max_tokens=budget.max_tokens if budget else None,
            )
            for name, budget in budgets.items()
        }
        for name, account in accounts.items():
            if name in lifetime:
                account.lifetime_prompt = lifetime[name].lifetime_prompt
                account.lifetime_completion = lifetime[name].lifetime_completion
        keyless = lifetime.get(KEYLESS_ACCOUNT)
        if keyless is not None and not budgets:
            accounts[KEYLESS_ACCOUNT] = keyless
        self._accounts = accounts
        await self.load()

    async def start(self) -> None:
        """Load the windows, then flush in the background every ``flush_interval_s``."""
        await self.load()
        if self.store is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._flush_loop())

    async def stop(self) -> None:
        """Stop the background flusher and write what is pending (shielded)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with anyio.CancelScope(shield=True):
            await self.flush()

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval_s)
            # A flush runs to its end: cancelling it mid-write would lose the taken batch.
            with anyio.CancelScope(shield=True):
                await self.flush()

    async def flush(self) -> int:
        """Write pending usage in one transaction; returns the rows written.

        A failed write is logged and its batch kept (merged with newer usage) for the next
        flush, so usage is never counted twice nor dropped by a transient store error.
        """
        if not self._pending or self.store is None:
            return 0
        batch, self._pending = self._pending, {}
        deltas = [
            UsageDelta(
                key_name=name,
                hour_start_ms=hour,
                prompt_tokens=counts[0],
                completion_tokens=counts[1],
                requests=counts[2],
            )
            for (name, hour), counts in batch.items()
        ]
        try:
            await self.store.add(deltas)
        except Exception as exc:  # noqa: BLE001 - any failure keeps the batch for later
            code = exc.code if isinstance(exc, SbproxyError) else type(exc).__name__
            logger.warning("usage flush failed, will retry: %s [%s]", exc, code)
            for slot, counts in batch.items():
                pending = self._pending.setdefault(slot, [0, 0, 0])
                for index, value in enumerate(counts):
                    pending[index] += value
            return 0
        return len(deltas)

    # -- the request path ------------------------------------------------------------------

    def check(self, name: str | None) -> None:
        """Refuse a request of key ``name`` whose budget is used up (keyless: never).

        Raises:
            TokenBudgetExceeded: ``token_budget_exceeded``, with ``retry_after_ms`` (until
                the period resets), ``period`` and ``budget_tokens`` in its details.
        """
        if name is None:
            return
        account = self._accounts.get(name)
        if account is None or account.max_tokens is None:
            return
        now = self.clock()
        account.roll(now)
        if account.total < account.max_tokens:
            return
        reset = datetime.fromtimestamp(account.end_ms / 1000, tz=UTC)
        raise TokenBudgetExceeded(
            f"key {name!r} has used its token budget ({account.max_tokens} tokens per "
            f"{account.period.value}, UTC); it resets at {reset.isoformat()}",
            remediation="Wait for the period to reset, or raise the key's token_budget.",
            details={
                "retry_after_ms": max(1, account.end_ms - now),
                "period": account.period.value,
                "budget_tokens": account.max_tokens,
            },
        )

    def record(self, name: str | None, *, prompt_tokens: int, completion_tokens: int) -> None:
        """Count one answered request of key ``name`` (``None``: keyless)."""
        account = self._account(KEYLESS_ACCOUNT if name is None else name)
        now = self.clock()
        account.roll(now)
        account.prompt += prompt_tokens
        account.completion += completion_tokens
        account.requests += 1
        account.lifetime_prompt += prompt_tokens
        account.lifetime_completion += completion_tokens
        pending = self._pending.get((account.name, now - now % HOUR_MS))
        if pending is None:
            self._pending[(account.name, now - now % HOUR_MS)] = [
                prompt_tokens,
                completion_tokens,
                1,
            ]
        else:
            pending[0] += prompt_tokens
            pending[1] += completion_tokens
            pending[2] += 1

    # -- reading ---------------------------------------------------------------------------

    def tokens_since_start(self) -> dict[tuple[str, str], int]:
        """Tokens counted by this process: ``{(key name, "prompt"|"completion"): n}``."""
        out: dict[tuple[str, str], int] = {}
        for account in self._accounts.values():
            out[(account.name, "prompt")] = account.lifetime_prompt
            out[(account.name, "completion")] = account.lifetime_completion
        return out

    def snapshot(self) -> list[dict[str, object]]:
        """Every key's usage in its current period, sorted by key name.

        Each entry: ``{key, period, period_start, resets_at`` (ISO 8601 UTC)``,
        prompt_tokens, completion_tokens, total_tokens, requests, budget_tokens`` (``None``
        without a budget)``, remaining_tokens`` (``None`` without a budget; never below 0)``}``.
        """
        now = self.clock()
        rows: list[dict[str, object]] = []
        for name in sorted(self._accounts):
            account = self._accounts[name]
            account.roll(now)
            budget = account.max_tokens
            rows.append(
                {
                    "key": name,
                    "period": account.period.value,
                    "period_start": _iso(account.start_ms),
                    "resets_at": _iso(account.end_ms),
                    "prompt_tokens": account.prompt,
                    "completion_tokens": account.completion,
                    "total_tokens": account.total,
                    "requests": account.requests,
                    "budget_tokens": budget,
                    "remaining_tokens": None if budget is None else max(0, budget - account.total),
                }
            )
        return rows


def _iso(epoch_ms: int) -> str:
    return datetime.fromtimestamp(epoch_ms / 1000, tz=UTC).isoformat().replace("+00:00", "Z")


def usage_handlers(ledger: UsageLedger | None) -> list[HTTPRouteHandler]:
    """``GET /model-host/usage`` (under the admin router: ``/admin/model-host/usage``)."""

    @get("/model-host/usage", sync_to_thread=False)
    def usage() -> dict[str, object]:
        """Token usage of every key in its current UTC period, with its budget.

        200 ``{schema_version: 1, flush_interval_s, keys: [{key, period, period_start,
        resets_at, prompt_tokens, completion_tokens, total_tokens, requests, budget_tokens,
        remaining_tokens}]}``; counts include usage not yet written to the journal.
        """
        return {
            "schema_version": 1,
            "flush_interval_s": ledger.flush_interval_s if ledger else None,
            "keys": ledger.snapshot() if ledger else [],
        }

    return [usage]
