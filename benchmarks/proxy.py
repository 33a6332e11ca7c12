"""What the gateway adds on the request path: direct to a fast upstream, through a bare
pass-through on the same libraries, and through sbproxy.

A fast upstream (a raw asyncio + httptools HTTP server, uvloop when installed, in its own
process) stands in for the engine: it answers ``POST /v1/chat/completions`` with a fixed
small JSON body, or, when the request has ``"stream": true``, with a few SSE chunks and
``data: [DONE]`` in one write; ``GET /health`` answers 200 at once. It is the deployment's
engine: a tiny executable ``llama-server`` wrapper (accepting llama-server's flags) runs this
file in ``upstream`` mode, and ``engines.llama_cpp.path`` points at the wrapper.

The real ``sbproxy serve -f sb.yml`` process then runs with one warm deployment
(``max_concurrency`` 64, ``max_queue_depth`` 256); once the admin status route says
``ready``, the engine's port is read from it, and the bare pass-through (this file in
``bare`` mode: uvicorn with uvloop and httptools, a raw ASGI app forwarding through one
aiohttp session, :func:`bare_app`) starts in front of the same engine, and beside it the
same app on the gateway's own engine client (``bare_pool``, :func:`bare_pool_app`: what is
left of sbproxy's cost once the client is alike). ``--rounds`` rounds each measure, for
every scenario and at 1 and 16 connections, the four contenders back to back in an order
that rotates by round:

* ``chat`` and ``chat_stream`` with ``wrk`` (one thread, ``--duration`` seconds each):
  p50/p99 of the whole response (for the stream: all chunks up to ``[DONE]``) and
  requests/s; an in-Python aiohttp load generator replaces wrk when it is not installed;
* with ``--ttfb``, ``chat_stream_ttfb``: an aiohttp load generator timing the first body
  chunk (the first SSE event) of streamed requests.

Prints ONE JSON object: every round's figures; per scenario and concurrency sbproxy's
requests/s and p99 over the bare's (and over ``bare_pool``'s) and the p50 each adds over
direct, their medians and
ranges; and issue 31's targets (at 16 connections >= 0.75x the bare's requests/s and <= 1.5x
its p99, plain and streamed; at 1 connection <= 0.3 ms added to the direct p50) with whether
they were met.

Usage: ``python benchmarks/proxy.py [--duration 5] [--rounds 3] [--ttfb]
[--loader auto|wrk|python]`` from the repository root with the project's virtual environment.

With ``--baseline-commit REV`` (repeatable) it compares this checkout's gateway with older
commits instead, in one run: each commit's ``sbproxy`` package is extracted (``git
archive``) into a temporary directory and served by the same interpreter and virtual
environment (``PYTHONPATH``), against the same upstream and configuration; ``--pairs``
rounds (default 5) each start every contender's server (all at once, each with its own
engine) and measure the gateway at 1 and 16 connections (``chat`` and ``chat_stream``),
each measurement taken of every contender back to back, in an order that rotates from
round to round: on a shared, noisy machine the contenders of one ratio are measured
seconds apart, under the same load, rather than a server's lifetime apart. It
prints ONE JSON object: every round's figures, and per baseline the per-round ratios of the
current figures over the baseline's with their median and range -- above 1 for requests/s
is faster, below 1 for p50 is faster -- and whether the median requests/s ratio at 16
connections reaches ``--min-ratio`` (default 0.99).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, cast

from baseline import ROOT, checkout, extract, spread

UPSTREAM_PROGRAM = Path(__file__).resolve()  # in the argv of the upstream engines
PASSWORD = "bench-password"  # noqa: S105 - a throwaway loopback admin
PUBLIC_MODEL = "bench-chat"
CHAT_BODY = {"model": PUBLIC_MODEL, "messages": [{"role": "user", "content": "hi"}]}
STREAM_BODY = {**CHAT_BODY, "stream": True}
CONCURRENCY = (1, 16)
# Issue 31's targets: sbproxy's requests/s at least 0.75x the bare pass-through's and its p99
# at most 1.5x, at 16 connections; at 1 connection at most 0.3 ms added to the direct p50.
TARGET_OVER_BARE_RPS = 0.75
TARGET_OVER_BARE_P99 = 1.5
TARGET_ADDED_P50_MS_AT_1 = 0.3

# --------------------------------------------------------------------------- the upstream

_COMPLETION = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "bench.gguf",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello there!"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
    },
    separators=(",", ":"),
).encode()


def _chunk(delta: dict[str, Any], finish: str | None = None, usage: bool = False) -> bytes:
    event: dict[str, Any] = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "bench.gguf",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if usage:
        event["usage"] = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    data = b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


_DONE = b"data: [DONE]\n\n"
_STREAM_BODY = (
    _chunk({"role": "assistant", "content": "Hello"})
    + _chunk({"content": " there"})
    + _chunk({"content": "!"})
    + _chunk({}, finish="stop", usage=True)
    + f"{len(_DONE):x}\r\n".encode()
    + _DONE
    + b"\r\n0\r\n\r\n"
)


def _response(status: str, content_type: bytes, body: bytes) -> bytes:
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: ".encode()
        + content_type
        + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


_CHAT_RESPONSE = _response("200 OK", b"application/json", _COMPLETION)
_STREAM_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n" + _STREAM_BODY
)
_HEALTH_RESPONSE = _response("200 OK", b"application/json", b'{"status":"ok"}')
_MODELS_RESPONSE = _response(
    "200 OK", b"application/json", b'{"object":"list","data":[{"id":"bench.gguf"}]}'
)
_NOT_FOUND = _response("404 Not Found", b"application/json", b'{"error":"not found"}')
_BAD_REQUEST = _response("400 Bad Request", b"application/json", b'{"error":"bad request"}')


class _Upstream(asyncio.Protocol):
    """HTTP/1.1 keep-alive, parsed with httptools; one canned answer per route."""

    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        import httptools

        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.write(_BAD_REQUEST)
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.transport is not None
        path = self.url.split(b"?", 1)[0]
        if path.endswith(b"/chat/completions") or path.endswith(b"/completions"):
            try:
                stream = bool(json.loads(b"".join(self.body) or b"{}").get("stream"))
            except ValueError:
                self.transport.write(_BAD_REQUEST)
                return
            self.transport.write(_STREAM_RESPONSE if stream else _CHAT_RESPONSE)
        elif path == b"/health":
            self.transport.write(_HEALTH_RESPONSE)
        elif path in (b"/v1/models", b"/models"):
            self.transport.write(_MODELS_RESPONSE)
        else:
            self.transport.write(_NOT_FOUND)
        if not self.parser.should_keep_alive():
            self.transport.close()


def run_upstream(argv: list[str]) -> None:
    """``llama-server``-compatible entry point: ``--version``, ``--host``, ``--port``."""
    parser = argparse.ArgumentParser(prog="llama-server", add_help=False)
    parser.add_argument("--version", action="store_true")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args, _ = parser.parse_known_args(argv)
    if args.version:
        sys.stdout.write("version: 9999 (bench upstream)\nbuilt for benchmarks/proxy.py\n")
        return
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - plain asyncio works too
        pass

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_Upstream, args.host, args.port, backlog=1024)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with server:
            await stop.wait()

    asyncio.run(serve())


# --------------------------------------------------------------------------- the bare pass-through


async def _lifespan(
    receive: Any, send: Any, startup: Callable[[], Any], shutdown: Callable[[], Awaitable[None]]
) -> None:
    """Serve ASGI's lifespan messages: ``startup()`` at start, ``await shutdown()`` at the end."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            startup()
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await shutdown()
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _request_body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _relay_answer(
    send: Any,
    status: int,
    media: str,
    *,
    stream: AsyncIterator[bytes] | None,
    whole: Callable[[], Awaitable[bytes]],
) -> None:
    """Send an upstream answer on: chunk by chunk from ``stream`` (an event stream), else
    ``await whole()`` with its length."""
    start = {
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", media.encode())],
    }
    if stream is not None:
        await send(start)
        async for chunk in stream:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    else:
        data = await whole()
        start["headers"].append((b"content-length", str(len(data)).encode()))
        await send(start)
        await send({"type": "http.response.body", "body": data})


