"""Several served hosts on loopback as one fleet, for peer dispatch tests: each a real
runtime host (its own cache and stand-in engine) with the gateway and admin apps on real
listeners, and a static routing table the test sets (the fleet's real directory is built from
membership and placements; here the table is the input under test)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from sbproxy.api.peers import PeerDispatch
from sbproxy.config import ApiKeyRecord, Route
from sbproxy.fleet.routing import PeerReplica, RoutingTable
from tests.api.support import ROUTES, TINY, Served, served
from tests.model_host.engines.support import FAKE_SERVER, free_port

CREDENTIAL = "fleet-credential-for-tests-0123456789"
COOLDOWN_S = 5.0


class StaticDirectory:
    """A routing table the test writes: ``replicas`` by deployment."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.replicas: dict[str, tuple[PeerReplica, ...]] = {}
        self.reads = 0

    def routing(self) -> RoutingTable:
        self.reads += 1
        return RoutingTable(local_node_id=self.node_id, replicas=self.replicas, taken_at=0.0)


@dataclass
class Clock:
    """Monotonic seconds a test moves by hand."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Member:
    name: str
    host: Served
    directory: StaticDirectory
    dispatch: PeerDispatch
    clock: Clock
    log: Path
    hosts_tiny: bool

    @property
    def url(self) -> str:
        """The gateway as a peer reaches it (the advertise URL)."""
        return self.host.gateway_url.replace("localhost", "127.0.0.1")

    def engine_requests(self) -> list[dict[str, Any]]:
        """The POSTs this member's engine received (its ``requests_log``)."""
        if not self.log.exists():
            return []
        lines = self.log.read_text().splitlines()
        return [r for r in map(json.loads, lines) if "event" not in r]


@dataclass
class Fleet:
    members: dict[str, Member] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Member:
        return self.members[name]

    def replica(
        self, name: str, *, ready: bool = True, active: int = 0, queued: int = 0
    ) -> PeerReplica:
        """The ``tiny`` replica on member ``name`` as a table lists it."""
        return PeerReplica(
            deployment="tiny",
            node_id=name,
            base_url=self[name].url,
            generation=1,
            ready=ready,
            active=active,
            queued=queued,
        )

    def route(self, on: str, replicas: Sequence[PeerReplica]) -> None:
        """Member ``on``'s table lists ``replicas`` of ``tiny``."""
        self[on].directory.replicas = {"tiny": tuple(replicas)}

    def route_everywhere(self) -> None:
        """Every member's table: a ready, idle ``tiny`` replica on each member hosting it."""
        replicas = [self.replica(m.name) for m in self.members.values() if m.hosts_tiny]
        for name in self.members:
            self.route(name, replicas)


@asynccontextmanager
async def fleet_of(
    root: Path,
    *,
    hosting: Sequence[str] = ("b", "c"),
    names: Sequence[str] = ("a", "b", "c"),
    mode: str | None = None,
    modes: dict[str, str] | None = None,
    keys: Sequence[ApiKeyRecord] = (),
    credential: str | None = CREDENTIAL,
    credentials: dict[str, str] | None = None,
    routes: Sequence[Route] = ROUTES,
    tiny: dict[str, Any] = TINY,
) -> AsyncIterator[Fleet]:
    """Members ``names`` (node ids), each served from ``root/<name>``; those in ``hosting``
    run deployment ``tiny`` (configured as ``tiny``; stand-in engine in ``mode`` plus
    ``modes[name]``, logging its requests), the others
    have no deployment. Every table lists the hosting members' replicas, ready and idle.
    Each member has fleet credential ``credential``, or its own in ``credentials``."""
    fleet = Fleet()
    async with AsyncExitStack() as stack:
        for name in names:
            directory = StaticDirectory(name)
            clock = Clock()
            dispatch = PeerDispatch(
                directory,
                credential=(credentials or {}).get(name, credential),
                cooldown_s=COOLDOWN_S,
                clock=clock,
            )
            log = root / name / "requests.jsonl"
            own = (modes or {}).get(name)
            faults = ",".join(m for m in (mode, own, f"requests_log={log}") if m)
            host = await stack.enter_async_context(
                served(
                    root / name,
                    deployments={"tiny": tiny} if name in hosting else {},
                    mode=faults,
                    keys=keys,
                    fleet=dispatch,
                    routes=routes,
                )
            )
            fleet.members[name] = Member(
                name=name,
                host=host,
                directory=directory,
                dispatch=dispatch,
                clock=clock,
                log=log,
                hosts_tiny=name in hosting,
            )
        fleet.route_everywhere()
        yield fleet


@dataclass
class StandIn:
    """A stand-in engine process listed in a table as a peer host's gateway (a peer whose
    faults the test chooses), logging each request it read."""

    url: str
    log: Path

    def requests(self) -> list[dict[str, Any]]:
        """The POSTs it read (its ``requests_log``)."""
        if not self.log.exists():
            return []
        lines = self.log.read_text().splitlines()
        return [r for r in map(json.loads, lines) if "event" not in r]

    def replica(self, node_id: str) -> PeerReplica:
        """Its ``tiny`` replica as a table lists it, on node ``node_id``."""
        return PeerReplica("tiny", node_id, self.url, 1, True, 0, 0)


@asynccontextmanager
async def stand_in_peer(root: Path, *, mode: str) -> AsyncIterator[StandIn]:
    """A stand-in engine (``tests/support/fake_llama_server.py``) in fault ``mode`` on a free
    loopback port, ready; stopped at the end."""
    root.mkdir(parents=True, exist_ok=True)
    log = root / "requests.jsonl"
    port = free_port()
    env = {**os.environ, "FAKE_LLAMA_MODE": f"load_s=0,{mode},requests_log={log}"}
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(FAKE_SERVER), "--port", str(port), env=env
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=2) as http:

            async def healthy() -> bool:
                try:
                    return (await http.get("/health")).status_code == 200
                except httpx.TransportError:
                    return False

            deadline = asyncio.get_running_loop().time() + 20
            while not await healthy():
                assert asyncio.get_running_loop().time() < deadline, "stand-in not up"
                await asyncio.sleep(0.05)
        yield StandIn(url=url, log=log)
    finally:
        process.terminate()
        await process.wait()
