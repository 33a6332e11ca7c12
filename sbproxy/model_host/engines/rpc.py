"""One model over several hosts: llama.cpp's RPC workers, the leader's argv, and the gate.

llama.cpp splits a model over hosts with its RPC backend: each worker host runs
``ggml-rpc-server`` (built beside ``llama-server`` from the same pinned source,
``llama_build.py``), which offers its CPU (or GPU) to whoever connects, and the leader runs
``llama-server --rpc host:port,...`` with every layer offloaded (``--n-gpu-layers``): the
layers are spread over the RPC devices, the weights are sent to them once at load, and each
token's activations travel to every worker and back.

**The RPC protocol has no authentication of its own**: whoever reaches an ``rpc-server`` may
allocate its memory, read and write its tensors and run graphs on it. So a worker's
``rpc-server`` never listens beyond loopback (:func:`plan_rpc_worker` binds ``127.0.0.1``),
and the only way in from another host is the worker node's **gate** (:class:`RpcGate`): a TCP
listener on the node's peer address that lets a connection through to the ``rpc-server``
only after the caller proved, by a challenge-response, that it holds a fleet credential,
never sent over the wire. In a fleet (``fleet/split.py``) the key is the SHA-256 of the
caller's own node credential, which the caller derives from its secret and the gate reads
from the caller's member row (where only that hash is kept; a revoked or removed member has
none there):

1. the gate sends ``SBRPC/1 <nonce>\\n`` (32 random bytes, hex);
2. the caller answers ``<node id> <mac>\\n``, ``mac`` = HMAC-SHA256(credential,
   ``"sbproxy-rpc/1\\0" + nonce + "\\0" + node id``), hex;
3. the gate compares it with the credential it holds for that node (constant time) and
   answers ``OK\\n``, or ``NO <reason code>\\n`` and closes (``peer_unauthorized``); a caller
   that says nothing within :data:`HANDSHAKE_TIMEOUT_S` is dropped.

After ``OK`` the gate relays bytes both ways until either side closes. The leader's
``llama-server`` speaks plain RPC, so on the leader node each worker gets a **tunnel**
(:class:`RpcTunnel`): a loopback listener the leader's ``--rpc`` points at, which opens the
gate's handshake for every connection. A stolen leader address is worth nothing without the
credential; the credential's holder is trusted with the worker, as with every peer route.
The relay's cost on loopback is measured by ``benchmarks/rpc_split.py``.

Estimates: a split places ``1 / n`` of the weights and of the KV cache on each of ``n``
devices (llama.cpp splits layers in proportion to what each device reports free; on equal
nodes, evenly), plus each device's compute buffer; the fleet's planner reserves that on each
node of a split (:func:`sbproxy.fleet.placement.split_share`).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import anyio
import anyio.abc
import anyio.to_thread
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.stapled import MultiListener

from sbproxy.model_host.engines.driver import LaunchPlan
from sbproxy.model_host.engines.errors import EngineError
from sbproxy.model_host.engines.process import EngineProcess, minimal_env

__all__ = [
    "HANDSHAKE_TIMEOUT_S",
    "PROTOCOL",
    "RpcGate",
    "RpcTunnel",
    "plan_rpc_worker",
    "rpc_argv",
    "rpc_mac",
    "wait_listening",
]

logger = logging.getLogger(__name__)

PROTOCOL = b"SBRPC/1"
# How long a gate waits for a caller's answer, and a tunnel for the gate's words.
HANDSHAKE_TIMEOUT_S = 5.0
# The longest handshake line either side accepts (a node id is short).
MAX_LINE = 512
# What one relay read takes at most (the weights go over at load: large reads pay).
CHUNK = 256 * 1024
_MAC_CONTEXT = b"sbproxy-rpc/1\0"
# What a handshake that broke off raises (a silent, closed or babbling other side).
_BROKEN_OFF = (
    TimeoutError,
    OSError,
    anyio.IncompleteRead,
    anyio.DelimiterNotFound,
    anyio.EndOfStream,
    anyio.BrokenResourceError,
)


def rpc_mac(credential: str, nonce: bytes, node: str) -> str:
    """The caller's proof for ``nonce`` (hex): HMAC-SHA256 keyed with ``credential`` over
    the protocol's context, the nonce and the caller's node id."""
    message = _MAC_CONTEXT + nonce + b"\0" + node.encode()
    return hmac.new(credential.encode(), message, hashlib.sha256).hexdigest()


def plan_rpc_worker(
    executable: Path, *, port: int, threads: int | None = None, cache_dir: Path | None = None
) -> LaunchPlan:
    """The argv and environment of one worker's ``ggml-rpc-server``: on loopback only (the
    gate is the way in), ``threads`` CPU threads (``None``: the server's default), and its
    tensor cache in ``cache_dir`` when given (``-c``: a re-placed split loads faster).

    Raises:
        EngineError: ``engine_provision_failed`` when ``executable`` is missing (a build of
            recipe 2 or older has no RPC server: rebuild).
    """
    if not executable.is_file():
        raise EngineError(
            f"{executable} does not exist; this llama.cpp build has no RPC server",
            code="engine_provision_failed",
            remediation="Rebuild the engine (`sbproxy engines build llama_cpp ...`): builds "
            "of recipe 3 and later include ggml-rpc-server.",
        )
    argv = [str(executable), "--host", "127.0.0.1", "--port", str(port)]
    if threads is not None:
        argv += ["--threads", str(threads)]
    env = minimal_env({"LD_LIBRARY_PATH": str(executable.parent)})
    if cache_dir is not None:
        argv.append("--cache")
        # The server keeps its cache under $HOME/.cache/llama.cpp/rpc (XDG where set).
        env["XDG_CACHE_HOME"] = str(cache_dir)
    return LaunchPlan(argv=tuple(argv), env=env, health_path="", port=port)


def rpc_argv(endpoints: Sequence[tuple[str, int]]) -> tuple[str, ...]:
    """The leader's ``llama-server`` flags for ``endpoints`` (its tunnels' loopback
    addresses): ``--rpc`` with every one, every layer offloaded onto them."""
    if not endpoints:
        return ()
    joined = ",".join(f"{host}:{port}" for host, port in endpoints)
    return ("--rpc", joined)


async def wait_listening(process: EngineProcess, port: int, *, timeout_s: float) -> None:
    """Wait until ``process`` holds the listening socket on ``port`` (read from the kernel's
    tables: nothing is sent to an ``rpc-server``, which serves one client at a time).

    Raises:
        EngineError: ``engine_early_exit`` when it exits first, ``engine_readiness_timeout``
            (the process is stopped) after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not await anyio.to_thread.run_sync(process.listens_on, port):
        if not process.alive():
            raise EngineError(
                f"the RPC worker exited with status {process.returncode} before it listened"
                f"\n{process.stderr_tail()}",
                code="engine_early_exit",
                retryable=True,
            )
        if time.monotonic() >= deadline:
            await process.shutdown(grace_s=1.0)
            raise EngineError(
                f"the RPC worker did not listen on 127.0.0.1:{port} within {timeout_s:g} s",
                code="engine_readiness_timeout",
                retryable=True,
            )
        await anyio.sleep(0.05)


