"""Every call to the PostgreSQL journal has a client-side deadline: a server that goes
silent -- a relay that swallows every byte (a blackholed route), or a frozen server
(``SIGSTOP``: its kernel still acknowledges, so TCP alone never gives up) -- makes a call
fail ``journal_unavailable`` within a bound, never hang; once the server answers again the
next call runs on a fresh connection. A node's renewal has a connection of its own, so a
slow controller transaction never holds it up; a migration, which may wait long for another
host's, has a long deadline of its own."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import psycopg
import pytest

from sbproxy.errors import SbproxyError
from sbproxy.store import Database, JobStore
from sbproxy.store.fleet import CONNECT_TIMEOUT_S, STATEMENT_DEADLINE_S, FleetStore, Renewal
from sbproxy.store.postgres import (
    MIGRATION_LOCK_KEY,
    UNAVAILABLE_WITHIN_S,
    JournalUnavailable,
    PgConnection,
    PgTarget,
)
from tests.support.postgres import PostgresServer
from tests.support.relayed_journal import relayed_journal
from tests.support.tcp_relay import TcpRelay

T = TypeVar("T")

# Slack on a bound for this shared, slow machine (the bound itself is what a caller sees).
SLACK_S = 3.0
RENEWAL_BOUND_S = CONNECT_TIMEOUT_S + STATEMENT_DEADLINE_S


def _through(url: str, server: PostgresServer, relay: TcpRelay) -> str:
    return url.replace(f"127.0.0.1:{server.port}/", f"127.0.0.1:{relay.port}/", 1)


def _within(seconds: float, call: Callable[[], T]) -> tuple[T | BaseException, float]:
    """Run ``call`` on a thread; its result (or what it raised) and how long it took. A call
    still running after ``seconds`` fails the test (it is left blocked on its daemon thread
    until the relay closes)."""
    outcome: list[T | BaseException] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    elapsed = time.monotonic() - started
    assert outcome, f"the call still waited after {elapsed:.1f} s (no deadline)"
    return outcome[0], elapsed


async def _awaited_within(seconds: float, call: Awaitable[T]) -> tuple[T | BaseException, float]:
    """As :func:`_within` for a store coroutine (whose wait is shielded from cancellation)."""
    task = asyncio.ensure_future(call)
    started = time.monotonic()
    await asyncio.wait({task}, timeout=seconds)
    elapsed = time.monotonic() - started
    assert task.done(), f"the call still waited after {elapsed:.1f} s (no deadline)"
    exc = task.exception()
    return (exc if exc is not None else task.result()), elapsed


def _unavailable(outcome: object, server_port: int) -> None:
    assert isinstance(outcome, SbproxyError), outcome
    assert outcome.code == "journal_unavailable", outcome
    assert outcome.retryable
    assert f"127.0.0.1:{server_port}" in str(outcome), outcome


def _join(store: FleetStore, node: str) -> int:
    return store.join(
        node,
        advertise_url=None,
        labels={},
        engines=["llama_cpp"],
        devices=[{"index": 0, "capacity_bytes": 1000}],
        artifacts=[],
    )


def _backends(url: str, *, waiting_on_lock: bool = False) -> set[int]:
    """The server pids of the other sessions on ``url``'s database (only those waiting on a
    lock, with ``waiting_on_lock``)."""
    with psycopg.connect(url, autocommit=True) as connection:
        rows = connection.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND (NOT %s OR wait_event_type = 'Lock')",
            (waiting_on_lock,),
        ).fetchall()
    return {int(row[0]) for row in rows}


def test_a_renewal_through_a_blackholed_link_fails_within_its_deadline_then_reconnects(
    postgres_server: PostgresServer,
) -> None:
    url = postgres_server.create_database()
    with TcpRelay(postgres_server.port) as relay:
        store = FleetStore(_through(url, postgres_server, relay))
        try:
            _join(store, "n1")
            before = _backends(url)
            assert before  # the store's membership connection

            relay.blackhole()
            # On the kept connection: the statement gets no answer.
            outcome, took = _within(
                RENEWAL_BOUND_S + SLACK_S, lambda: store.renew("n1", replicas={})
            )
            _unavailable(outcome, relay.port)
            assert isinstance(outcome, JournalUnavailable)
            assert "deadline" in str(outcome), outcome
            assert took < RENEWAL_BOUND_S + SLACK_S
            # Dropped: the next one connects afresh, and the handshake gets no answer.
            outcome, took = _within(
                RENEWAL_BOUND_S + SLACK_S, lambda: store.renew("n1", replicas={})
            )
            _unavailable(outcome, relay.port)
            assert took < RENEWAL_BOUND_S + SLACK_S

            relay.heal()
            renewed = store.renew("n1", replicas={"chat": {"ready": 1}})
            assert renewed is not None and renewed.now_ms is not None
            assert _backends(url) - before  # it ran on a fresh connection (a new backend)
        finally:
            store.close()


def test_a_renewal_is_not_held_up_by_a_slow_controller_transaction(
    postgres_server: PostgresServer,
) -> None:
    url = postgres_server.create_database()
    # A deadline long enough that the blocked controller call outlives the renewal by far.
    store = FleetStore(url, statement_deadline_s=20.0)
    try:
        _join(store, "n1")
        lease = store.hold_controller("n1", lease_ms=60_000)
        assert lease is not None
        with psycopg.connect(url) as other:
            # Another session holds the controller row: a controller write (its fence takes
            # the row FOR SHARE) waits on the server, holding its connection.
            other.execute("SELECT * FROM fleet_controller WHERE id = 1 FOR UPDATE")
            control = threading.Thread(
                target=lambda: store.move_node(lease, "n1", from_state="ready", to="suspect"),
                daemon=True,
            )
            control.start()
            _poll(
                lambda: bool(_backends(url, waiting_on_lock=True)),
                what="the controller call waits on the row lock",
            )
            outcome, took = _within(10.0, lambda: store.renew("n1", replicas={}))
            assert isinstance(outcome, Renewal) and outcome.now_ms is not None, outcome
            assert control.is_alive()  # the renewal did not wait for the controller call
            assert took < 10.0
            other.rollback()
        control.join(30)
        assert not control.is_alive()
    finally:
        store.close()


def _poll(predicate: Callable[[], bool], *, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)


@pytest.mark.anyio
async def test_a_journal_write_through_a_blackholed_link_is_journal_unavailable_in_time(
    postgres_server: PostgresServer,
) -> None:
    async with relayed_journal(postgres_server) as (relay, _database, store):
        await store.submit(kind="demo", workflow_version=1, input_json="{}")
        relay.blackhole()
        for _ in range(2):  # on the kept connection, then on a reconnect
            outcome, took = await _awaited_within(
                UNAVAILABLE_WITHIN_S + SLACK_S,
                store.submit(kind="demo", workflow_version=1, input_json="{}"),
            )
            _unavailable(outcome, relay.port)
            assert took < UNAVAILABLE_WITHIN_S + SLACK_S
        read, took = await _awaited_within(UNAVAILABLE_WITHIN_S + SLACK_S, store.list_jobs(limit=5))
        _unavailable(read, relay.port)  # a read, on a reader connection
        assert took < UNAVAILABLE_WITHIN_S + SLACK_S
        relay.heal()
        again = await store.submit(kind="demo", workflow_version=1, input_json="{}")
        assert (await store.get(again.job.id)) is not None


@pytest.mark.anyio
async def test_queued_writes_meet_one_outage_not_one_wait_each(
    postgres_server: PostgresServer,
) -> None:
    async with relayed_journal(postgres_server) as (relay, _database, store):
        await store.submit(kind="demo", workflow_version=1, input_json="{}")
        relay.blackhole()
        writes = [store.submit(kind="demo", workflow_version=1, input_json="{}") for _ in range(6)]
        started = time.monotonic()
        outcomes = await asyncio.wait_for(
            asyncio.gather(*writes, return_exceptions=True), 2 * UNAVAILABLE_WITHIN_S + 30
        )
        took = time.monotonic() - started
        for outcome in outcomes:
            _unavailable(outcome, relay.port)
        # All of them within about one bound, not six deadlines or reconnects in a row.
        assert took < UNAVAILABLE_WITHIN_S + SLACK_S, took


def _cluster_pids(server: PostgresServer) -> list[int]:
    """The postmaster's pid and its children's (the backends, the background workers)."""
    postmaster = int((server.data_dir / "postmaster.pid").read_text().splitlines()[0])
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": the comm may hold spaces, so split after its ")".
        if int(stat.rsplit(")", 1)[1].split()[1]) == postmaster:
            children.append(int(entry.name))
    return [postmaster, *children]


@contextmanager
def _frozen(server: PostgresServer) -> Iterator[None]:
    """The whole server stopped (``SIGSTOP``) until the block ends (``SIGCONT``)."""
    pids = _cluster_pids(server)
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


@pytest.mark.anyio
async def test_a_journal_write_to_a_frozen_server_is_journal_unavailable_in_time(
    own_postgres_server: PostgresServer,
) -> None:
    database = await Database.open(own_postgres_server.create_database())
    store = JobStore(database)
    try:
        await store.submit(kind="demo", workflow_version=1, input_json="{}")
        with _frozen(own_postgres_server):
            outcome, took = await _awaited_within(
                UNAVAILABLE_WITHIN_S + SLACK_S,
                store.submit(kind="demo", workflow_version=1, input_json="{}"),
            )
            _unavailable(outcome, own_postgres_server.port)
            assert took < UNAVAILABLE_WITHIN_S + SLACK_S
        again = await store.submit(kind="demo", workflow_version=1, input_json="{}")
        assert (await store.get(again.job.id)) is not None
    finally:
        await database.close()


def test_a_migration_waits_past_the_statement_deadline_for_another_host_s_migration(
    postgres_server: PostgresServer,
) -> None:
    url = postgres_server.create_database()
    # A deadline far shorter than the other host's migration below takes.
    connection = PgConnection(PgTarget.parse(url), read_only=False, deadline_s=0.5)
    try:
        with psycopg.connect(url) as other:
            other.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))

            def migrate() -> object:
                connection.execute("BEGIN")
                connection.execute(
                    "SELECT pg_advisory_xact_lock(:key)", {"key": MIGRATION_LOCK_KEY}
                )
                connection.execute("COMMIT")
                return "migrated"

            outcome: list[object] = []
            waiter = threading.Thread(target=lambda: outcome.append(_caught(migrate)))
            waiter.start()

            def waited_s() -> float:
                # A fresh session each time: pg_stat_activity is read once per transaction.
                with psycopg.connect(url, autocommit=True) as looking:
                    row = looking.execute(
                        "SELECT COALESCE(MAX(EXTRACT(EPOCH FROM"
                        " clock_timestamp() - query_start)), 0)"
                        " FROM pg_stat_activity WHERE wait_event = 'advisory'"
                        " AND datname = current_database()"
                    ).fetchone()
                return float(row[0]) if row else 0.0

            # The server's own clock says the migration has waited four deadlines.
            _poll(lambda: waited_s() > 2.0 or not waiter.is_alive(), what="the wait")
            other.rollback()  # the other host's migration ends
            waiter.join(30)
        assert outcome == ["migrated"], outcome
    finally:
        connection.close()


def _caught(call: Callable[[], object]) -> object:
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - handed to the test
        return exc


@pytest.mark.anyio
async def test_a_write_queued_behind_a_lost_statement_runs_once_the_link_is_back(
    postgres_server: PostgresServer,
) -> None:
    # A write that waits on the writer thread behind a statement lost in a silent link is
    # not refused for that statement's outage when the link came back meanwhile: it tries
    # the server once (a reconnect) before it is refused, and here runs.
    async with relayed_journal(postgres_server) as (relay, database, store):
        await store.submit(kind="demo", workflow_version=1, input_json="{}")
        relay.blackhole()
        lost = asyncio.ensure_future(
            database.write(lambda tx: tx.execute("UPDATE jobs SET updated_at_ms = 1"))
        )
        await _until_async(lambda: relay.dropped > 0, what="the statement is in the hole")
        relay.heal()
        queued = asyncio.ensure_future(
            store.submit(kind="demo", workflow_version=1, input_json="{}")
        )
        outcome, _ = await _awaited_within(UNAVAILABLE_WITHIN_S + SLACK_S, lost)
        _unavailable(outcome, relay.port)  # its answer never comes: the deadline
        answer, _ = await _awaited_within(UNAVAILABLE_WITHIN_S + SLACK_S, queued)
        assert not isinstance(answer, BaseException), answer
        assert (await store.get(answer.job.id)) is not None


async def _until_async(predicate: Callable[[], bool], *, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(0.01)
