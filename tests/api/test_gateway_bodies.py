"""What the gateway checks and completes before a body reaches the engine: bad OpenAI
bodies are 400s that are never forwarded, a request without a length limit gets the
deployment's ``max_output_tokens`` (never above the context), a chat to a completion-only
model is ``chat_not_supported``, and streams keep their bytes and say not to buffer them.
Real HTTP, the real stand-in engine with its request log."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from sbproxy.model_host.runtime.state import DeploymentState
from tests.api.support import TINY, served
from tests.model_host.runtime.support import until

pytestmark = pytest.mark.anyio

HI = [{"role": "user", "content": "hi"}]


def forwarded(log: Path) -> list[dict[str, Any]]:
    """The bodies the engine received."""
    if not log.exists():
        return []
    return [json.loads(line)["body"] for line in log.read_text().splitlines() if '"body"' in line]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/chat/completions", {"messages": "x"}, "messages"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {}, "messages"),
        ("/v1/chat/completions", {"messages": ["hi"]}, "messages[0]"),
        ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [{"role": "robot"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"messages": HI, "max_tokens": "5"}, "max_tokens"),
        ("/v1/completions", {}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "n_predict": -1}, "n_predict"),
        ("/v1/embeddings", {"input": {}}, "input"),
    ],
)
async def test_a_bad_body_is_a_400_and_never_reaches_the_engine(
    tmp_path: Path, path: str, body: dict[str, Any], field: str
) -> None:
    log = tmp_path / "requests.jsonl"
    async with (
        served(tmp_path, mode=f"requests_log={log}") as host,
        httpx.AsyncClient(base_url=host.gateway_url, timeout=30) as http,
    ):
        refused = await http.post(path, json={"model": "tiny-chat", **body})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["code"], error["type"]) == ("invalid_request", "invalid_request_error")
    assert f"`{field}`" in error["message"]
    assert forwarded(log) == []


CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
CHAT_HI = b'"messages": [{"role": "user", "content": "hi"}]'

# Bodies outside testers sent (issue 22): each was a 500 with a traceback, reached the engine
# or was refused under the wrong code. Raw bytes: several are not what json.dumps writes.
MALFORMED: list[tuple[str, bytes, str, str]] = [
    (
        CHAT,
        b"{" + CHAT_HI + b', "max_tokens": ' + b"7" * 5001 + b"}",
        "invalid_request",
        "`max_tokens` must be a positive integer below 2^31, got a 5001-digit number",
    ),
    (CHAT, b"{" + CHAT_HI + b', "temperature": 1e999}', "invalid_request", "`temperature`"),
    (COMPLETIONS, b'{"prompt": "hi", "seed": -' + b"7" * 4400 + b"}", "invalid_request", "`seed`"),
    (
        CHAT,
        b'{"messages": [{"role": [], "content": "hi"}]}',
        "invalid_request",
        "`messages[0].role`",
    ),
    (CHAT, b'{"messages": [{"role": {"a": 1}}]}', "invalid_request", "`messages[0].role`"),
    (CHAT, b"{" + CHAT_HI + b', "deployment": "dep\xbe"}', "invalid_body", "`deployment`"),
    (COMPLETIONS, b'{"prompt": "hi", "user": "\xed\xa0\x80"}', "invalid_body", "`user`"),
    (EMBEDDINGS, b'{"input": "hi", "user": "x\xff"}', "invalid_body", "`user`"),
    (EMBEDDINGS, b'{"input": "hi", "us\xc0\xafer": 1}', "invalid_body", "byte 0xc0 at offset 19"),
    (CHAT, b"{" + CHAT_HI + b', "max_tokens": true}', "invalid_request", "`max_tokens`"),
    (CHAT, b"{" + CHAT_HI + b', "max_tokens": 5.0}', "invalid_request", "`max_tokens`"),
    (CHAT, b"{" + CHAT_HI + b', "max_tokens": 2147483648}', "invalid_request", "`max_tokens`"),
    (CHAT, b"{" + CHAT_HI + b', "stream": "yes"}', "invalid_request", "`stream`"),
    (CHAT, b"{" + CHAT_HI + b', "stream_options": []}', "invalid_request", "`stream_options`"),
    (CHAT, b'{"model": 3, ' + CHAT_HI + b"}", "invalid_request", "`model`"),
    (COMPLETIONS, b'{"prompt": "hi", "user": "\\ud800"}', "invalid_body", "\\ud800 at offset 26"),
    (COMPLETIONS, b'[{"prompt": "hi"}]', "invalid_body", "must be a JSON object"),
    (COMPLETIONS, b'{"prompt": [null]}', "invalid_request", "`prompt[0]`"),
    (COMPLETIONS, b'{"prompt": [{"a": 1}]}', "invalid_request", "`prompt[0]`"),
    (COMPLETIONS, b'{"prompt": [[1, "a"]]}', "invalid_request", "`prompt[0][1]`"),
    (COMPLETIONS, b'{"prompt": [[1], []]}', "invalid_request", "`prompt[1]`"),
    (COMPLETIONS, b'{"prompt": [[1], 2]}', "invalid_request", "`prompt[1]`"),
    (COMPLETIONS, b'{"prompt": ["a", 1]}', "invalid_request", "`prompt[1]`"),
    (COMPLETIONS, b'{"prompt": [1, true]}', "invalid_request", "`prompt[1]`"),
    (COMPLETIONS, b'{"prompt": [true]}', "invalid_request", "`prompt[0]`"),
    (COMPLETIONS, b'{"prompt": [3, -1]}', "invalid_request", "`prompt[1]`"),
    (COMPLETIONS, b'{"prompt": [1.5]}', "invalid_request", "`prompt[0]`"),
    (COMPLETIONS, b'{"prompt": [2147483648]}', "invalid_request", "`prompt[0]`"),
    (EMBEDDINGS, b'{"input": []}', "invalid_request", "`input`"),
    (EMBEDDINGS, b'{"input": [null]}', "invalid_request", "`input[0]`"),
    (EMBEDDINGS, b'{"input": [[]]}', "invalid_request", "`input[0]`"),
    (EMBEDDINGS, b'{"input": [[1, "a"]]}', "invalid_request", "`input[0][1]`"),
    (EMBEDDINGS, b'{"input": ["a", ["b"]]}', "invalid_request", "`input[1]`"),
    (EMBEDDINGS, b'{"input": [[0, false]]}', "invalid_request", "`input[0][1]`"),
]


async def test_malformed_bodies_are_400s_naming_the_field_and_never_reach_the_engine(
    tmp_path: Path,
) -> None:
    log = tmp_path / "requests.jsonl"
    seen: list[tuple[int, str | None, str]] = []
    async with (
        served(tmp_path, mode=f"requests_log={log}") as host,
        httpx.AsyncClient(base_url=host.gateway_url, timeout=30) as http,
    ):
        for path, body, _, _ in MALFORMED:
            refused = await http.post(
                path, content=body, headers={"Content-Type": "application/json"}
            )
            error = refused.json().get("error") or {}  # a forwarded body gets an answer
            seen.append((refused.status_code, error.get("code"), str(error.get("message"))))
    wrong = [
        (body[:60], status, got_code, message)
        for (_, body, code, named), (status, got_code, message) in zip(MALFORMED, seen, strict=True)
        if (status, got_code) != (400, code) or named not in message
    ]
    assert wrong == []
    assert forwarded(log) == []


async def test_prompt_and_input_of_every_documented_shape_are_forwarded(tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    shapes: list[Any] = ["hi", ["hi", ""], [0, 2147483647], [[1, 2], [3]]]
    async with (
        served(tmp_path, mode=f"requests_log={log}") as host,
        httpx.AsyncClient(base_url=host.gateway_url, timeout=30) as http,
    ):
        answers = [
            await http.post(path, json={field: shape, "max_tokens": None, "stream": None})
            for path, field in ((COMPLETIONS, "prompt"), (EMBEDDINGS, "input"))
            for shape in shapes
        ]
    assert [answer.status_code for answer in answers] == [200] * 8
    bodies = forwarded(log)
    assert [body.get("prompt", body.get("input")) for body in bodies] == shapes * 2
    # null is no limit: a completion still gets the deployment's default
    assert [body["max_tokens"] for body in bodies[:4]] == [512] * 4


async def test_a_request_without_a_limit_gets_max_output_tokens_and_one_with_keeps_its_bytes(
    tmp_path: Path,
) -> None:
    log = tmp_path / "requests.jsonl"
    deployment = {"tiny": {**TINY, "max_output_tokens": 7}}
    async with (
        served(tmp_path, deployments=deployment, mode=f"requests_log={log}") as host,
        httpx.AsyncClient(base_url=host.gateway_url, timeout=30) as http,
    ):
        plain = await http.post("/v1/chat/completions", json={"messages": HI})
        own = b'{"messages": [{"role": "user", "content": "hi"}],  "max_tokens": 3}'
        limited = await http.post(
            "/v1/completions",
            content=b'{"prompt": "hi",  "max_tokens": 3}',
            headers={"Content-Type": "application/json"},
        )
        chat_limited = await http.post(
            "/v1/chat/completions", content=own, headers={"Content-Type": "application/json"}
        )
    assert (plain.status_code, limited.status_code, chat_limited.status_code) == (200, 200, 200)
    bodies = forwarded(log)
    assert bodies[0]["max_tokens"] == 7
    assert bodies[1] == {"prompt": "hi", "max_tokens": 3}
    assert bodies[2]["max_tokens"] == 3


async def test_max_output_tokens_never_exceeds_the_context(tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    deployment = {"tiny": {**TINY, "max_output_tokens": 100_000}}  # the catalog says 4096
    async with (
        served(tmp_path, deployments=deployment, mode=f"requests_log={log}") as host,
        httpx.AsyncClient(base_url=host.gateway_url, timeout=30) as http,
    ):
        answered = await http.post("/v1/completions", json={"prompt": "hi"})
    assert answered.status_code == 200
    assert forwarded(log)[0]["max_tokens"] == 4096


async def test_a_chat_to_a_completion_only_model_is_chat_not_supported(tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    base = {"tiny": {**TINY, "model": "tiny-base"}}
    async with served(tmp_path, deployments=base, mode=f"requests_log={log}") as host:
        async with httpx.AsyncClient(base_url=host.gateway_url, timeout=30) as http:
            chat = await http.post("/v1/chat/completions", json={"messages": HI})
            completion = await http.post("/v1/completions", json={"prompt": "Once upon"})
        assert chat.status_code == 400
        error = chat.json()["error"]
        assert error["code"] == "chat_not_supported"
        assert "/v1/completions" in error["message"]
        assert completion.status_code == 200
        assert [body.get("prompt") for body in forwarded(log)] == ["Once upon"]
        await until(lambda: host.host.manager.deployment("tiny").state == DeploymentState.READY)


async def test_streams_keep_their_event_framing_and_are_not_buffered(tmp_path: Path) -> None:
    async with (
        served(tmp_path) as host,
        httpx.AsyncClient(base_url=host.gateway_url, timeout=30) as http,
        http.stream(
            "POST", "/v1/completions", json={"prompt": "hi", "stream": True, "max_tokens": 3}
        ) as response,
    ):
        raw = b"".join([chunk async for chunk in response.aiter_raw()])
    assert response.headers["x-accel-buffering"] == "no"
    assert response.headers["content-type"].startswith("text/event-stream")
    events = raw.split(b"\n\n")
    assert events[-1] == b""
    assert all(event.startswith(b"data: ") for event in events[:-1])


def test_event_framing_and_bytes_pass_through_with_only_the_model_renamed() -> None:
    from sbproxy.api.relay import rewrite_event, split_events

    crlf = (
        b'data: {"id":"a", "model" : "x.gguf","choices":[]}\r\n\r\ndata: [DONE]\r\n\r\ndata: {"part'
    )
    events, rest = split_events(crlf)
    assert [separator for _, separator in events] == [b"\r\n\r\n", b"\r\n\r\n"]
    assert rest == b'data: {"part'
    first, _ = events[0]
    assert rewrite_event(first, "public") == b'data: {"id":"a", "model" : "public","choices":[]}'
    assert rewrite_event(events[1][0], "public") == b"data: [DONE]"
    lf, rest = split_events(b"data: 1\n\ndata: 2\r\rdata: 3")
    assert lf == [(b"data: 1", b"\n\n"), (b"data: 2", b"\r\r")]
    assert rest == b"data: 3"