async def _connect(host: str, port: int) -> anyio.abc.SocketStream:
    """A TCP connection with Nagle's algorithm off, as anyio sets it on accepted ones: RPC
    sends many small commands per token, each waiting for its answer, and a relay that
    held a small write back for an ACK would stall every one of them."""
    stream = await anyio.connect_tcp(host, port)
    raw = stream.extra(anyio.abc.SocketAttribute.raw_socket)  # noqa: S610 - anyio's
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return stream


async def _read_line(stream: BufferedByteReceiveStream) -> bytes:
    with anyio.fail_after(HANDSHAKE_TIMEOUT_S):
        return await stream.receive_until(b"\n", MAX_LINE)


async def _pump(
    source: anyio.abc.ByteReceiveStream, sink: anyio.abc.ByteStream, counter: list[int]
) -> None:
    """Copy ``source`` to ``sink`` until ``source`` ends (a buffered source gives what its
    handshake read past first); then end ``sink``'s sending side."""
    try:
        while True:
            try:
                chunk = await source.receive(CHUNK)
            except (
                anyio.EndOfStream,
                anyio.ClosedResourceError,
                anyio.BrokenResourceError,
                OSError,
            ):
                break
            try:
                await sink.send(chunk)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
                break
            counter[0] += len(chunk)
    finally:
        # RuntimeError: uvloop's answer for a transport the other direction already closed.
        with contextlib.suppress(
            anyio.ClosedResourceError, anyio.BrokenResourceError, OSError, RuntimeError
        ):
            await sink.send_eof()


