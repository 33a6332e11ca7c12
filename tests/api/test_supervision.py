"""Request supervision at the gateway, against the stand-in engine's fault modes over real
HTTP: each limit (request, first token, stall) ends in 504 ``engine_timeout`` (or its SSE
event once a stream is open), frees the permit at once, closes the engine's connection and
reports ``timed_out`` to the runtime; a client that goes away -- waiting for a plain answer,
queued for admission, or mid-stream -- cancels the engine's work, frees the permit within a
second, and is counted and logged as 499."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.abc
import httpx
import openai
import pytest

from sbproxy.api.supervision import Limit, StreamDeadlines
from sbproxy.config import PriorityClass
from sbproxy.model_host.runtime.manager import RuntimeManager
from sbproxy.model_host.runtime.state import DeploymentState
from tests.api.support import ADMIN, TINY, Served, served
from tests.model_host.runtime.support import until

pytestmark = pytest.mark.anyio

Outcome = tuple[str, int, bool]


def tiny(**fields: Any) -> dict[str, dict[str, Any]]:
    """The ``tiny`` deployment with supervision fields set."""
    return {"tiny": {**TINY, **fields}}


def outcomes_of(manager: RuntimeManager) -> list[Outcome]:
    """Every ``record_outcome`` call from now on, as ``(deployment, generation, timed_out)``.

    The runtime's policy behind it is not the gateway's concern: the wrapper records the call
    and hands it on unchanged.
    """
    seen: list[Outcome] = []
    original = manager.record_outcome

    def recorded(deployment: str, generation: int, *, timed_out: bool) -> None:
        seen.append((deployment, generation, timed_out))
        original(deployment, generation, timed_out=timed_out)

    manager.record_outcome = recorded  # type: ignore[method-assign]
    return seen


async def warm(host: Served) -> int:
    """Start the engine (outside the gateway, so no outcome is reported); its generation."""
    manager = host.host.manager
    slot = manager.deployment("tiny")
    manager.request_load("tiny")
    await until(lambda: slot.state == DeploymentState.READY)
    return slot.generation


def engine_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def closed_at_engine(path: Path) -> list[dict[str, Any]]:
    """The stand-in's ``closed`` records: the client side closed while it generated."""
    return [record for record in engine_log(path) if record.get("event") == "closed"]


async def active_in_status(host: Served) -> int:
    async with httpx.AsyncClient(base_url=host.admin_url, auth=ADMIN) as http:
        status = (await http.get("/admin/model-host/status")).json()
    (deployment,) = status["deployments"]
    active: int = deployment["active_requests"]
    return active


async def metrics(host: Served) -> str:
    async with httpx.AsyncClient(base_url=host.admin_url, auth=ADMIN) as http:
        return (await http.get("/metrics")).text


@contextmanager
def access_lines(caplog: pytest.LogCaptureFixture) -> Iterator[list[str]]:
    """The gateway's access log lines of the test so far, captured at DEBUG (successful
    answers included, as with ``SBPROXY_ACCESS_LOG=all``) inside the block (the list is
    filled in when the block ends)."""
    lines: list[str] = []
    with caplog.at_level(logging.DEBUG, logger="sbproxy.api.access"):
        yield lines
        lines.extend(r.getMessage() for r in caplog.records if r.name == "sbproxy.api.access")


def sse_data(lines: list[str]) -> list[str]:
    return [line[len("data:") :].strip() for line in lines if line.startswith("data:")]


async def open_request(host: Served, body: dict[str, Any]) -> anyio.abc.SocketStream:
    """A raw HTTP/1.1 request to the gateway, left waiting for its answer."""
    port = urlsplit(host.gateway_url).port
    assert port is not None
    stream = await anyio.connect_tcp("127.0.0.1", port)
    payload = json.dumps(body).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    await stream.send(head.encode() + payload)
    return stream


CHAT = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]}
STREAM = {**CHAT, "stream": True}


# -- the limits ------------------------------------------------------------------------------


