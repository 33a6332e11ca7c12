"""Several replicas of one fleet deployment on one node (issue 20): the node runs each
under its own id (``tiny``, ``tiny.r1``: ``replica_deployment_id``) with its own engine,
and its gateway spreads the deployment's requests over them -- a routable replica with the
fewest requests in flight first, in turn among equals. A real host with two stand-in
engines on loopback; the routing table is static (the input under test)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest

from sbproxy.api.peers import PeerDispatch
from sbproxy.fleet.routing import PeerReplica
from tests.api.fleet_hosts import COOLDOWN_S, CREDENTIAL, Clock, StaticDirectory
from tests.api.support import TINY, Served, served
from tests.model_host.runtime.support import until

pytestmark = pytest.mark.anyio

CHAT: dict[str, object] = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]}


def listed(url: str, *local_ids: str) -> tuple[PeerReplica, ...]:
    """Node ``a``'s replicas of ``tiny`` as its table lists them, ready and idle."""
    return tuple(
        PeerReplica("tiny", "a", url, 1, ready=True, active=0, queued=0, local_id=local)
        for local in local_ids
    )


@asynccontextmanager
async def two_replicas(root: Path, mode: str) -> AsyncIterator[Served]:
    """A host of a fleet (node ``a``) running ``tiny`` and ``tiny.r1``, each with its own
    stand-in engine in ``mode``; its table lists both here."""
    directory = StaticDirectory("a")
    dispatch = PeerDispatch(directory, credential=CREDENTIAL, cooldown_s=COOLDOWN_S, clock=Clock())
    async with served(
        root / "a", deployments={"tiny": TINY, "tiny.r1": TINY}, mode=mode, fleet=dispatch
    ) as host:
        directory.replicas = {"tiny": listed(host.gateway_url, "tiny", "tiny.r1")}
        yield host


async def test_a_node_with_two_replicas_spreads_requests_over_both_engines(
    tmp_path: Path,
) -> None:
    log = tmp_path / "requests.jsonl"
    async with two_replicas(tmp_path, f"reply_delay_s=0.5,requests_log={log}") as host:
        manager = host.host.manager
        for local in ("tiny", "tiny.r1"):
            manager.request_load(local)
        await until(lambda: all(manager.snapshot(d).routable for d in ("tiny", "tiny.r1")))
        ports = {manager.snapshot(d).port: d for d in ("tiny", "tiny.r1")}
        statuses: list[int] = []

        async def ask() -> None:
            async with httpx.AsyncClient(base_url=host.gateway_url, timeout=30) as http:
                statuses.append((await http.post("/v1/chat/completions", json=CHAT)).status_code)

        async with anyio.create_task_group() as group:
            for _ in range(4):
                group.start_soon(ask)
        assert statuses == [200] * 4
        served_by = Counter(
            ports[record["port"]]
            for record in map(json.loads, log.read_text().splitlines())
            if "event" not in record
        )
        assert served_by == {"tiny": 2, "tiny.r1": 2}


async def test_with_one_replica_routable_the_node_sends_every_request_to_it(
    tmp_path: Path,
) -> None:
    log = tmp_path / "requests.jsonl"
    async with two_replicas(tmp_path, f"requests_log={log}") as host:
        manager = host.host.manager
        manager.request_load("tiny.r1")
        await until(lambda: manager.snapshot("tiny.r1").routable)
        async with httpx.AsyncClient(base_url=host.gateway_url, timeout=30) as http:
            for _ in range(3):
                assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
        # The idle one was never loaded for them: the routable replica took all three.
        assert not manager.snapshot("tiny").routable
        assert manager.snapshot("tiny.r1").active_requests == 0
        assert len([line for line in log.read_text().splitlines() if '"event"' not in line]) == 3
