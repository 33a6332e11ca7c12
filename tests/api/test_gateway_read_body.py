"""The gateway's body read (``read_body``): the errors Litestar's ``Request.body()`` raises,
so a request gets the same answer (413, 400) as before the read was made lighter."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from litestar.exceptions import ClientException, InternalServerException
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.types import HTTPDisconnectEvent, HTTPRequestEvent, Receive

from sbproxy.api.gateway import read_body

pytestmark = pytest.mark.anyio


def channel(events: Iterable[HTTPRequestEvent | HTTPDisconnectEvent]) -> Receive:
    pending = list(events)

    async def receive() -> HTTPRequestEvent | HTTPDisconnectEvent:
        return pending.pop(0)

    return receive


def part(body: bytes, *, more: bool) -> HTTPRequestEvent:
    return {"type": "http.request", "body": body, "more_body": more}


async def test_a_body_in_parts_is_joined() -> None:
    receive = channel([part(b'{"a":', more=True), part(b"", more=True), part(b"1}", more=False)])
    assert await read_body(receive, b"7") == b'{"a":1}'


async def test_a_body_over_the_limit_is_413_when_announced_before_reading() -> None:
    receive = channel([])  # nothing is read
    with pytest.raises(RequestEntityTooLarge):
        await read_body(receive, b"11", limit=10)


async def test_a_body_over_the_limit_is_413_when_received() -> None:
    receive = channel([part(b"x" * 6, more=True), part(b"x" * 6, more=False)])
    with pytest.raises(RequestEntityTooLarge):
        await read_body(receive, None, limit=10)


async def test_a_content_length_that_is_no_number_is_400() -> None:
    with pytest.raises(ClientException, match="Invalid content-length"):
        await read_body(channel([]), b"ten")


async def test_a_client_that_leaves_mid_body_is_reported() -> None:
    receive = channel([part(b"{", more=True), {"type": "http.disconnect"}])
    with pytest.raises(InternalServerException, match="disconnected"):
        await read_body(receive, None)