async def test_a_hung_plain_request_gets_504_after_request_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = tmp_path / "engine.jsonl"
    deployments = tiny(request_timeout_ms=300)
    async with served(
        tmp_path, deployments=deployments, mode=f"hang_completions,requests_log={log}"
    ) as host:
        outcomes = outcomes_of(host.host.manager)
        generation = await warm(host)
        with access_lines(caplog) as lines:
            async with httpx.AsyncClient(base_url=host.gateway_url, timeout=30) as http:
                sent = time.monotonic()
                answer = await http.post("/v1/chat/completions", json=CHAT)
                elapsed = time.monotonic() - sent
            assert host.host.manager.deployment("tiny").gate.active == 0  # freed before the answer
            assert await active_in_status(host) == 0
            await until(lambda: len(closed_at_engine(log)) == 1, timeout_s=2)
    assert answer.status_code == 504
    error = answer.json()["error"]
    assert error["code"] == "engine_timeout"
    assert error["sbproxy_reason"] == "engine_timeout"
    assert error["type"] == "managed_model_error"
    assert error["retryable"] is False  # it would run as long again
    assert "'tiny'" in error["message"]
    assert "request_timeout_ms=300" in error["message"]
    assert "proxy.model_host.deployments.tiny.request_timeout_ms" in error["message"]
    assert "check the engine" in error["message"]
    assert 0.25 < elapsed < 2.5, elapsed
    assert outcomes == [("tiny", generation, True)]
    assert closed_at_engine(log)[0]["path"] == "/v1/chat/completions"
    (line,) = [line for line in lines if line.startswith("POST")]
    assert line.startswith("POST /v1/chat/completions 504 deployment=tiny ")
    assert line.endswith(" engine_timeout")


async def test_a_stream_without_a_first_event_gets_504_before_its_headers(
    tmp_path: Path,
) -> None:
    # llama-server sends a stream's headers with its first event: a stuck prompt is a plain
    # 504, not a stream.
    log = tmp_path / "engine.jsonl"
    deployments = tiny(first_token_timeout_ms=300, request_timeout_ms=20_000)
    async with served(
        tmp_path, deployments=deployments, mode=f"hang_completions,requests_log={log}"
    ) as host:
        outcomes = outcomes_of(host.host.manager)
        generation = await warm(host)
        async with httpx.AsyncClient(base_url=host.gateway_url, timeout=30) as http:
            answer = await http.post("/v1/chat/completions", json=STREAM)
        assert host.host.manager.deployment("tiny").gate.active == 0
        await until(lambda: len(closed_at_engine(log)) == 1, timeout_s=2)
    assert answer.status_code == 504
    error = answer.json()["error"]
    assert error["code"] == "engine_timeout"
    assert "first_token_timeout_ms=300" in error["message"]
    assert "proxy.model_host.deployments.tiny.first_token_timeout_ms" in error["message"]
    assert error["retryable"] is True
    assert int(answer.headers["retry-after"]) >= 1
    assert outcomes == [("tiny", generation, True)]


async def stream_lines(host: Served) -> tuple[int, list[str], float]:
    """Status, SSE ``data:`` payloads and seconds taken of one streamed chat request."""
    async with httpx.AsyncClient(base_url=host.gateway_url, timeout=30) as http:
        sent = time.monotonic()
        async with http.stream("POST", "/v1/chat/completions", json=STREAM) as response:
            lines = [line async for line in response.aiter_lines()]
        return response.status_code, sse_data(lines), time.monotonic() - sent


def timeout_event(payload: str) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(payload)["error"]
    assert error["code"] == "engine_timeout"
    assert error["sbproxy_reason"] == "engine_timeout"
    assert error["type"] == "managed_model_error"
    return error