def bare_app(upstream: str) -> Callable[..., Any]:
    """The least a Python pass-through on the gateway's libraries does: a raw ASGI app that
    reads the body, POSTs it to ``upstream`` through one pooled aiohttp session (as the
    gateway's :mod:`sbproxy.api.engine_client` does) and relays the answer -- whole, or
    chunk by chunk for an event stream -- with no auth, routing, admission, usage, spans or
    access log. The contender the gateway's overhead is measured against."""
    import aiohttp

    sessions: list[aiohttp.ClientSession] = []
    target = f"{upstream}/v1/chat/completions"

    def open_session() -> None:
        sessions.append(
            aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0),
                auto_decompress=False,
                headers={"Content-Type": "application/json"},
            )
        )

    async def close_session() -> None:
        for session in sessions:
            await session.close()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send, open_session, close_session)
            return
        body = await _request_body(receive)
        async with sessions[0].post(target, data=body) as response:
            streamed = response.content_type == "text/event-stream"
            await _relay_answer(
                send,
                response.status,
                response.headers.get("Content-Type", "application/json"),
                stream=response.content.iter_any() if streamed else None,
                whole=response.read,
            )

    return app


def bare_pool_app(upstream: str) -> Callable[..., Any]:
    """:func:`bare_app` with the gateway's own engine client (:class:`EnginePool`: asyncio
    protocols and httptools) in place of aiohttp: the least a pass-through does on the very
    client sbproxy uses for this hop, so that ``proxy_over_bare_pool`` is what sbproxy's own
    contracts (auth, admission, usage, spans, access log, body checks) cost."""
    from urllib.parse import urlsplit

    from sbproxy.api.engine_http import EnginePool, EngineResponse

    pools: list[EnginePool] = []
    parts = urlsplit(upstream)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80

    async def close_pool() -> None:
        for pool in pools:
            await pool.close()

    async def chunks(response: EngineResponse) -> AsyncIterator[bytes]:
        while chunk := await response.content.readany():
            yield chunk

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send, lambda: pools.append(EnginePool()), close_pool)
            return
        body = await _request_body(receive)
        response = await pools[0].post(host, port, "/v1/chat/completions", body)
        try:
            streamed = response.content_type == "text/event-stream"
            await _relay_answer(
                send,
                response.status,
                response.headers.get("content-type", "application/json"),
                stream=chunks(response) if streamed else None,
                whole=response.read,
            )
        finally:
            response.release()

    return app


