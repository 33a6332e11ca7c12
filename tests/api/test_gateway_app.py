"""The inference routes served as raw ASGI in front of Litestar (``GatewayApp``, issue 31)
answer exactly as the Litestar routes of the same paths do: the same statuses, error
envelopes and answer headers, through real uvicorn listeners and the stand-in engine."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from sbproxy.config import PriorityClass
from tests.api.support import served

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
# Litestar routes a path with a trailing slash to the same handler: those requests take the
# Litestar route, which ends in the same Gateway.forward.
THROUGH_LITESTAR = CHAT + "/"

BODIES: list[tuple[str, bytes]] = [
    ("ok", b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":3}'),
    ("no max_tokens", b'{"messages":[{"role":"user","content":"hi"}]}'),
    ("unknown model", b'{"model":"nope","messages":[{"role":"user","content":"hi"}]}'),
    ("not json", b"{not json"),
    ("not an object", b"[1,2]"),
    ("bad role", b'{"messages":[{"role":"wizard","content":"hi"}]}'),
    ("model not a string", b'{"model":3,"messages":[]}'),
    ("bad max_tokens", b'{"messages":[{"role":"user","content":"x"}],"max_tokens":true}'),
    ("empty", b""),
]


def _comparable(response: httpx.Response) -> tuple[int, dict[str, str], object]:
    body: object = response.json() if response.content else None
    if isinstance(body, dict):
        body.pop("id", None)
        body.pop("created", None)
    headers = {
        name: value
        for name, value in response.headers.items()
        if name in ("content-type", "retry-after", "x-sbproxy-logical-model")
        or name.startswith("x-sbproxy-route")
    }
    return response.status_code, headers, body


async def test_the_raw_route_answers_as_the_litestar_route_does(tmp_path: Path) -> None:
    async with served(tmp_path) as host, httpx.AsyncClient(base_url=host.gateway_url) as http:
        upstream = await host.host.manager.acquire("tiny", priority=PriorityClass.STANDARD)
        upstream.release()  # warm: both routes meet a ready engine
        for name, body in BODIES:
            headers = {"content-type": "application/json"}
            raw = await http.post(CHAT, content=body, headers=headers)
            litestar = await http.post(THROUGH_LITESTAR, content=body, headers=headers)
            assert _comparable(raw) == _comparable(litestar), name
            assert raw.status_code < 500, name


async def test_other_methods_on_an_inference_path_are_litestars(tmp_path: Path) -> None:
    async with served(tmp_path) as host, httpx.AsyncClient(base_url=host.gateway_url) as http:
        wrong = await http.get(CHAT)
        assert wrong.status_code == 405
        assert wrong.json()["error"]["code"] == "method_not_allowed"
        models = await http.get("/v1/models")
        assert models.status_code == 200