@pytest.mark.parametrize(
    ("mode", "fields", "limit", "relayed"),
    [
        # headers at once, then no first event
        ("first_token_delay_s=30", {"first_token_timeout_ms": 300}, "first_token_timeout_ms", 0),
        # two events, then silence on an open connection
        ("stall_after_events=2", {"stall_timeout_ms": 300}, "stall_timeout_ms", 2),
        # events keep coming, every 0.2 s, but the whole stream takes too long
        (
            "token_delay_s=0.2",
            {"request_timeout_ms": 500, "stall_timeout_ms": 5000},
            "request_timeout_ms",
            None,
        ),
    ],
)
async def test_an_open_stream_that_runs_out_of_a_limit_ends_with_an_error_event(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    mode: str,
    fields: dict[str, int],
    limit: str,
    relayed: int | None,
) -> None:
    log = tmp_path / "engine.jsonl"
    async with served(
        tmp_path, deployments=tiny(**fields), mode=f"{mode},requests_log={log}"
    ) as host:
        outcomes = outcomes_of(host.host.manager)
        generation = await warm(host)
        with access_lines(caplog) as lines:
            status, events, elapsed = await stream_lines(host)
            assert host.host.manager.deployment("tiny").gate.active == 0
            await until(lambda: len(closed_at_engine(log)) == 1, timeout_s=2)
    assert status == 200  # the headers went out before the limit ran out
    *content, last = events
    error = timeout_event(last)
    assert f"{limit}={fields[limit]}" in error["message"]
    assert f"proxy.model_host.deployments.tiny.{limit}" in error["message"]
    assert "[DONE]" not in events
    if relayed is not None:
        assert len(content) == relayed
    else:
        assert 1 <= len(content) < 5  # some of the five events, not all
    assert all(json.loads(event)["model"] == "tiny-chat" for event in content)
    assert elapsed < 3, elapsed
    assert outcomes == [("tiny", generation, True)]
    (line,) = [line for line in lines if line.startswith("POST")]
    assert line.startswith("POST /v1/chat/completions 200 deployment=tiny ")
    assert line.endswith(" engine_timeout")


