"""The shutdown guard and budget in process: raw ASGI apps that hang, driven directly.

The real-process behaviour (signals, uvicorn, engines) is in ``test_serve_shutdown.py``;
these cover the shapes each listener answers with and the budget arithmetic.
"""

from __future__ import annotations

import json
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import anyio
import pytest
from litestar.types import ASGIApp, Message, Receive, ReceiveMessage, Scope, Send

from sbproxy.api.errors import Surface
from sbproxy.api.shutdown import ENGINE_STOP_S, Shutdown

pytestmark = pytest.mark.anyio

SCOPE = cast("Scope", {"type": "http", "method": "GET", "path": "/", "headers": []})


async def _receive() -> ReceiveMessage:
    await anyio.sleep_forever()
    raise AssertionError("unreachable")


async def never_answers(scope: Scope, receive: Receive, send: Send) -> None:
    await anyio.sleep_forever()


async def stalls_a_stream(scope: Scope, receive: Receive, send: Send) -> None:
    headers = [(b"content-type", b"text/event-stream")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
    await anyio.sleep_forever()


async def answers(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok", "more_body": False})


@asynccontextmanager
async def enforced(deadline_s: float) -> AsyncIterator[Shutdown]:
    stop = Shutdown(deadline_s=deadline_s)
    async with anyio.create_task_group() as group:
        group.start_soon(stop.enforce)
        yield stop
        group.cancel_scope.cancel()


async def call(
    stop: Shutdown, app: ASGIApp, *, surface: Surface, signal_after: int = 0
) -> list[dict[str, Any]]:
    """Run one request through the guard; request the stop once ``signal_after`` messages
    were sent (0: before the call); the messages the guard passed on."""
    sent: list[dict[str, Any]] = []

    async def send(message: Message) -> None:
        sent.append(dict(message))
        if len(sent) == signal_after:
            stop.request(signal.SIGTERM)

    if signal_after == 0:
        stop.request(signal.SIGTERM)
    with anyio.fail_after(5):
        await stop.guard(app, surface=surface)(SCOPE, _receive, send)
    return sent


def headers_of(message: dict[str, Any]) -> dict[bytes, bytes]:
    return dict(message["headers"])


async def test_a_request_still_waiting_at_the_deadline_gets_a_gateway_503() -> None:
    async with enforced(0.05) as stop:
        start, body = await call(stop, never_answers, surface="gateway")
    assert start["status"] == 503
    headers = headers_of(start)
    assert headers[b"content-type"] == b"application/json"
    assert headers[b"connection"] == b"close"
    assert headers[b"retry-after"] == b"1"
    assert int(headers[b"content-length"]) == len(body["body"])
    error = json.loads(body["body"])["error"]
    assert (error["code"], error["type"], error["retryable"]) == (
        "shutting_down",
        "managed_model_error",
        True,
    )
    assert body["more_body"] is False


async def test_the_admin_listener_answers_in_its_own_error_shape() -> None:
    async with enforced(0.05) as stop:
        start, body = await call(stop, never_answers, surface="admin")
    assert start["status"] == 503
    document = json.loads(body["body"])
    assert document["code"] == "shutting_down"
    assert "drain deadline" in document["error"]


@pytest.mark.parametrize(
    ("surface", "code_of"),
    [
        ("gateway", lambda event: event["error"]["code"]),
        ("admin", lambda event: event["type"] == "error" and event["code"]),
    ],
)
async def test_a_stalled_stream_gets_a_last_error_event_and_a_proper_end(
    surface: Surface, code_of: Any
) -> None:
    async with enforced(0.05) as stop:
        sent = await call(stop, stalls_a_stream, surface=surface, signal_after=2)
    assert [m["type"] for m in sent] == [
        "http.response.start",
        "http.response.body",
        "http.response.body",
    ]
    last = sent[-1]
    assert last["more_body"] is False
    frame = last["body"]
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert code_of(json.loads(frame[6:])) == "shutting_down"


async def test_a_request_that_finishes_in_time_is_left_alone() -> None:
    async with enforced(5.0) as stop:
        sent = await call(stop, answers, surface="gateway")
        assert not stop.drain_over
    assert [m.get("status") for m in sent] == [200, None]
    assert sent[-1]["body"] == b"ok"


async def test_a_request_after_the_deadline_is_refused_at_once() -> None:
    async with enforced(0.0) as stop:
        stop.request(signal.SIGTERM)
        with anyio.fail_after(5):
            while not stop.drain_over:
                await anyio.sleep(0.01)
        sent = await call(stop, answers, surface="gateway", signal_after=-1)
    assert sent[0]["status"] == 503


async def test_the_engines_get_what_is_left_and_nothing_after_a_second_signal() -> None:
    stop = Shutdown(deadline_s=30.0)
    assert stop.engine_budget_s() is None  # no signal: the configured deadline applies
    stop.request(signal.SIGINT)
    budget = stop.engine_budget_s()
    assert budget is not None
    assert 30.0 < budget <= 30.0 + ENGINE_STOP_S
    assert stop.deadline is not None
    first_deadline = stop.deadline
    stop.request(signal.SIGINT)
    assert stop.forced
    assert stop.engine_budget_s() == 0.0
    assert stop.deadline < first_deadline
    stop.request(signal.SIGINT)  # a third one changes nothing
    assert stop.engine_budget_s() == 0.0
