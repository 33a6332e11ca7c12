"""A loopback HTTP/1.1 server that closes kept-alive connections as an idle engine does
(shared by the tests of both engine clients)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from yarl import URL


@dataclass
class IdleClosingEngine:
    """A loopback HTTP/1.1 server that answers the first request on each connection with a
    kept-alive JSON answer, then treats the connection as idled out: when the next request
    arrives there, it closes the socket unread with a reset -- what a client sees when its
    request crosses the engine's idle close (cpp-httplib's keep-alive timeout)."""

    answered: list[bytes] = field(default_factory=list)
    reset: int = 0
    connections: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            self.answered.append(await reader.readexactly(length))
            answer = json.dumps({"object": "chat.completion", "n": len(self.answered)}).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(answer), answer)
            )
            await writer.drain()
            if await reader.read(1):  # the next request on the kept-alive connection
                self.reset += 1
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


@contextlib.asynccontextmanager
async def idle_closing_engine() -> AsyncIterator[tuple[IdleClosingEngine, URL]]:
    engine = IdleClosingEngine()
    server = await asyncio.start_server(engine.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield engine, URL(f"http://127.0.0.1:{port}/v1/chat/completions")