async def test_answers_within_the_limits_report_no_timeout_once_each(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A slow but steady stream (0.15 s per event) stays under a 1 s stall limit (400 ms was
    # seen to run out when the suite's parallel workers stalled this process for a moment).
    deployments = tiny(stall_timeout_ms=1000, first_token_timeout_ms=2000)
    async with served(tmp_path, deployments=deployments, mode="token_delay_s=0.15") as host:
        outcomes = outcomes_of(host.host.manager)
        generation = await warm(host)
        with access_lines(caplog) as lines:
            async with httpx.AsyncClient(base_url=host.gateway_url, timeout=30) as http:
                plain = await http.post("/v1/chat/completions", json=CHAT)
            status, events, _ = await stream_lines(host)
    assert plain.status_code == 200
    assert status == 200
    assert events[-1] == "[DONE]"
    assert outcomes == [("tiny", generation, False), ("tiny", generation, False)]
    posts = [line for line in lines if line.startswith("POST")]
    assert len(posts) == 2
    assert all(line.startswith("POST /v1/chat/completions 200 deployment=tiny ") for line in posts)
    assert all(line.endswith("ms") for line in posts)  # no abnormal outcome named


# -- clients that go away ------------------------------------------------------------------


async def test_a_plain_request_whose_client_leaves_cancels_the_engine_and_frees_the_permit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = tmp_path / "engine.jsonl"
    async with served(tmp_path, mode=f"reply_delay_s=60,requests_log={log}") as host:
        outcomes = outcomes_of(host.host.manager)
        generation = await warm(host)
        gate = host.host.manager.deployment("tiny").gate
        with access_lines(caplog) as lines:
            client = await open_request(host, CHAT)
            await until(lambda: gate.active == 1 and len(engine_log(log)) == 1, timeout_s=5)
            await client.aclose()
            left = time.monotonic()
            await until(lambda: gate.active == 0, timeout_s=1)
            freed_s = time.monotonic() - left
            await until(lambda: len(closed_at_engine(log)) == 1, timeout_s=1)
            seen_s = time.monotonic() - left
            assert await active_in_status(host) == 0
            text = await metrics(host)
            await until(lambda: any(" 499 " in r.getMessage() for r in caplog.records))
    assert freed_s < 1, freed_s
    assert seen_s < 1, seen_s
    (closed,) = closed_at_engine(log)
    assert closed["after_s"] < 55  # long before the stand-in would have answered
    assert outcomes == [("tiny", generation, False)]  # not the engine's fault
    assert 'sbproxy_gateway_client_disconnects_total{deployment="tiny"} 1.0' in text
    (line,) = [line for line in lines if line.startswith("POST")]
    assert line.startswith("POST /v1/chat/completions 499 deployment=tiny ")
    assert line.endswith(" client_disconnected")


async def test_a_queued_request_whose_client_leaves_leaves_the_queue(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    deployments = tiny(max_concurrency=1, max_queue_depth=4)
    async with served(tmp_path, deployments=deployments) as host:
        manager = host.host.manager
        outcomes = outcomes_of(manager)
        await warm(host)
        gate = manager.deployment("tiny").gate
        held = await manager.acquire("tiny", priority=PriorityClass.STANDARD)
        with access_lines(caplog) as lines:
            client = await open_request(host, CHAT)
            await until(lambda: gate.queued == 1, timeout_s=5)
            await client.aclose()
            await until(lambda: gate.queued == 0, timeout_s=1)
            assert gate.active == 1  # still only the held permit: nothing was admitted
            held.release()
            assert gate.active == 0
            text = await metrics(host)
            await until(lambda: any(" 499 " in r.getMessage() for r in caplog.records))
    assert outcomes == []  # never admitted, so nothing to report
    assert 'sbproxy_gateway_client_disconnects_total{deployment="tiny"} 1.0' in text
    (line,) = [line for line in lines if line.startswith("POST")]
    assert line.startswith("POST /v1/chat/completions 499 deployment=tiny ")


async def test_an_abandoned_stream_is_counted_and_logged_as_499(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = tmp_path / "engine.jsonl"
    async with served(tmp_path, mode=f"token_delay_s=1.0,requests_log={log}") as host:
        outcomes = outcomes_of(host.host.manager)
        generation = await warm(host)
        gate = host.host.manager.deployment("tiny").gate
        with access_lines(caplog) as lines:
            async with (
                httpx.AsyncClient(base_url=host.gateway_url, timeout=30) as http,
                http.stream("POST", "/v1/chat/completions", json=STREAM) as response,
            ):
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        break
            await until(lambda: gate.active == 0, timeout_s=1)
            await until(lambda: len(closed_at_engine(log)) == 1, timeout_s=2)
            text = await metrics(host)
            await until(lambda: any(" 499 " in r.getMessage() for r in caplog.records))
    assert outcomes == [("tiny", generation, False)]
    assert 'sbproxy_gateway_client_disconnects_total{deployment="tiny"} 1.0' in text
    (line,) = [line for line in lines if line.startswith("POST")]
    assert line.startswith("POST /v1/chat/completions 499 deployment=tiny ")
    assert line.endswith(" client_disconnected")


async def openai_stream(host: Served, *, stop_at_usage: bool) -> list[Any]:
    """The chunks the ``openai`` client reads of a streamed chat with ``include_usage``:
    all of them (it stops at ``[DONE]`` and closes the connection), or up to the usage chunk,
    after which the caller closes the stream (the chunk every client needs is there)."""
    async with openai.AsyncOpenAI(
        base_url=f"{host.gateway_url}/v1", api_key="x", max_retries=0
    ) as client:
        stream = await client.chat.completions.create(
            model="tiny-chat",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            if stop_at_usage and chunk.usage is not None:
                break
        await stream.close()
    return chunks


@pytest.mark.parametrize(
    ("mode", "stop_at_usage"),
    [
        # The engine's body ends long after [DONE]: the client has closed by then.
        ("end_delay_s=30", False),
        # [DONE] comes long after the usage chunk, and the client closes at the usage chunk.
        ("done_delay_s=30", True),
    ],
)
async def test_a_stream_read_to_its_end_is_no_disconnect(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: str, stop_at_usage: bool
) -> None:
    log = tmp_path / "engine.jsonl"
    async with served(tmp_path, mode=f"{mode},requests_log={log}") as host:
        outcomes = outcomes_of(host.host.manager)
        generation = await warm(host)
        gate = host.host.manager.deployment("tiny").gate
        with access_lines(caplog) as lines:
            started = time.monotonic()
            chunks = await openai_stream(host, stop_at_usage=stop_at_usage)
            await until(lambda: gate.active == 0, timeout_s=2)
            elapsed = time.monotonic() - started
            # The engine's connection is closed (not waited on for 30 s).
            await until(lambda: len(closed_at_engine(log)) == 1, timeout_s=2)
            await until(lambda: any(line.startswith("POST") for line in lines_now(caplog)))
            text = await metrics(host)
        records = host.gateway.activity.recent()
    assert elapsed < 10, elapsed
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        "fake reply from the stand-in"
    )
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5
    assert outcomes == [("tiny", generation, False)]
    assert "sbproxy_gateway_client_disconnects_total{" not in text
    (line,) = [line for line in lines if line.startswith("POST")]
    assert line.startswith("POST /v1/chat/completions 200 deployment=tiny "), line
    assert "client_disconnected" not in line
    (record,) = records
    assert (record.status, record.outcome, record.completion_tokens) == (200, None, 5)


def lines_now(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "sbproxy.api.access"]


async def test_a_refusal_is_logged_with_its_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    deployments = tiny(max_concurrency=1, max_queue_depth=1, queue_timeout_ms=300)
    async with served(tmp_path, deployments=deployments) as host:
        manager = host.host.manager
        await warm(host)
        held = await manager.acquire("tiny", priority=PriorityClass.STANDARD)
        with access_lines(caplog) as lines:
            async with httpx.AsyncClient(base_url=host.gateway_url, timeout=30) as http:
                refused = await http.post("/v1/chat/completions", json=CHAT)
        held.release()
    assert refused.status_code == 503
    (line,) = [line for line in lines if line.startswith("POST")]
    assert line.startswith("POST /v1/chat/completions 503 deployment=tiny ")
    assert line.endswith(" queue_timeout")


async def test_a_bad_body_and_an_unknown_model_are_logged_with_their_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with served(tmp_path, deployments=tiny()) as host:
        with access_lines(caplog) as lines:
            async with httpx.AsyncClient(base_url=host.gateway_url, timeout=30) as http:
                malformed = await http.post(
                    "/v1/chat/completions",
                    content=b"{not json",
                    headers={"content-type": "application/json"},
                )
                unknown = await http.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
    codes = [answer.json()["error"]["code"] for answer in (malformed, unknown)]
    logged = [line for line in lines if line.startswith("POST")]
    assert len(logged) == 2, logged
    for answer, code, line in zip((malformed, unknown), codes, logged, strict=True):
        assert f" {answer.status_code} " in line and line.endswith(f" {code}"), (line, code)


async def test_by_default_only_requests_that_did_not_end_in_an_answer_are_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    deployments = tiny(max_concurrency=1, max_queue_depth=1, queue_timeout_ms=300)
    async with served(tmp_path, deployments=deployments) as host:
        manager = host.host.manager
        await warm(host)
        with caplog.at_level(logging.INFO, logger="sbproxy.api.access"):
            async with httpx.AsyncClient(base_url=host.gateway_url, timeout=30) as http:
                answered = await http.post("/v1/chat/completions", json=CHAT)
                held = await manager.acquire("tiny", priority=PriorityClass.STANDARD)
                refused = await http.post("/v1/chat/completions", json=CHAT)
                held.release()
    assert (answered.status_code, refused.status_code) == (200, 503)
    logged = [r.getMessage() for r in caplog.records if r.name == "sbproxy.api.access"]
    assert len(logged) == 1
    assert logged[0].startswith("POST /v1/chat/completions 503 ")


# -- the stream timer ------------------------------------------------------------------------


async def test_stream_deadlines_do_not_count_a_pause_as_a_stall() -> None:
    expired: list[tuple[Limit, float]] = []
    started = anyio.current_time()
    deadlines = StreamDeadlines(
        started=started,
        request_s=0.4,
        first_token_s=0.05,
        stall_s=0.05,
        on_expire=lambda limit: expired.append((limit, anyio.current_time() - started)),
    )
    deadlines.paused()  # handing an event to a slow client, past the first-token limit
    await until(lambda: bool(expired), timeout_s=2)
    deadlines.cancel()
    ((limit, after_s),) = expired
    assert limit == Limit.REQUEST
    assert after_s >= 0.4


async def test_stream_deadlines_name_the_limit_that_ran_out() -> None:
    expired: list[Limit] = []

    def deadlines(**limits: float) -> StreamDeadlines:
        return StreamDeadlines(
            started=anyio.current_time(),
            on_expire=expired.append,
            **{"request_s": 5.0, "first_token_s": 5.0, "stall_s": 5.0, **limits},
        )

    first = deadlines(first_token_s=0.05)
    await until(lambda: expired == [Limit.FIRST_TOKEN], timeout_s=2)
    stall = deadlines(stall_s=0.05)
    stall.paused()
    stall.waiting()  # an event came: the stall limit applies from now
    await until(lambda: expired == [Limit.FIRST_TOKEN, Limit.STALL], timeout_s=2)
    total = deadlines(request_s=0.05, first_token_s=0.01)
    total.paused()
    await until(lambda: expired[-1:] == [Limit.REQUEST], timeout_s=2)
    for timer in (first, stall, total):
        timer.cancel()
    assert len(expired) == 3