def run_bare(argv: list[str]) -> None:
    """``bare --port P --upstream URL``: the bare pass-through under uvicorn, with uvloop and
    httptools as ``sbproxy serve`` runs its gateway."""
    import uvicorn

    parser = argparse.ArgumentParser(prog="bare")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--client", choices=("aiohttp", "pool"), default="aiohttp")
    args = parser.parse_args(argv)
    make = bare_pool_app if args.client == "pool" else bare_app
    uvicorn.run(
        make(args.upstream),
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        log_level="warning",
        access_log=False,
        server_header=False,
    )


@contextlib.contextmanager
def bare_serving(engine_port: int, tmp: Path, *, client: str = "aiohttp") -> Iterator[str]:
    """The bare pass-through (``client``: ``aiohttp`` or ``pool``) in its own process in
    front of ``engine_port``, ready: its chat URL."""
    import httpx

    port = free_port()
    log = (tmp / f"bare-{port}.log").open("wb")
    process = subprocess.Popen(  # noqa: S603 - this interpreter, our arguments
        [
            sys.executable,
            str(UPSTREAM_PROGRAM),
            "bare",
            "--port",
            str(port),
            "--upstream",
            f"http://127.0.0.1:{engine_port}",
            "--client",
            client,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        deadline = time.monotonic() + 30
        while True:
            if process.poll() is not None:
                raise SystemExit(f"the bare pass-through exited with {process.returncode}")
            try:
                httpx.post(url, json=CHAT_BODY, timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise SystemExit("the bare pass-through did not answer in 30 s") from None
                time.sleep(0.1)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


# --------------------------------------------------------------------------- set-up


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def write_wrapper(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "llama-server"
    path.write_text(
        f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" upstream "$@"\n'
    )
    path.chmod(0o755)
    return path


def write_config(root: Path, gateway_port: int, admin_port: int) -> Path:
    sys.path.insert(0, str(ROOT))
    import yaml

    from tests.model_host.runtime.host import config_text, write_catalog

    catalog = write_catalog(root)
    # Only ``tiny`` is served; the completion-only ``tiny-base`` beside it uses catalog
    # fields (``chat_template``) that older commits refuse, so a baseline could not start.
    entries = yaml.safe_load(catalog.read_text())
    entries["models"].pop("tiny-base", None)
    catalog.write_text(yaml.safe_dump(entries))
    document = yaml.safe_load(
        config_text(
            root,
            executable=write_wrapper(root / "bin"),
            deployments={
                "bench": {
                    "model": "tiny",
                    "variant": "q4_k_m",
                    "max_concurrency": 64,
                    "max_queue_depth": 256,
                    "warm": True,
                }
            },
        )
    )
    document["proxy"].update(
        {
            "http_bind_port": gateway_port,
            "admin": {"enabled": True, "port": admin_port, "password": PASSWORD},
        }
    )
    document["origins"] = {
        "localhost": {
            "action": {
                "type": "ai_proxy",
                "providers": [
                    {
                        "name": "local",
                        "provider_type": "managed_model",
                        "deployment": "bench",
                        "models": [PUBLIC_MODEL],
                        "default_model": PUBLIC_MODEL,
                    }
                ],
            }
        }
    }
    path = root / "sb.yml"
    path.write_text(yaml.safe_dump(document))
    return path


def wait_ready(admin_port: int, process: subprocess.Popen[bytes], timeout_s: float = 90) -> int:
    """Poll the admin status route until the deployment is ready; the engine's port."""
    import httpx

    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"sbproxy serve exited with {process.returncode}")
        try:
            status = httpx.get(
                f"http://127.0.0.1:{admin_port}/admin/model-host/status",
                auth=("admin", PASSWORD),
                timeout=2,
            ).json()
            deployment = status["deployments"][0]
            last = deployment
            if deployment.get("state") == "ready" and deployment.get("port"):
                port: int = deployment["port"]
                return port
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
            last = error
        time.sleep(0.1)
    raise SystemExit(f"deployment not ready after {timeout_s} s: {last}")


# --------------------------------------------------------------------------- load


WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = %s
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Host"] = "localhost"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%%d,"duration_us":%%d,"p50_us":%%d,"p90_us":%%d,"p99_us":%%d,' ..
    '"mean_us":%%f,"max_us":%%d,"errors":%%d,"non_2xx":%%d}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.mean, latency.max,
    e.connect + e.read + e.write + e.timeout, e.status))
end
"""


def wrk_run(
    wrk: str, url: str, body: dict[str, Any], clients: int, duration: float, tmp: Path
) -> dict[str, Any]:
    script = tmp / f"wrk-{abs(hash(json.dumps(body)))}.lua"
    script.write_text(WRK_SCRIPT % json.dumps(json.dumps(body)))
    out = subprocess.run(  # noqa: S603 - wrk found on PATH, our arguments
        [
            wrk,
            "-t1",
            f"-c{clients}",
            f"-d{max(1, round(duration))}s",
            "--timeout",
            "10s",
            "-s",
            str(script),
            url,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("WRKJSON "))
    raw = json.loads(line.removeprefix("WRKJSON "))
    return {
        "p50_ms": raw["p50_us"] / 1000,
        "p90_ms": raw["p90_us"] / 1000,
        "p99_ms": raw["p99_us"] / 1000,
        "mean_ms": round(raw["mean_us"] / 1000, 3),
        "max_ms": raw["max_us"] / 1000,
        "requests": raw["requests"],
        "requests_per_s": round(raw["requests"] / (raw["duration_us"] / 1e6), 1),
        "errors": raw["errors"],
        "non_2xx": raw["non_2xx"],
    }


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[index]


async def _python_load(
    url: str, body: dict[str, Any], clients: int, duration: float, *, first_byte: bool
) -> dict[str, Any]:
    """``clients`` keep-alive workers posting ``body`` back to back for ``duration`` s.

    Latency is to the first body chunk when ``first_byte`` (then the rest is drained), or to
    the end of the response otherwise."""
    import aiohttp

    payload = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Host": "localhost"}
    latencies: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=clients, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            nonlocal errors
            started = time.perf_counter()
            async with session.post(url, data=payload, headers=headers) as response:
                chunk = await response.content.readany()
                first = time.perf_counter()
                while chunk:
                    chunk = await response.content.readany()
                if response.status != 200:
                    errors += 1
                latencies.append((first if first_byte else time.perf_counter()) - started)

        async def worker(until: float) -> None:
            nonlocal errors
            while time.perf_counter() < until:
                try:
                    await one()
                except aiohttp.ClientError:
                    errors += 1

        await asyncio.gather(*(worker(time.perf_counter() + 0.5) for _ in range(clients)))
        latencies.clear()
        errors = 0
        started = time.perf_counter()
        await asyncio.gather(*(worker(started + duration) for _ in range(clients)))
        elapsed = time.perf_counter() - started
    ordered = sorted(latencies)
    return {
        "p50_ms": round(_percentile(ordered, 50) * 1000, 3),
        "p90_ms": round(_percentile(ordered, 90) * 1000, 3),
        "p99_ms": round(_percentile(ordered, 99) * 1000, 3),
        "mean_ms": round(statistics.fmean(ordered) * 1000, 3) if ordered else None,
        "max_ms": round(ordered[-1] * 1000, 3) if ordered else None,
        "requests": len(ordered),
        "requests_per_s": round(len(ordered) / elapsed, 1),
        "errors": errors,
        "non_2xx": None,
    }


def python_run(
    url: str, body: dict[str, Any], clients: int, duration: float, *, first_byte: bool = False
) -> dict[str, Any]:
    return asyncio.run(_python_load(url, body, clients, duration, first_byte=first_byte))


def load(
    wrk: str | None, url: str, body: dict[str, Any], clients: int, duration: float, tmp: Path
) -> dict[str, Any]:
    """One measurement of ``url`` (wrk after a one-second warm-up, else aiohttp)."""
    if wrk is not None:
        wrk_run(wrk, url, body, clients, 1, tmp)  # warm-up, not kept
        return wrk_run(wrk, url, body, clients, duration, tmp)
    return python_run(url, body, clients, duration)


# --------------------------------------------------------------------------- baselines

COMPARED = (("chat", CHAT_BODY), ("chat_stream", STREAM_BODY))
RATIO_FIELDS = ("requests_per_s", "p50_ms")
# What a baseline commit must import under this interpreter to be served.
IMPORTED = ("sbproxy.cli.main", "sbproxy.api.gateway")


def _kill_leftover_engine(engine_port: int, program: Path) -> None:
    """SIGKILL the engine of ``engine_port`` (a process with ``program`` and the port in its
    argv) if its server left it behind (a server killed after a shutdown that hung: engines
    run in their own session)."""
    me = str(program).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if me in argv and str(engine_port).encode() in argv:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


@contextlib.contextmanager
def serving(
    tree: Path | None,
    tmp: Path,
    write: Callable[[Path, int, int], Path] = write_config,
    *,
    ready_timeout_s: float = 90,
    engine_program: Path = UPSTREAM_PROGRAM,
) -> Iterator[tuple[str, int]]:
    """``sbproxy serve`` of ``tree`` (an extracted package; ``None``: this checkout) with
    the configuration ``write(root, gateway_port, admin_port)`` returns (by default the
    benchmark's deployment on the fast upstream; its one deployment must be warm and its
    admin password :data:`PASSWORD`), ready: the gateway's chat URL and the engine's port.
    An engine (``engine_program`` in its argv) a hung shutdown left behind is killed."""
    gateway_port, admin_port = free_port(), free_port()
    root = Path(tempfile.mkdtemp(prefix="serve-", dir=tmp))
    config = write(root, gateway_port, admin_port)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    with (root / "serve.log").open("wb") as log:
        process = subprocess.Popen(  # noqa: S603 - this interpreter, our arguments
            [sys.executable, "-m", "sbproxy.cli", "serve", "-f", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tree or ROOT,  # `-m` puts the working directory first on sys.path
        )
        engine_port = 0
        try:
            engine_port = wait_ready(admin_port, process, ready_timeout_s)
            yield f"http://127.0.0.1:{gateway_port}/v1/chat/completions", engine_port
            if process.poll() is not None:
                raise SystemExit(f"sbproxy serve died during the run: {process.returncode}")
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:  # some older commits hang in their shutdown
                process.kill()
                process.wait()
                if engine_port:
                    _kill_leftover_engine(engine_port, engine_program)


def compare_commits(args: argparse.Namespace, wrk: str | None) -> dict[str, Any]:
    """The ``--baseline-commit`` comparison (see the module docstring)."""
    head, dirty, baselines = checkout(args.baseline_commit)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sbproxy-bench-") as tmp_name:
        tmp = Path(tmp_name)
        trees: dict[str, Path | None] = {"current": None}
        for short in baselines:
            trees[short] = extract(short, tmp / "trees" / short, imports=IMPORTED)
        names = list(trees)
        for index in range(args.pairs):
            order = names[index % len(names) :] + names[: index % len(names)]
            figures: dict[str, Any] = {"order": order}
            with contextlib.ExitStack() as stack:
                urls = {name: stack.enter_context(serving(trees[name], tmp))[0] for name in order}
                for scenario, body in COMPARED:
                    for clients in CONCURRENCY:
                        for name in order:
                            measured = load(wrk, urls[name], body, clients, args.duration, tmp)
                            figures.setdefault(name, {}).setdefault(scenario, {})[
                                f"clients_{clients}"
                            ] = measured
            rounds.append(figures)
            print(f"round {index + 1}/{args.pairs} done", file=sys.stderr, flush=True)
    against: dict[str, Any] = {}
    for short, rev in baselines.items():
        ratios: dict[str, Any] = {}
        for scenario, _ in COMPARED:
            for clients in CONCURRENCY:
                key = f"clients_{clients}"
                for field in RATIO_FIELDS:
                    values = [
                        r["current"][scenario][key][field] / r[short][scenario][key][field]
                        for r in rounds
                    ]
                    ratios[f"{scenario}.{key}.{field}"] = spread(values, per="per_pair")
        checks = {
            metric: {
                "target": f">= {args.min_ratio}",
                "median": ratios[metric]["median"],
                "met": ratios[metric]["median"] >= args.min_ratio,
            }
            for metric in (
                "chat.clients_16.requests_per_s",
                "chat_stream.clients_16.requests_per_s",
            )
        }
        against[short] = {
            "rev": rev,
            "current_over_baseline": ratios,
            "checks": checks,
            "met": all(c["met"] for c in checks.values()),
        }
    medians = {
        name: {
            f"{scenario}.clients_{clients}.{field}": statistics.median(
                r[name][scenario][f"clients_{clients}"][field] for r in rounds
            )
            for scenario, _ in COMPARED
            for clients in CONCURRENCY
            for field in RATIO_FIELDS
        }
        for name in trees
    }
    return {
        "benchmark": "proxy",
        "mode": "baseline comparison",
        "current": f"{head}{' + uncommitted changes' if dirty else ''}",
        "loader": "wrk -t1" if wrk is not None else "python aiohttp",
        "duration_s_each": args.duration,
        "pairs": args.pairs,
        "ratio_meaning": (
            "current over baseline, per round: requests_per_s above 1 is faster, "
            "p50_ms below 1 is faster"
        ),
        "against": against,
        "medians": medians,
        "rounds": rounds,
        "environment": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
    }


# --------------------------------------------------------------------------- main


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "upstream":
        run_upstream(sys.argv[2:])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "bare":
        run_bare(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--loader", choices=("auto", "wrk", "python"), default="auto")
    parser.add_argument(
        "--baseline-commit",
        action="append",
        default=[],
        metavar="REV",
        help="compare with the gateway of this commit (repeatable); see the module docstring",
    )
    parser.add_argument("--pairs", type=int, default=5, help="rounds of the comparison")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of direct/bare/sbproxy")
    parser.add_argument(
        "--ttfb", action="store_true", help="also time the first event of a stream (aiohttp)"
    )
    parser.add_argument(
        "--min-ratio", type=float, default=0.99, help="required median requests/s ratio"
    )
    args = parser.parse_args()
    wrk = shutil.which("wrk") if args.loader in ("auto", "wrk") else None
    if args.loader == "wrk" and wrk is None:
        raise SystemExit("wrk is not installed")
    if args.baseline_commit:
        print(json.dumps(compare_commits(args, wrk), indent=2))
        return

    print(json.dumps(against_bare(args, wrk), indent=2))


CONTENDERS = ("direct", "bare", "bare_pool", "proxy")
SCENARIOS = (("chat", CHAT_BODY, False), ("chat_stream", STREAM_BODY, False))
TTFB = ("chat_stream_ttfb", STREAM_BODY, True)


def _median_of(rounds: list[dict[str, Any]], path: tuple[str, ...]) -> float:
    values = []
    for figures in rounds:
        value: Any = figures
        for key in path:
            value = value[key]
        values.append(value)
    return round(statistics.median(values), 3)


def against_bare(args: argparse.Namespace, wrk: str | None) -> dict[str, Any]:  # noqa: PLR0912
    """The default run: direct, bare pass-through and sbproxy, each measurement of the three
    back to back, ``--rounds`` rounds in an order that rotates (module docstring)."""
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sbproxy-bench-") as tmp_name:
        tmp = Path(tmp_name)
        with (
            serving(None, tmp) as (proxy_url, engine_port),
            bare_serving(engine_port, tmp) as bare,
            bare_serving(engine_port, tmp, client="pool") as bare_pool,
        ):
            targets = {
                "direct": f"http://127.0.0.1:{engine_port}/v1/chat/completions",
                "bare": bare,
                "bare_pool": bare_pool,
                "proxy": proxy_url,
            }
            scenarios = [*SCENARIOS, TTFB] if args.ttfb else list(SCENARIOS)
            for index in range(args.rounds):
                turn = index % len(CONTENDERS)
                order = list(CONTENDERS[turn:] + CONTENDERS[:turn])
                figures: dict[str, Any] = {"order": order}
                for scenario, body, first_byte in scenarios:
                    for clients in CONCURRENCY:
                        key = f"clients_{clients}"
                        for name in order:
                            if wrk is not None and not first_byte:
                                measured = load(
                                    wrk, targets[name], body, clients, args.duration, tmp
                                )
                            else:
                                measured = python_run(
                                    targets[name],
                                    body,
                                    clients,
                                    args.duration,
                                    first_byte=first_byte,
                                )
                            figures.setdefault(scenario, {}).setdefault(key, {})[name] = measured
                        row = figures[scenario][key]
                        row["proxy_over_bare_rps"] = round(
                            row["proxy"]["requests_per_s"] / row["bare"]["requests_per_s"], 3
                        )
                        row["proxy_over_bare_p99"] = round(
                            row["proxy"]["p99_ms"] / row["bare"]["p99_ms"], 3
                        )
                        row["proxy_over_bare_pool_rps"] = round(
                            row["proxy"]["requests_per_s"] / row["bare_pool"]["requests_per_s"], 3
                        )
                        row["proxy_over_bare_pool_p99"] = round(
                            row["proxy"]["p99_ms"] / row["bare_pool"]["p99_ms"], 3
                        )
                        row["proxy_added_p50_ms"] = round(
                            row["proxy"]["p50_ms"] - row["direct"]["p50_ms"], 3
                        )
                        row["bare_added_p50_ms"] = round(
                            row["bare"]["p50_ms"] - row["direct"]["p50_ms"], 3
                        )
                rounds.append(figures)
                print(f"round {index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    summary: dict[str, Any] = {}
    for scenario, _, _ in scenarios:
        for clients in CONCURRENCY:
            key = f"clients_{clients}"
            row: dict[str, Any] = {}
            for name in CONTENDERS:
                for field in ("requests_per_s", "p50_ms", "p99_ms"):
                    row[f"{name}.{field}"] = _median_of(rounds, (scenario, key, name, field))
            for field in (
                "proxy_over_bare_rps",
                "proxy_over_bare_p99",
                "proxy_over_bare_pool_rps",
                "proxy_over_bare_pool_p99",
                "proxy_added_p50_ms",
                "bare_added_p50_ms",
            ):
                row[field] = _median_of(rounds, (scenario, key, field))
                row[f"{field}_range"] = [
                    min(r[scenario][key][field] for r in rounds),
                    max(r[scenario][key][field] for r in rounds),
                ]
            summary[f"{scenario}.{key}"] = row
    checks: dict[str, Any] = {}
    for scenario in ("chat", "chat_stream"):
        sixteen = summary[f"{scenario}.clients_16"]
        checks[f"{scenario}.clients_16.proxy_over_bare_rps"] = {
            "target": f">= {TARGET_OVER_BARE_RPS}",
            "median": sixteen["proxy_over_bare_rps"],
            "met": sixteen["proxy_over_bare_rps"] >= TARGET_OVER_BARE_RPS,
        }
        checks[f"{scenario}.clients_16.proxy_over_bare_p99"] = {
            "target": f"<= {TARGET_OVER_BARE_P99}",
            "median": sixteen["proxy_over_bare_p99"],
            "met": sixteen["proxy_over_bare_p99"] <= TARGET_OVER_BARE_P99,
        }
        one = summary[f"{scenario}.clients_1"]
        checks[f"{scenario}.clients_1.proxy_added_p50_ms"] = {
            "target": f"<= {TARGET_ADDED_P50_MS_AT_1}",
            "median": one["proxy_added_p50_ms"],
            "met": one["proxy_added_p50_ms"] <= TARGET_ADDED_P50_MS_AT_1,
        }
    wrk_version = None
    if wrk is not None:
        probe = subprocess.run(  # noqa: S603 - wrk found on PATH
            [wrk, "-v"], capture_output=True, text=True, check=False
        )
        wrk_version = (probe.stdout or probe.stderr).splitlines()[0].strip()
    return {
        "benchmark": "proxy",
        "mode": "direct, bare pass-through and sbproxy",
        "loader": "wrk -t1" if wrk is not None else "python aiohttp",
        "ttfb_loader": "python aiohttp (first body chunk)" if args.ttfb else None,
        "duration_s_each": args.duration,
        "rounds_run": args.rounds,
        "summary_medians": summary,
        "targets": checks,
        "targets_met": all(c["met"] for c in checks.values()),
        "rounds": rounds,
        "environment": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "load_average": os.getloadavg(),
            "wrk": wrk_version,
        },
    }


if __name__ == "__main__":
    main()
