"""The gateway's aiohttp client (peer hops; this host's engines are reached through
:mod:`sbproxy.api.engine_http`, on the same rules): one pooled session, and a POST that
survives a kept-alive connection the engine closed.

An engine closes a kept-alive connection that stays idle for a few seconds: llama-server
(cpp-httplib's ``CPPHTTPLIB_KEEPALIVE_TIMEOUT_SECOND``) and vLLM (uvicorn's
``timeout_keep_alive``) both after 5 s. aiohttp keeps an idle connection 15 s by default,
so a request could be written onto a connection the engine had just closed: the engine's
kernel answers with a reset, and the request failed with ``ClientOSError`` or
``ServerDisconnectedError`` (a 502 ``upstream_unavailable`` at the client) although the
engine was healthy. Two measures, as HTTP clients commonly take them:

* the pool drops a connection after :data:`KEEPALIVE_S` idle, below the engines' idle
  close, so it does not hand out one the engine is about to close;
* :func:`post` sends a request once more when it failed on an established connection
  before any answer arrived -- the failure a stale kept-alive connection gives. aiohttp does
  the same by itself for idempotent methods only (RFC 9112, 9.3.1); an engine's completion
  changes nothing in the engine but compute, and a connection that was reset before an
  answer was not served, so it is sent again too. A connection that cannot be opened
  (``ClientConnectorError``: the engine is gone) is not retried.

A peer host's gateway is not sent a request twice (``resend=False``): it may have passed the
request to its engine before the connection failed, and a second send would run one
generation twice; only a failure in :data:`NOT_SENT` (no connection opened) is known to have
sent nothing (:mod:`sbproxy.api.peers` tries another peer after those only).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Final

import aiohttp
from yarl import URL

__all__ = [
    "ENGINE_IDLE_CLOSE_S",
    "KEEPALIVE_S",
    "NOT_SENT",
    "EngineNotReached",
    "engine_session",
    "post",
]

logger = logging.getLogger(__name__)

# How long llama-server and vLLM keep an idle connection open, seconds (see above).
ENGINE_IDLE_CLOSE_S: Final = 5.0
# How long the gateway's pool keeps an idle connection to an engine, seconds: below the
# engines' idle close, with margin for a request on its way.
KEEPALIVE_S: Final = 4.0


class EngineNotReached(aiohttp.ClientConnectionError):
    """No connection to an engine of this host could be opened (refused, timed out): the
    request was provably not sent (raised by :mod:`sbproxy.api.engine_http`)."""


# The failures of a POST that provably sent none of the request: no connection could be
# opened (refused, unreachable, name not resolved, TLS refused) or none opened within the
# connect timeout. aiohttp's own retry rule draws the same line (it never retries these,
# and retries a failure on an open connection for idempotent methods only, never a POST).
NOT_SENT: Final = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError, EngineNotReached)


def engine_session() -> aiohttp.ClientSession:
    """A session for the gateway's requests to engines (create it on the serving loop):
    unbounded pool, connections kept :data:`KEEPALIVE_S` idle, no total timeout (the
    gateway's supervision limits bound each request), 10 s to connect, bodies passed on
    as the engine encoded them, every request a JSON body."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        auto_decompress=False,
        # As a default header it is not merged per request.
        headers={"Content-Type": "application/json"},
    )


async def post(
    session: aiohttp.ClientSession,
    url: URL,
    body: bytes,
    *,
    headers: Mapping[str, str] | None = None,
    resend: bool = True,
) -> aiohttp.ClientResponse:
    """POST ``body`` to ``url`` (with ``headers`` besides the session's); the response with
    its headers read. A peer host's gateway is reached the same way (its server closes an
    idle connection after 5 s too: uvicorn's ``timeout_keep_alive``), with ``resend=False``.

    With ``resend`` (an engine of this host), sent a second time, on another connection,
    when the first try failed on an established connection before the answer's headers (see
    the module docstring). Without it (a peer hop), sent once: such a failure may come from
    a peer that read the request and passed it to its engine before it failed, and a second
    send could run the generation twice (:data:`NOT_SENT` tells the failures that provably
    sent nothing).

    Raises:
        aiohttp.ClientError: the engine could not be reached, or the (last) try failed.
    """
    try:
        return await session.post(url, data=body, headers=headers)
    except NOT_SENT:
        raise
    except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
        if not resend:
            raise
        logger.info(
            "engine at %s closed the connection under a request; sending it again",
            url.authority,
        )
    try:
        return await session.post(url, data=body, headers=headers)
    except NOT_SENT as exc:
        # The first send may have reached the engine: this failure is not one that
        # provably sent nothing.
        raise aiohttp.ServerDisconnectedError(f"resend failed: {exc}") from exc
