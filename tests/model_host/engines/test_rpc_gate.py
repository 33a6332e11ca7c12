"""The RPC gate and tunnel (``engines/rpc.py``) over real loopback sockets: who gets through
to a worker's ``rpc-server``, what crosses the wire, and the plans of a split's processes.

The worker behind the gate is a real TCP server that echoes what it receives and counts its
connections (the real ``ggml-rpc-server`` is exercised end to end in
``tests/e2e/test_rpc_split_real.py``): what the gate must do -- let through only callers who
prove the credential, relay their bytes both ways -- does not depend on what the worker says.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.abc
import pytest

from sbproxy.config.engine_args import check_engine_args
from sbproxy.model_host.engines import rpc
from sbproxy.model_host.engines.errors import EngineError
from sbproxy.model_host.engines.rpc import RpcGate, RpcTunnel, rpc_argv

pytestmark = pytest.mark.anyio

SECRET = "fleet-credential-9f3b2c"


@dataclass
class EchoWorker:
    """A loopback TCP server that echoes every byte; counts connections."""

    port: int = 0
    connections: int = 0
    received: bytearray = field(default_factory=bytearray)

    async def _handle(self, stream: anyio.abc.SocketStream) -> None:
        self.connections += 1
        async with stream:
            try:
                while True:
                    chunk = await stream.receive()
                    self.received += chunk
                    await stream.send(chunk)
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return


@dataclass
class Split:
    worker: EchoWorker
    gate: RpcGate
    group: anyio.abc.TaskGroup

    async def tunnel(self, *, node: str = "node-a", credential: str = SECRET) -> RpcTunnel:
        tunnel = RpcTunnel(gate=("127.0.0.1", self.gate.port), node=node, credential=credential)
        await self.group.start(tunnel.serve)
        return tunnel


async def _serve(
    listener: anyio.abc.Listener[anyio.abc.SocketStream],
    handler: Callable[[anyio.abc.SocketStream], Awaitable[None]],
) -> None:
    async with listener:
        await listener.serve(handler)


def _credentials(node: str) -> str | None:
    return SECRET if node in ("node-a", "node-b") else None


@pytest.fixture
async def split() -> AsyncIterator[Split]:
    worker = EchoWorker()
    async with anyio.create_task_group() as group:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        worker.port = int(listener.extra(anyio.abc.SocketAttribute.local_port))  # noqa: S610
        group.start_soon(_serve, listener, worker._handle)
        gate = RpcGate(target_port=worker.port, credentials=_credentials)
        await group.start(gate.serve)
        yield Split(worker=worker, gate=gate, group=group)
        group.cancel_scope.cancel()


async def _exchange(port: int, payload: bytes) -> bytes:
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(payload)
        received = b""
        with anyio.fail_after(10):
            while len(received) < len(payload):
                received += await stream.receive()
        return received


async def test_a_caller_with_the_credential_reaches_the_worker_through_its_tunnel(
    split: Split,
) -> None:
    tunnel = await split.tunnel()
    payload = bytes(range(256)) * 4096  # 1 MiB, more than one relay read
    assert await _exchange(tunnel.port, payload) == payload
    assert split.worker.connections == 1
    assert bytes(split.worker.received) == payload
    assert split.gate.accepted == 1
    assert split.gate.bytes_in[0] == len(payload) == split.gate.bytes_out[0]


async def test_a_wrong_credential_is_refused_and_never_reaches_the_worker(split: Split) -> None:
    tunnel = RpcTunnel(gate=("127.0.0.1", split.gate.port), node="node-a", credential="wrong")
    with pytest.raises(EngineError) as raised:
        await tunnel.open()
    assert raised.value.code == "peer_unauthorized"
    assert split.worker.connections == 0
    assert split.gate.refused == {"peer_unauthorized": 1}


async def test_an_unknown_node_is_refused_even_with_the_credential(split: Split) -> None:
    tunnel = RpcTunnel(gate=("127.0.0.1", split.gate.port), node="intruder", credential=SECRET)
    with pytest.raises(EngineError) as raised:
        await tunnel.open()
    assert raised.value.code == "peer_unauthorized"
    assert split.worker.connections == 0


async def test_a_refused_tunnel_closes_the_leaders_connection_without_a_byte(
    split: Split,
) -> None:
    tunnel = await split.tunnel(credential="wrong")
    async with await anyio.connect_tcp("127.0.0.1", tunnel.port) as stream:
        await stream.send(b"RPC hello")
        with anyio.fail_after(10), pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
            await stream.receive()
    assert tunnel.failures == {"peer_unauthorized": 1}
    assert split.worker.connections == 0


async def test_a_caller_that_speaks_raw_rpc_to_the_gate_gets_nothing_through(
    split: Split,
) -> None:
    async with await anyio.connect_tcp("127.0.0.1", split.gate.port) as stream:
        greeting = await stream.receive()
        assert greeting.startswith(rpc.PROTOCOL + b" ")
        await stream.send(b"\x00\x01\x02 not a handshake\n")
        with anyio.fail_after(10):
            answer = await stream.receive()
    assert answer == b"NO rpc_handshake_invalid\n"
    assert split.worker.connections == 0


async def test_a_silent_caller_is_dropped_after_the_handshake_deadline(
    split: Split, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rpc, "HANDSHAKE_TIMEOUT_S", 0.2)
    async with await anyio.connect_tcp("127.0.0.1", split.gate.port) as stream:
        await stream.receive()  # the greeting; then say nothing
        with anyio.fail_after(10), pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
            await stream.receive()
    assert split.gate.refused == {"rpc_handshake_invalid": 1}
    assert split.worker.connections == 0


async def test_the_credential_never_crosses_the_wire(split: Split) -> None:
    """What the tunnel sends in the handshake is its node id and a MAC of the gate's fresh
    nonce: a replayed answer fails against the next nonce."""
    sent: list[bytes] = []

    async def recording_gate(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await stream.send(rpc.PROTOCOL + b" " + b"ab" * 32 + b"\n")
            sent.append(await stream.receive())
            await stream.send(b"NO peer_unauthorized\n")

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = int(listener.extra(anyio.abc.SocketAttribute.local_port))  # noqa: S610
    split.group.start_soon(_serve, listener, recording_gate)
    tunnel = RpcTunnel(gate=("127.0.0.1", port), node="node-a", credential=SECRET)
    with pytest.raises(EngineError):
        await tunnel.open()
    (answer,) = sent
    assert SECRET.encode() not in answer
    node, mac = answer.decode().split()
    assert node == "node-a"
    assert mac == rpc.rpc_mac(SECRET, bytes.fromhex("ab" * 32), "node-a")
    # The same answer to the real gate's own nonce does not get through.
    async with await anyio.connect_tcp("127.0.0.1", split.gate.port) as stream:
        await stream.receive()
        await stream.send(answer)
        with anyio.fail_after(10):
            assert await stream.receive() == b"NO peer_unauthorized\n"
    assert split.worker.connections == 0


async def test_a_gate_whose_worker_is_gone_says_so(split: Split) -> None:
    gone = RpcGate(target_port=split.worker.port, credentials=_credentials)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    unused = int(listener.extra(anyio.abc.SocketAttribute.local_port))  # noqa: S610
    await listener.aclose()
    gone.target_port = unused
    await split.group.start(gone.serve)
    tunnel = RpcTunnel(gate=("127.0.0.1", gone.port), node="node-a", credential=SECRET)
    with pytest.raises(EngineError) as raised:
        await tunnel.open()
    assert raised.value.code == "rpc_worker_unavailable"


def test_a_worker_plan_listens_on_loopback_only(tmp_path: Path) -> None:
    executable = tmp_path / "ggml-rpc-server"
    executable.write_text("")
    plan = rpc.plan_rpc_worker(executable, port=50123, threads=1, cache_dir=tmp_path / "c")
    argv = list(plan.argv)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--port") + 1] == "50123"
    assert argv[argv.index("--threads") + 1] == "1"
    assert "--cache" in argv
    assert plan.env["LD_LIBRARY_PATH"] == str(tmp_path)


def test_a_build_without_an_rpc_server_is_refused_with_a_remedy(tmp_path: Path) -> None:
    with pytest.raises(EngineError) as raised:
        rpc.plan_rpc_worker(tmp_path / "ggml-rpc-server", port=1)
    assert raised.value.code == "engine_provision_failed"
    assert "recipe 3" in (raised.value.remediation or "")


def test_the_leader_points_rpc_at_its_tunnels_and_an_operator_may_not() -> None:
    assert rpc_argv([("127.0.0.1", 4001), ("127.0.0.1", 4002)]) == (
        "--rpc",
        "127.0.0.1:4001,127.0.0.1:4002",
    )
    assert rpc_argv([]) == ()
    problems = check_engine_args("llama_cpp", ["--rpc", "10.0.0.5:50052"])
    assert problems and "--rpc" in problems[0][1]
