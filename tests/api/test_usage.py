"""Per-key token usage and budgets: UTC periods, batched durable writes, the gateway's
accounting of plain and streamed answers, 429 refusals before the engine, and a restart."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from pydantic import SecretStr

from sbproxy.api.usage import KEYLESS_ACCOUNT, TokenBudgetExceeded, UsageLedger, period_window
from sbproxy.config import ApiKeyRecord, BudgetPeriod, TokenBudget
from sbproxy.store import HOUR_MS, Database, StoreError, UsageDelta, UsageStore
from tests.api.support import ADMIN, served
from tests.model_host.runtime.support import until

pytestmark = pytest.mark.anyio

KEY = "sk-budget-0123456789abcdef"
OTHER_KEY = "sk-other-0123456789abcdef"


def ms(text: str) -> int:
    return int(datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp() * 1000)


@pytest.mark.parametrize(
    ("period", "now", "start", "end"),
    [
        (BudgetPeriod.HOUR, "2026-03-04T05:59:59", "2026-03-04T05:00:00", "2026-03-04T06:00:00"),
        (BudgetPeriod.DAY, "2026-03-04T23:59:59", "2026-03-04T00:00:00", "2026-03-05T00:00:00"),
        # 2026-03-04 is a Wednesday: the week began on Monday the 2nd.
        (BudgetPeriod.WEEK, "2026-03-04T12:00:00", "2026-03-02T00:00:00", "2026-03-09T00:00:00"),
        (BudgetPeriod.WEEK, "2026-03-02T00:00:00", "2026-03-02T00:00:00", "2026-03-09T00:00:00"),
        (BudgetPeriod.MONTH, "2028-02-29T10:00:00", "2028-02-01T00:00:00", "2028-03-01T00:00:00"),
        (BudgetPeriod.MONTH, "2026-12-31T23:00:00", "2026-12-01T00:00:00", "2027-01-01T00:00:00"),
    ],
)
def test_budget_periods_are_utc_calendar_periods(
    period: BudgetPeriod, now: str, start: str, end: str
) -> None:
    assert period_window(period, ms(now)) == (ms(start), ms(end))
    assert ms(start) % HOUR_MS == 0  # every period is a whole number of stored hours


class Clock:
    def __init__(self, now_ms: int) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms


async def hours(database: Database) -> list[tuple[str, int, int, int, int]]:
    rows = await database.read(
        lambda tx: tx.all(
            "SELECT key_name, hour_start_ms, prompt_tokens, completion_tokens, requests"
            " FROM token_usage ORDER BY key_name, hour_start_ms"
        )
    )
    return [tuple(row) for row in rows]


async def test_ledger_writes_in_batches_and_a_new_ledger_loads_the_window(tmp_path: Path) -> None:
    database = await Database.open(tmp_path / "journal.db")
    try:
        clock = Clock(ms("2026-03-04T10:15:00"))
        budgets = {"alice": TokenBudget(max_tokens=100, period=BudgetPeriod.DAY), "bob": None}
        ledger = UsageLedger(UsageStore(database), budgets, clock=clock)
        await ledger.load()
        for _ in range(50):
            ledger.record("alice", prompt_tokens=1, completion_tokens=1)
        clock.now_ms += HOUR_MS  # 11:15, same day, next hour
        ledger.record("alice", prompt_tokens=3, completion_tokens=0)
        ledger.record(None, prompt_tokens=2, completion_tokens=2)
        assert await hours(database) == []  # nothing written on the request path
        assert await ledger.flush() == 3  # one row per (key, hour), not per request
        assert await ledger.flush() == 0
        hour_10, hour_11 = ms("2026-03-04T10:00:00"), ms("2026-03-04T11:00:00")
        assert await hours(database) == [
            (KEYLESS_ACCOUNT, hour_11, 2, 2, 1),
            ("alice", hour_10, 50, 50, 50),
            ("alice", hour_11, 3, 0, 1),
        ]
        with pytest.raises(TokenBudgetExceeded) as refused:
            ledger.check("alice")  # 103 >= 100
        assert refused.value.code == "token_budget_exceeded"
        assert refused.value.retryable
        assert refused.value.details["retry_after_ms"] == ms("2026-03-05T00:00:00") - clock()
        ledger.check("bob")  # no budget
        ledger.check(None)  # keyless: never refused

        restarted = UsageLedger(UsageStore(database), budgets, clock=clock)
        await restarted.load()
        with pytest.raises(TokenBudgetExceeded):
            restarted.check("alice")
        (alice,) = [row for row in restarted.snapshot() if row["key"] == "alice"]
        assert alice["total_tokens"] == 103
        assert alice["requests"] == 51
        assert alice["remaining_tokens"] == 0
        assert alice["resets_at"] == "2026-03-05T00:00:00Z"

        clock.now_ms = ms("2026-03-05T00:00:00")  # a new UTC day
        restarted.check("alice")
        (alice,) = [row for row in restarted.snapshot() if row["key"] == "alice"]
        assert alice["total_tokens"] == 0
        assert alice["period_start"] == "2026-03-05T00:00:00Z"
    finally:
        await database.close()


class FlakyStore(UsageStore):
    """Fails its first write, as a journal locked past every retry would."""

    def __init__(self, database: Database) -> None:
        super().__init__(database)
        self.failures = 1

    async def add(self, deltas: list[UsageDelta]) -> None:  # type: ignore[override]
        if self.failures:
            self.failures -= 1
            raise StoreError("the journal stayed locked")
        await super().add(deltas)


async def test_a_failed_flush_keeps_its_batch_for_the_next(tmp_path: Path) -> None:
    database = await Database.open(tmp_path / "journal.db")
    try:
        clock = Clock(ms("2026-03-04T10:15:00"))
        ledger = UsageLedger(FlakyStore(database), {"alice": None}, clock=clock)
        ledger.record("alice", prompt_tokens=5, completion_tokens=5)
        assert await ledger.flush() == 0
        ledger.record("alice", prompt_tokens=1, completion_tokens=1)
        assert await ledger.flush() == 1
        assert await hours(database) == [("alice", ms("2026-03-04T10:00:00"), 6, 6, 2)]
    finally:
        await database.close()


def engine_requests(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


def budget_key(max_tokens: int) -> ApiKeyRecord:
    return ApiKeyRecord(
        name="alice",
        key=SecretStr(KEY),
        token_budget=TokenBudget(max_tokens=max_tokens, period=BudgetPeriod.DAY),
    )


async def test_streamed_usage_is_counted_and_hidden_unless_asked(tmp_path: Path) -> None:
    log = tmp_path / "engine-requests.jsonl"
    keys = [budget_key(10_000), ApiKeyRecord(name="bob", key=SecretStr(OTHER_KEY))]
    async with served(tmp_path, mode=f"requests_log={log}", keys=keys) as host:
        async with openai.AsyncOpenAI(base_url=f"{host.gateway_url}/v1", api_key=KEY) as client:
            plain = await client.chat.completions.create(
                model="tiny-chat", messages=[{"role": "user", "content": "hi"}]
            )
            assert plain.usage is not None
            assert plain.usage.total_tokens == 10
            stream = await client.chat.completions.create(
                model="tiny-chat", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            chunks = [chunk async for chunk in stream]
            # The client did not ask for usage: the engine's usage-only event is not relayed.
            assert all(chunk.usage is None for chunk in chunks)
            assert all(chunk.choices for chunk in chunks)
        async with openai.AsyncOpenAI(
            base_url=f"{host.gateway_url}/v1", api_key=OTHER_KEY
        ) as client:
            stream = await client.chat.completions.create(
                model="tiny-chat",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
            assert chunks[-1].choices == []
            assert chunks[-1].usage is not None
            assert chunks[-1].usage.prompt_tokens == 5
            assert chunks[-1].model == "tiny-chat"
        async with httpx.AsyncClient(base_url=host.gateway_url, timeout=30) as http:
            completion = await http.post(
                "/v1/completions",
                json={"prompt": "hi", "stream": True},
                headers={"authorization": f"Bearer {OTHER_KEY}"},
            )
            assert completion.status_code == 200
            usage = await http.get(f"{host.admin_url}/admin/model-host/usage", auth=ADMIN)
            metrics = (await http.get(f"{host.admin_url}/metrics")).text
        bodies = [r["body"] for r in engine_requests(log) if r["path"] == "/v1/chat/completions"]
        assert [b.get("stream_options") for b in bodies] == [
            None,
            {"include_usage": True},  # set by the gateway
            {"include_usage": True},  # asked by the client
        ]
        assert usage.status_code == 200
        rows = {row["key"]: row for row in usage.json()["keys"]}
        assert rows["alice"]["prompt_tokens"] == 10  # plain + streamed
        assert rows["alice"]["completion_tokens"] == 10
        assert rows["alice"]["requests"] == 2
        assert rows["alice"]["budget_tokens"] == 10_000
        assert rows["bob"]["total_tokens"] == 20  # streamed chat + streamed completion
        assert rows["bob"]["budget_tokens"] is None
        assert KEY not in usage.text
        assert 'sbproxy_gateway_tokens_total{key="alice",kind="prompt"} 10.0' in metrics
        assert 'sbproxy_gateway_tokens_total{key="bob",kind="completion"} 10.0' in metrics


async def test_a_stream_left_early_is_still_counted(tmp_path: Path) -> None:
    async with served(tmp_path, mode="token_delay_s=0.5", keys=[budget_key(10_000)]) as host:
        async with httpx.AsyncClient(base_url=host.gateway_url, timeout=30) as http:
            body = {
                "model": "tiny-chat",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
            }
            headers = {"authorization": f"Bearer {KEY}"}
            async with http.stream(
                "POST", "/v1/chat/completions", json=body, headers=headers
            ) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        break
        gate = host.host.manager.deployment("tiny").gate

        def counted() -> bool:
            return gate.active == 0 and host.gateway.usage.snapshot()[0]["requests"] == 1

        await until(counted, timeout_s=5)
        (alice,) = host.gateway.usage.snapshot()
        assert alice["prompt_tokens"] == 0  # unknown without the engine's usage
        completion = alice["completion_tokens"]
        assert isinstance(completion, int)
        assert 1 <= completion <= 3  # one per relayed event, not the full five


async def test_budget_refuses_before_the_engine_and_survives_a_restart(tmp_path: Path) -> None:
    log = tmp_path / "engine-requests.jsonl"
    keys = [budget_key(15)]
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
    async with served(tmp_path, mode=f"requests_log={log}", keys=keys) as host:
        async with openai.AsyncOpenAI(
            base_url=f"{host.gateway_url}/v1", api_key=KEY, max_retries=0
        ) as client:
            for _ in range(2):  # 10 tokens each: 0 < 15, then 10 < 15
                await client.chat.completions.create(model="tiny-chat", messages=messages)
            assert len(engine_requests(log)) == 2
            with pytest.raises(openai.RateLimitError) as refused:
                await client.chat.completions.create(model="tiny-chat", messages=messages)
        response = refused.value.response
        assert response.status_code == 429
        error = response.json()["error"]
        assert error["code"] == "token_budget_exceeded"
        assert error["sbproxy_reason"] == "token_budget_exceeded"
        assert error["type"] == "insufficient_quota"
        assert error["retryable"] is True
        assert 1 <= int(response.headers["retry-after"]) <= 86_400
        assert len(engine_requests(log)) == 2  # the engine never saw the refused request
        (alice,) = host.gateway.usage.snapshot()
        assert alice["total_tokens"] == 20
        assert alice["remaining_tokens"] == 0

    # The same journal, a new process's worth of app: the refusal persists.
    async with served(tmp_path, mode=f"requests_log={log}", keys=keys) as host:
        async with httpx.AsyncClient(base_url=host.gateway_url, timeout=30) as http:
            again = await http.post(
                "/v1/chat/completions",
                json={"model": "tiny-chat", "messages": messages},
                headers={"authorization": f"Bearer {KEY}"},
            )
            usage = await http.get(f"{host.admin_url}/admin/model-host/usage", auth=ADMIN)
        assert again.status_code == 429
        assert again.json()["error"]["code"] == "token_budget_exceeded"
        assert len(engine_requests(log)) == 2
        (alice,) = usage.json()["keys"]
        assert alice["total_tokens"] == 20
        assert alice["requests"] == 2


async def test_usage_route_requires_admin_credentials(tmp_path: Path) -> None:
    async with served(tmp_path) as host, httpx.AsyncClient(base_url=host.admin_url) as http:
        anonymous = await http.get("/admin/model-host/usage")
        assert anonymous.status_code == 401
        assert anonymous.json()["code"] == "unauthorized"
        empty = await http.get("/admin/model-host/usage", auth=ADMIN)
        assert empty.json() == {"schema_version": 1, "flush_interval_s": 1.0, "keys": []}


async def test_reconfigure_takes_new_budgets_and_keeps_counts(tmp_path: Path) -> None:
    database = await Database.open(tmp_path / "journal.db")
    try:
        clock = Clock(ms("2026-03-04T10:15:00"))
        ledger = UsageLedger(UsageStore(database), {"alice": None}, clock=clock)
        await ledger.load()
        ledger.record("alice", prompt_tokens=30, completion_tokens=20)
        ledger.check("alice")
        await ledger.reconfigure(
            {
                "alice": TokenBudget(max_tokens=40, period=BudgetPeriod.HOUR),
                "carol": TokenBudget(max_tokens=10, period=BudgetPeriod.MONTH),
            }
        )
        with pytest.raises(TokenBudgetExceeded):  # the hour's 50 tokens, from the store
            ledger.check("alice")
        ledger.check("carol")
        assert {row["key"] for row in ledger.snapshot()} == {"alice", "carol"}
        assert ledger.tokens_since_start()[("alice", "prompt")] == 30
    finally:
        await database.close()