async def _serve(
    listener: MultiListener[anyio.abc.SocketStream],
    handler: Callable[[anyio.abc.SocketStream], Awaitable[None]],
) -> None:
    """Accept on ``listener`` and run ``handler`` for each connection until cancelled; a
    connection accepted but not yet handled when that happens is closed, not leaked (as
    ``Listener.serve`` would leave it, its handler's task cancelled before it ran)."""
    waiting: set[anyio.abc.SocketStream] = set()

    async def handle(stream: anyio.abc.SocketStream) -> None:
        waiting.discard(stream)
        try:
            await handler(stream)
        except Exception:
            # One connection's error never ends the listener (nor the host that runs it).
            logger.warning("RPC relay: a connection ended with an error", exc_info=True)

    async def accept(one: anyio.abc.SocketListener, group: anyio.abc.TaskGroup) -> None:
        while True:
            stream = await one.accept()
            waiting.add(stream)
            group.start_soon(handle, stream)

    try:
        async with listener, anyio.create_task_group() as group:
            for one in listener.listeners:
                group.start_soon(accept, cast("anyio.abc.SocketListener", one), group)
    finally:
        with anyio.CancelScope(shield=True):
            for stream in waiting:
                await stream.aclose()


async def _relay(
    near: anyio.abc.ByteStream,
    near_source: anyio.abc.ByteReceiveStream,
    far: anyio.abc.ByteStream,
    far_source: anyio.abc.ByteReceiveStream,
    counters: tuple[list[int], list[int]],
) -> None:
    """Relay both ways (``near_source`` to ``far``, ``far_source`` to ``near``: a side's
    source is the side itself, or its buffered reader after a handshake) until both
    directions ended."""
    async with anyio.create_task_group() as group:
        group.start_soon(_pump, near_source, far, counters[0])
        group.start_soon(_pump, far_source, near, counters[1])


