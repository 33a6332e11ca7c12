"""The fleet agent's races, each made deterministic by holding one call of the real store on
a real PostgreSQL server until the other side has moved: no timing decides the outcome."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest

from sbproxy.config import PriorityClass
from sbproxy.fleet.agent import FleetAgent, NodeIdentity
from sbproxy.fleet.membership import FleetTiming, PeerAnswer
from sbproxy.fleet.placement import PlacementPolicy
from sbproxy.model_host.runtime.state import DeploymentState
from sbproxy.store.fleet import FleetStore, Renewal
from tests.model_host.runtime.host import runtime_host
from tests.support.postgres import PostgresServer

pytestmark = pytest.mark.anyio

TINY = {"model": "tiny", "variant": "q4_k_m"}
TIMING = FleetTiming(heartbeat_ms=500, fence_after_ms=2_000, lost_after_ms=6_000)


class HeldRenewals:
    """The real store, whose renewals wait once :attr:`hold` is set until :attr:`go` is
    (:attr:`entered` says one is waiting): a renewal sent before, and answered after,
    whatever the test does meanwhile."""

    def __init__(self, store: FleetStore) -> None:
        self._store = store
        self.hold = False
        self.entered = threading.Event()
        self.go = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def renew(self, *args: Any, **kwargs: Any) -> Renewal | None:
        if self.hold:
            self.entered.set()
            assert self.go.wait(10), "the test never let the renewal go"
        return self._store.renew(*args, **kwargs)


async def _no_peers(peers: Sequence[tuple[str, str]]) -> list[PeerAnswer]:
    return []


def _agent(store: Any, manager: Any) -> FleetAgent:
    return FleetAgent(
        store=store,
        manager=manager,
        identity=NodeIdentity(id="node-a", labels={}, advertise_url="http://127.0.0.1:9/node-a"),
        timing=TIMING,
        policy=PlacementPolicy(),
        artifacts=list,
        ask_peers=_no_peers,
    )


async def test_a_restart_after_the_node_was_declared_lost_starts_clean_without_a_fence(
    tmp_path: Path, postgres_server: PostgresServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Stopped past its grace, the node was declared lost meanwhile; its new process joins,
    # runs no engine, and its first renewal finds the node lost: nothing to stop, so no
    # fence and no warnings -- its launches are held until the reconcile sees what the
    # fleet places here, as after a fence.
    url = postgres_server.create_database()
    store = FleetStore(url)
    try:
        async with runtime_host(tmp_path, deployments={"tiny": TINY}) as host:
            await _agent(store, host.manager).join()
            with psycopg.connect(url, autocommit=True) as connection:
                connection.execute("UPDATE fleet_nodes SET state = 'lost' WHERE id = 'node-a'")
            restarted = _agent(store, host.manager)
            await restarted.join()
            caplog.set_level(logging.INFO, logger="sbproxy.fleet.agent")
            assert await restarted._renew()  # its first renewal, alone
            assert not restarted.fenced
            warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            assert not warned, warned
            assert any("declared lost while it was away" in r.getMessage() for r in caplog.records)
            assert host.manager.held_launches == {"tiny"}
    finally:
        store.close()


async def test_a_running_node_found_lost_stops_every_engine_it_held(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    # Lost means over: a node that was serving (a pause longer than lost_after_ms, say)
    # and finds itself recorded lost kills its engines before anything runs here again.
    url = postgres_server.create_database()
    store = FleetStore(url)
    try:
        async with runtime_host(tmp_path, deployments={"tiny": TINY}) as host:
            agent = _agent(store, host.manager)
            await agent.join()
            assert await agent._renew()
            (await host.manager.acquire("tiny", priority=PriorityClass.STANDARD)).release()
            slot = host.manager.deployment("tiny")
            process = slot.process
            assert process is not None
            with psycopg.connect(url, autocommit=True) as connection:
                connection.execute("UPDATE fleet_nodes SET state = 'lost' WHERE id = 'node-a'")
            assert await agent._renew()
            with anyio.fail_after(10):  # SIGKILLed by the fence: gone at once
                while process.alive():
                    await anyio.sleep(0.02)
            assert host.manager.held_launches == {"tiny"}
    finally:
        store.close()


async def test_a_renewal_under_way_when_the_node_leaves_neither_fences_nor_rejoins(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    # A graceful stop marks the node leaving (releasing its id for the restart) while a
    # renewal is in flight; that renewal then finds the id released. It is this node's
    # own leave, not a twin: no fence (the engines keep draining within the grace) and no
    # join (which would undo the leave, so the replicas would move only once it is lost).
    store = FleetStore(postgres_server.create_database())
    held = HeldRenewals(store)
    try:
        async with runtime_host(tmp_path, deployments={"tiny": TINY}) as host:
            agent = FleetAgent(
                store=held,  # type: ignore[arg-type]
                manager=host.manager,
                identity=NodeIdentity(
                    id="node-a", labels={}, advertise_url="http://127.0.0.1:9/node-a"
                ),
                timing=TIMING,
                policy=PlacementPolicy(),
                artifacts=list,
                ask_peers=_no_peers,
            )
            await agent.join()
            upstream = await host.manager.acquire("tiny", priority=PriorityClass.STANDARD)
            upstream.release()

            held.hold = True
            async with anyio.create_task_group() as group:
                group.start_soon(agent.beat, group)
                await anyio.to_thread.run_sync(held.entered.wait, 10)
                await agent.leave()
                assert agent.left_at is not None
                held.go.set()

            assert not agent.fenced
            [row] = [node for node in store.snapshot().nodes if node.id == "node-a"]
            assert row.leaving_at_ms is not None  # still marked leaving: not joined again
            assert row.instance == ""  # the id stays released for the restart
            [status] = host.manager.status()
            assert status.state is DeploymentState.READY  # its engine was not killed
            # Once leaving, no beat renews again.
            held.hold = False
            async with anyio.create_task_group() as group:
                await agent.beat(group)
            [row] = [node for node in store.snapshot().nodes if node.id == "node-a"]
            assert row.leaving_at_ms is not None and row.instance == ""
    finally:
        store.close()