@dataclass
class RpcGate:
    """A worker node's authenticated way in to one of its ``rpc-server``\\ s.

    Args:
        target_port: The loopback port the worker's ``rpc-server`` listens on.
        credentials: The credential a caller of a node id must prove it holds, or ``None``
            for an unknown node (refused). Called for every connection, so a revoked node
            is refused from its next connection on.
        host: The address to listen on (the node's peer address; loopback in tests).
        port: The port (0: any free one, see :attr:`port` once started).

    Attributes:
        accepted: Connections let through. ``refused``: handshakes refused, by reason code.
        bytes_in / bytes_out: Bytes relayed to and from the worker.
    """

    target_port: int
    credentials: Callable[[str], str | None]
    host: str = "127.0.0.1"
    port: int = 0
    accepted: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    bytes_in: list[int] = field(default_factory=lambda: [0])
    bytes_out: list[int] = field(default_factory=lambda: [0])

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen and serve until cancelled; ``task_status`` gets the port listened on."""
        listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port)
        self.port = int(listener.extra(anyio.abc.SocketAttribute.local_port))  # noqa: S610 - anyio's
        task_status.started(self.port)
        await _serve(listener, self._handle)

    def _refuse_reason(self, line: bytes, nonce: bytes) -> tuple[str | None, str]:
        """``(None, node)`` for a valid answer, else ``(reason code, node or '')``."""
        parts = line.decode("ascii", "replace").strip().split(" ")
        if len(parts) != 2:
            return "rpc_handshake_invalid", ""
        node, mac = parts
        credential = self.credentials(node)
        if credential is None:
            return "peer_unauthorized", node
        expected = rpc_mac(credential, nonce, node)
        if not hmac.compare_digest(expected.encode(), mac.encode()):
            return "peer_unauthorized", node
        return None, node

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        async with client:
            buffered = BufferedByteReceiveStream(client)
            nonce = secrets.token_bytes(32)
            try:
                await client.send(PROTOCOL + b" " + nonce.hex().encode() + b"\n")
                line = await _read_line(buffered)
            except _BROKEN_OFF:
                self._count_refusal("rpc_handshake_invalid")
                return
            reason, node = self._refuse_reason(line, nonce)
            if reason is not None:
                self._count_refusal(reason)
                logger.warning(
                    "RPC gate on port %s refused a caller (%s, node %r)",
                    self.port,
                    reason,
                    node[:64],
                )
                with contextlib.suppress(OSError, anyio.BrokenResourceError):
                    await client.send(b"NO " + reason.encode() + b"\n")
                return
            try:
                worker = await _connect("127.0.0.1", self.target_port)
            except OSError:
                self._count_refusal("rpc_worker_unavailable")
                with contextlib.suppress(OSError, anyio.BrokenResourceError):
                    await client.send(b"NO rpc_worker_unavailable\n")
                return
            self.accepted += 1
            await client.send(b"OK\n")
            async with worker:
                await _relay(client, buffered, worker, worker, (self.bytes_in, self.bytes_out))

    def _count_refusal(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1


@dataclass
class RpcTunnel:
    """The leader node's loopback way to one worker's gate (see the module docstring).

    Args:
        gate: ``(host, port)`` of the worker node's gate.
        node: This (the leader's) node id, as the gate knows it.
        credential: The credential the leader proves it holds.
        port: The loopback port to listen on (0: any free one).

    Attributes:
        failures: Connections that could not be tunnelled, by reason code (the leader's
            ``llama-server`` then sees its RPC connection closed, and fails to load).
    """

    gate: tuple[str, int]
    node: str
    credential: str
    port: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    bytes_out: list[int] = field(default_factory=lambda: [0])
    bytes_in: list[int] = field(default_factory=lambda: [0])

    @property
    def endpoint(self) -> tuple[str, int]:
        """The loopback address the leader's ``--rpc`` names."""
        return ("127.0.0.1", self.port)

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen on loopback and serve until cancelled; ``task_status`` gets the port."""
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=self.port)
        self.port = int(listener.extra(anyio.abc.SocketAttribute.local_port))  # noqa: S610 - anyio's
        task_status.started(self.port)
        await _serve(listener, self._handle)

    async def open(self) -> tuple[anyio.abc.SocketStream, BufferedByteReceiveStream]:
        """Connect to the gate and pass its handshake.

        Raises:
            EngineError: ``peer_unauthorized`` or another reason the gate gave,
                ``rpc_handshake_invalid`` for a gate that does not speak the protocol,
                ``rpc_worker_unavailable`` when the gate cannot be reached.
        """
        host, port = self.gate
        try:
            with anyio.fail_after(HANDSHAKE_TIMEOUT_S):
                stream = await _connect(host, port)
        except (OSError, TimeoutError) as exc:
            raise EngineError(
                f"the RPC gate {host}:{port} cannot be reached: {exc}",
                code="rpc_worker_unavailable",
                retryable=True,
            ) from None
        buffered = BufferedByteReceiveStream(stream)
        try:
            greeting = await _read_line(buffered)
            words = greeting.split(b" ")
            if len(words) != 2 or words[0] != PROTOCOL:
                raise EngineError(
                    f"{host}:{port} is not an sbproxy RPC gate",
                    code="rpc_handshake_invalid",
                )
            nonce = bytes.fromhex(words[1].decode("ascii"))
            mac = rpc_mac(self.credential, nonce, self.node)
            await stream.send(f"{self.node} {mac}\n".encode())
            answer = (await _read_line(buffered)).decode("ascii", "replace").strip()
        except EngineError:
            await stream.aclose()
            raise
        except (*_BROKEN_OFF, ValueError) as exc:
            await stream.aclose()
            raise EngineError(
                f"the RPC gate {host}:{port} broke off the handshake: {type(exc).__name__}",
                code="rpc_handshake_invalid",
                retryable=True,
            ) from None
        if answer != "OK":
            await stream.aclose()
            reason = (
                answer.split(" ", 1)[1] if answer.startswith("NO ") else "rpc_handshake_invalid"
            )
            raise EngineError(
                f"the RPC gate {host}:{port} refused node {self.node!r}: {reason}",
                code=reason if reason.replace("_", "").isalnum() else "rpc_handshake_invalid",
            )
        return stream, buffered

    async def _handle(self, leader: anyio.abc.SocketStream) -> None:
        async with leader:
            try:
                gate, gate_buffered = await self.open()
            except EngineError as exc:
                self.failures[exc.code] = self.failures.get(exc.code, 0) + 1
                logger.warning("RPC tunnel to %s:%s: %s", *self.gate, exc.code)
                return
            async with gate:
                await _relay(leader, leader, gate, gate_buffered, (self.bytes_out, self.bytes_in))
