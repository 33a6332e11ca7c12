"""The journal's connection threads: one writer with group commit, readers beside it.

Real SQLite files throughout. The writer is held busy by a write that waits on an event (it
runs on the writer's thread), so that the writes submitted meanwhile queue up behind it and
meet the writer together, as they do behind a slow fsync.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from anyio.abc import TaskGroup

from sbproxy.errors import SbproxyError
from sbproxy.store import (
    Database,
    EndedStep,
    JobRecord,
    JobStatus,
    JobStore,
    StepRecord,
    StepStatus,
    StoreError,
    Transaction,
    lane,
    postgres,
)
from tests.support.postgres import PostgresServer

pytestmark = pytest.mark.anyio


@pytest.fixture
async def database(journal_location: Path | str) -> AsyncIterator[Database]:
    opened = await Database.open(journal_location)

    def table(tx: Transaction) -> None:
        tx.execute("CREATE TABLE t (n INTEGER PRIMARY KEY, by TEXT)")

    await opened.write(table)
    try:
        yield opened
    finally:
        await opened.close()


def insert(n: int) -> Callable[[Transaction], int]:
    def work(tx: Transaction) -> int:
        tx.execute("INSERT INTO t (n, by) VALUES (?, 'w')", (n,))
        return n

    return work


async def rows(database: Database) -> list[int]:
    found = await database.read(lambda tx: tx.all("SELECT n FROM t ORDER BY n"))
    return [row[0] for row in found]


class Holder:
    """A write that keeps the writer thread busy until :meth:`release`."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.go = threading.Event()

    def work(self, tx: Transaction) -> str:
        self.started.set()
        assert self.go.wait(10), "the test never released the writer"
        tx.execute("INSERT INTO t (n, by) VALUES (0, 'holder')")
        return "held"

    def release(self) -> None:
        self.go.set()


async def collect(
    group: TaskGroup, results: dict[int, Any], key: int, call: Awaitable[Any]
) -> None:
    async def run() -> None:
        try:
            results[key] = await call
        except Exception as exc:  # noqa: BLE001 - the test looks at what each write met
            results[key] = exc

    group.start_soon(run)


async def hold_then(
    database: Database, writes: dict[int, Callable[[Transaction], Any]]
) -> dict[int, Any]:
    """Run ``writes`` while the writer is held, so that they queue up, then release it."""
    holder = Holder()
    results: dict[int, Any] = {}
    async with anyio.create_task_group() as group:
        await collect(group, results, 0, database.write(holder.work))
        while not holder.started.is_set():
            await anyio.sleep(0.001)
        for key, work in writes.items():
            await collect(group, results, key, database.write(work))
        # Every write is queued once its task waits for its result.
        for _ in range(10):
            await anyio.lowlevel.checkpoint()
        holder.release()
    assert results[0] == "held"
    return results


async def test_writes_that_queue_up_share_one_commit(database: Database) -> None:
    writes_before, commits_before = database.write_counts
    results = await hold_then(database, {n: insert(n) for n in range(1, 9)})
    assert {key: results[key] for key in range(1, 9)} == {n: n for n in range(1, 9)}
    assert await rows(database) == list(range(9))
    writes, commits = database.write_counts
    assert writes - writes_before == 9
    # The holder's commit, then one for the eight that queued behind it.
    assert commits - commits_before == 2


async def test_a_failing_write_in_a_group_fails_alone(database: Database) -> None:
    def broken(tx: Transaction) -> None:
        tx.execute("INSERT INTO t (n, by) VALUES (100, 'broken')")
        raise ValueError("the closure itself fails after a statement")

    def duplicate(tx: Transaction) -> None:
        tx.execute("INSERT INTO t (n, by) VALUES (200, 'duplicate')")
        tx.execute("INSERT INTO t (n, by) VALUES (1, 'duplicate')")  # n = 1 is taken

    results = await hold_then(
        database, {1: insert(1), 2: broken, 3: duplicate, 4: insert(4), 5: insert(5)}
    )
    assert results[1] == 1 and results[4] == 4 and results[5] == 5
    assert isinstance(results[2], ValueError)
    assert isinstance(results[3], sqlite3.IntegrityError)
    # Nothing of the failed writes applied, everything of the others did.
    assert await rows(database) == [0, 1, 4, 5]


SQLITE_ONLY = pytest.mark.parametrize("journal_backend", ["sqlite"], indirect=True)


@SQLITE_ONLY  # SQLite's own disk-full error, raised by the statement hook
async def test_a_full_disk_in_a_group_fails_only_the_write_that_met_it(
    database: Database,
) -> None:
    def unlucky(tx: Transaction) -> None:
        tx.execute("INSERT INTO t (n, by) VALUES (7, 'unlucky')")

    def full_for_the_unlucky(sql: str) -> None:
        if "'unlucky'" in sql:
            raise sqlite3.OperationalError("database or disk is full")

    database.add_statement_hook(full_for_the_unlucky)
    results = await hold_then(database, {1: insert(1), 2: unlucky, 3: insert(3)})
    assert results[1] == 1 and results[3] == 3
    error = results[2]
    assert isinstance(error, StoreError)
    assert error.code == "disk_full"
    assert error.details["path"] == str(database.path)
    assert await rows(database) == [0, 1, 3]


async def test_a_retried_write_runs_its_closure_again_from_the_start(
    database: Database,
) -> None:
    """A group sent back runs each closure again: a closure's own state resets each run."""
    runs: list[int] = []

    def counted(tx: Transaction) -> int:
        runs.append(1)
        tx.execute("INSERT INTO t (n, by) VALUES (3, 'counted')")
        return len(runs)

    def explode(tx: Transaction) -> None:
        raise RuntimeError("boom")

    results = await hold_then(database, {1: counted, 2: explode})
    assert isinstance(results[2], RuntimeError)
    assert results[1] == 2  # once in the group, once alone
    assert await rows(database) == [0, 3]


async def test_a_cancelled_caller_waits_until_its_write_ended(database: Database) -> None:
    holder = Holder()
    seen: dict[str, Any] = {}
    async with anyio.create_task_group() as group:
        group.start_soon(database.write, holder.work)
        while not holder.started.is_set():
            await anyio.sleep(0.001)

        async def cancelled_writer() -> None:
            with anyio.CancelScope() as scope:
                seen["scope"] = scope
                await database.write(insert(5))
            # Past the write: it ended (committed) before the cancellation took effect.
            seen["rows_after"] = await rows(database)

        group.start_soon(cancelled_writer)
        for _ in range(10):
            await anyio.lowlevel.checkpoint()
        seen["scope"].cancel()
        await anyio.sleep(0.05)
        assert "rows_after" not in seen  # still waiting for the held writer
        holder.release()
    assert seen["rows_after"] == [0, 5]


async def test_a_read_does_not_wait_for_a_write(database: Database) -> None:
    holder = Holder()
    async with anyio.create_task_group() as group:
        group.start_soon(database.write, holder.work)
        while not holder.started.is_set():
            await anyio.sleep(0.001)
        with anyio.fail_after(5):
            assert await rows(database) == []  # the held write is not committed yet
        holder.release()
    assert await rows(database) == [0]


async def test_readers_cannot_write(database: Database) -> None:
    with pytest.raises(StoreError) as raised:
        await database.read(insert(1))
    assert raised.value.code == "store_failed"
    # SQLite: "attempt to write a readonly database"; PostgreSQL: "cannot execute INSERT in
    # a read-only transaction".
    assert "readonly" in raised.value.message or "read-only" in raised.value.message


async def test_close_finishes_queued_writes_and_refuses_later_ones(tmp_path: Path) -> None:
    database = await Database.open(tmp_path / "journal.db")
    await database.write(lambda tx: tx.execute("CREATE TABLE t (n INTEGER PRIMARY KEY)"))
    done: list[int] = []

    async def write(n: int) -> None:
        await database.write(lambda tx: tx.execute("INSERT INTO t VALUES (?)", (n,)))
        done.append(n)

    async with anyio.create_task_group() as group:
        for n in range(20):
            group.start_soon(write, n)
        await anyio.lowlevel.checkpoint()
        group.start_soon(database.close)
    assert sorted(done) == list(range(20))
    for call in (database.write, database.read):
        with pytest.raises(StoreError) as raised:
            await call(lambda tx: tx.scalar("SELECT 1"))
        assert raised.value.code == "store_failed"
        assert "is closed" in raised.value.message
    with sqlite3.connect(tmp_path / "journal.db") as raw:
        assert raw.execute("SELECT COUNT(*) FROM t").fetchone()[0] == 20


@SQLITE_ONLY  # another sqlite3 connection holds SQLite's write lock
async def test_write_tallies_show_the_wait_behind_another_connection_lock(
    database: Database,
) -> None:
    """Another connection (as another process would) holds the write lock for 0.3 s: the
    next write's wait is counted at that length, its commit apart from it."""
    waits_before, commits_before, _ = database.write_tallies.snapshot()
    other = sqlite3.connect(
        database.path, isolation_level=None, timeout=10, check_same_thread=False
    )
    try:
        other.execute("BEGIN IMMEDIATE")
        holding = threading.Timer(0.3, lambda: other.execute("COMMIT"))
        holding.start()
        assert await database.write(insert(1)) == 1
        holding.join()
    finally:
        other.close()
    waits, commits, _ = database.write_tallies.snapshot()
    assert waits.count == waits_before.count + 1
    assert waits.total_s - waits_before.total_s >= 0.25
    # Counted in a bucket above 0.25 s (cumulative counts: the 0.25 s bucket did not grow).
    by_bound = dict(waits.cumulative())
    before = dict(waits_before.cumulative())
    assert by_bound["0.25"] == before["0.25"]
    assert by_bound["+Inf"] == before["+Inf"] + 1
    assert commits.count == commits_before.count + 1
    assert commits.total_s - commits_before.total_s < 0.25  # the wait is not the commit's


async def test_write_tallies_count_group_sizes(database: Database) -> None:
    _, _, groups_before = database.write_tallies.snapshot()
    await hold_then(database, {n: insert(n) for n in range(1, 9)})
    _, _, groups = database.write_tallies.snapshot()
    assert groups.count == groups_before.count + 2  # the holder alone, then eight together
    assert groups.total_s == groups_before.total_s + 9


# -- PostgreSQL: round trips and commits that need not wait for the WAL ---------------------


class SentQueries:
    """The query strings the PostgreSQL connections send (a spy on the real send: every
    query still runs on the server)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.queries: list[str] = []
        real, real_prepared, real_alone = postgres._run, postgres._run_prepared, postgres._run_alone

        def spy(connection: Any, text: str, params: Any, *, skip: int = 0) -> Any:
            self.queries.append(text)
            return real(connection, text, params, skip=skip)

        def spy_prepared(
            connection: Any, held: Sequence[str], text: str, params: Any, tail: Sequence[str]
        ) -> Any:
            # One pipeline, one round trip: shown as the statements it sends, in order.
            self.queries.append("; ".join([*held, text, *tail]))
            return real_prepared(connection, held, text, params, tail)

        def spy_alone(connection: Any, text: str, params: Any, *, prepared: bool) -> Any:
            # A whole transaction in one statement: sent alone, the server commits it.
            self.queries.append(text)
            return real_alone(connection, text, params, prepared=prepared)

        real_lane, real_lane_first = lane._send_alone, lane._first_prepared

        async def spy_lane(connection: Any, text: str, values: Any, *, prepared: bool) -> Any:
            # The statement lane (a write of one statement, from the event loop): alone too.
            self.queries.append(text)
            return await real_lane(connection, text, values, prepared=prepared)

        async def spy_lane_first(connection: Any, text: str, values: Any) -> Any:
            self.queries.append(text)
            return await real_lane_first(connection, text, values)

        monkeypatch.setattr(postgres, "_run", spy)
        monkeypatch.setattr(postgres, "_run_prepared", spy_prepared)
        monkeypatch.setattr(postgres, "_run_alone", spy_alone)
        monkeypatch.setattr(lane, "_send_alone", spy_lane)
        monkeypatch.setattr(lane, "_first_prepared", spy_lane_first)

    def take(self) -> list[str]:
        taken, self.queries = self.queries, []
        return taken


def last_insert(n: int) -> Callable[[Transaction], int]:
    def work(tx: Transaction) -> int:
        tx.last("INSERT INTO t (n, by) VALUES (?, 'last')", (n,))
        return n

    return work


on_postgresql = pytest.mark.parametrize("journal_backend", ["postgresql"], indirect=True)


@on_postgresql
async def test_a_last_statement_travels_with_its_commit_in_one_round_trip(
    database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent = SentQueries(monkeypatch)
    assert await database.write(last_insert(1)) == 1
    # The whole transaction is one statement: sent alone, the server commits it itself.
    [query] = sent.take()
    assert query == "INSERT INTO t (n, by) VALUES (%s, 'last')"
    assert await rows(database) == [1]
    sent.take()  # the read's
    # After something else of the transaction was sent, it travels with the COMMIT.

    def two(tx: Transaction) -> None:
        tx.execute("INSERT INTO t (n, by) VALUES (2, 'w')")
        tx.last("INSERT INTO t (n, by) VALUES (3, 'last')")

    await database.write(two)
    first, last = sent.take()
    assert first.startswith("BEGIN; INSERT INTO t")
    assert last.startswith("INSERT INTO t") and last.endswith("; COMMIT")
    assert not any("synchronous_commit" in query for query in (first, last))
    assert await rows(database) == [1, 2, 3]
    # A write in which nothing reached the server sends nothing at all.
    sent.take()  # the read's

    def nothing(tx: Transaction) -> str:
        return "nothing"

    assert await database.write(nothing) == "nothing"
    assert sent.take() == []


@on_postgresql
async def test_a_failed_last_statement_commits_nothing(database: Database) -> None:
    assert await database.write(insert(1)) == 1

    def duplicate_then_more(tx: Transaction) -> None:
        tx.execute("INSERT INTO t (n, by) VALUES (2, 'w')")
        tx.last("INSERT INTO t (n, by) VALUES (1, 'again')")

    with pytest.raises(sqlite3.IntegrityError):
        await database.write(duplicate_then_more)
    # Neither statement of the failed write applied, and the writer goes on.
    assert await database.write(insert(3)) == 3
    assert await rows(database) == [1, 3]


async def claimed_demo_job(store: JobStore) -> tuple[JobRecord, int]:
    """A new ``demo`` job claimed by owner ``w``: the job and its attempt."""
    job = (await store.submit(kind="demo", workflow_version=1, input_json="{}")).job
    claimed = await store.claim(owner="w", lease_ms=60_000, job_id=job.id)
    assert claimed is not None
    return job, claimed.attempt


@on_postgresql
async def test_a_step_start_and_end_are_one_round_trip_each_and_both_wait_for_the_wal(
    database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = JobStore(database)
    job, attempt = await claimed_demo_job(store)
    sent = SentQueries(monkeypatch)
    started = await store.begin_step(job.id, owner="w", attempt=attempt, seq=0, name="s")
    [start] = sent.take()
    assert await store.end_step(
        job.id, owner="w", attempt=attempt, seq=0, name="s", output_json="1"
    )
    [end] = sent.take()
    # Each is its own transaction: one statement, sent alone, committed by the server.
    assert start.startswith("WITH started AS (INSERT INTO steps") and "COMMIT" not in start
    assert end.startswith("WITH ended AS (UPDATE steps") and "COMMIT" not in end
    # Neither commit gives up waiting for the WAL flush: a start a reader saw survives.
    assert not any("synchronous_commit" in query for query in (start, end))
    # What they wrote: the step, its two events, and the start's answer.
    assert isinstance(started, StepRecord) and started.attempts == 1
    [step] = await store.steps(job.id)
    assert (step.status, step.output_json) == (StepStatus.SUCCEEDED, "1")
    events = [event.data for event in await store.events(job.id) if event.type == "step"]
    assert [data["status"] for data in events] == ["running", "succeeded"]


@on_postgresql
async def test_a_step_end_and_the_next_start_are_one_round_trip(
    database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = JobStore(database)
    job, attempt = await claimed_demo_job(store)
    assert isinstance(
        await store.begin_step(job.id, owner="w", attempt=attempt, seq=0, name="a"), StepRecord
    )
    sent = SentQueries(monkeypatch)
    ending = EndedStep(seq=0, name="a", output_json="1")
    started = await store.begin_step(
        job.id, owner="w", attempt=attempt, seq=1, name="b", ending=ending
    )
    # One statement, sent alone: the end of step a, the start of step b, their events.
    [query] = sent.take()
    assert query.startswith("WITH ended AS (UPDATE steps") and "started AS (" in query
    assert "COMMIT" not in query and "synchronous_commit" not in query
    assert isinstance(started, StepRecord) and (started.seq, started.name) == (1, "b")
    steps = [(step.seq, step.status, step.output_json) for step in await store.steps(job.id)]
    assert steps == [(0, StepStatus.SUCCEEDED, "1"), (1, StepStatus.RUNNING, None)]
    # The end's event comes before the start's: a reader never sees b start before a ended.
    events = [event.data for event in await store.events(job.id) if event.type == "step"]
    assert [(data["seq"], data["status"]) for data in events] == [
        (0, "running"),
        (0, "succeeded"),
        (1, "running"),
    ]


async def test_prepare_threshold_is_read_from_the_url_and_kept_from_libpq() -> None:
    off = postgres.PgTarget.parse(
        "postgresql://u@db:6432/jobs?sslmode=disable&prepare_threshold=none"
    )
    assert off.prepared_statements is False
    assert off.conninfo == "postgresql://u@db:6432/jobs?sslmode=disable"  # libpq never sees it
    assert (off.address, off.dbname) == ("db:6432", "jobs")
    kept = postgres.PgTarget.parse("postgresql://u@db/jobs?prepare_threshold=5")
    assert kept.prepared_statements is True and kept.conninfo == "postgresql://u@db/jobs"
    assert postgres.PgTarget.parse("postgresql://u@db/jobs").prepared_statements is True
    with pytest.raises(SbproxyError) as bad:
        postgres.PgTarget.parse("postgresql://u:secret@db/jobs?prepare_threshold=often")
    assert bad.value.code == "invalid_config"
    assert "prepare_threshold='often'" in str(bad.value) and "secret" not in str(bad.value)


async def prepared_on_the_writers(location: str) -> int:
    """Run a job's hot statements on a fresh journal at ``location``; how many statements
    the writing server sessions (the writer thread's and the statement lane's) hold
    prepared afterwards."""
    database = await Database.open(location)
    try:
        store = JobStore(database)
        job, attempt = await claimed_demo_job(store)
        assert isinstance(
            await store.begin_step(job.id, owner="w", attempt=attempt, seq=0, name="a"), StepRecord
        )
        ending = EndedStep(seq=0, name="a", output_json="1")
        step = await store.begin_step(
            job.id, owner="w", attempt=attempt, seq=1, name="b", ending=ending
        )
        assert isinstance(step, StepRecord)
        assert await store.end_step(
            job.id, owner="w", attempt=attempt, seq=1, name="b", output_json="2"
        )
        done = await store.finish(
            job.id, owner="w", attempt=attempt, status=JobStatus.SUCCEEDED, keep_finished=4
        )
        assert done is not None and done.status == JobStatus.SUCCEEDED
        assert [s.output_json for s in await store.steps(job.id)] == ["1", "2"]
        count = "SELECT count(*) FROM pg_prepared_statements"
        on_the_writer = await database.write(lambda tx: tx.scalar(count))
        [on_the_lane] = await database.write_statement(count)
        return int(on_the_writer) + int(on_the_lane[0])
    finally:
        await database.close()


async def test_prepare_threshold_none_prepares_nothing_on_the_server(
    postgres_server: PostgresServer,
) -> None:
    # PgBouncer's transaction pooling hands each transaction a server session of its own
    # choosing: a statement prepared on one is unknown on the next. With
    # prepare_threshold=none the journal prepares nothing and works the same.
    assert await prepared_on_the_writers(postgres_server.create_database()) > 0
    url = postgres_server.create_database() + "?prepare_threshold=none"
    assert await prepared_on_the_writers(url) == 0


@on_postgresql
async def test_a_claim_reads_the_servers_clock_under_the_lease_lock_in_one_round_trip(
    database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = JobStore(database)
    job = (await store.submit(kind="demo", workflow_version=1, input_json="{}")).job

    def server_ms(tx: Transaction) -> int:
        return int(tx.scalar("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint"))

    before = await database.write(server_ms)
    sent = SentQueries(monkeypatch)
    claimed = await store.claim(owner="w", lease_ms=60_000, job_id=job.id)
    [query] = sent.take()
    after = await database.write(server_ms)
    # The lock, the clock read under it, the claim and its event: one statement, alone.
    assert query.startswith("WITH locked AS MATERIALIZED (SELECT pg_advisory_xact_lock(")
    assert "UPDATE jobs SET status = 'running'" in query and "COMMIT" not in query
    assert claimed is not None and claimed.attempt == 1
    [(clock, deadline, lease_ms)] = await database.read(
        lambda tx: [
            tuple(row)
            for row in tx.all(
                "SELECT lease_clock, lease_deadline_ms, lease_ms FROM jobs WHERE id = :id",
                {"id": job.id},
            )
        ]
    )
    # Stamped on the server's clock, never this host's.
    assert (clock, lease_ms) == ("postgresql", 60_000)
    assert before + 60_000 <= deadline <= after + 60_000
    # The host's view of the server's clock follows what the claim read.
    assert before <= store.lease_clock().ms <= after + 1_000
    # Claimed already: a second claim changes nothing.
    assert await store.claim(owner="x", lease_ms=60_000, job_id=job.id) is None


@on_postgresql
async def test_a_read_of_one_select_is_one_round_trip(
    database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = JobStore(database)
    job = (await store.submit(kind="demo", workflow_version=1, input_json="{}")).job
    sent = SentQueries(monkeypatch)
    assert (await store.get(job.id)) == job
    assert await store.steps(job.id) == []
    # Each is one SELECT, its snapshot its own: no BEGIN before it, no ROLLBACK after.
    assert sent.take() == [
        "SELECT * FROM jobs WHERE id = %(id)s",
        "SELECT * FROM steps WHERE job_id = %(id)s ORDER BY seq",
    ]
    # A read that does not say its statement is its last keeps its snapshot transaction.
    assert await store.last_event_seq(job.id) > 0
    opened, ended = sent.take()
    assert opened.startswith("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; SELECT")
    assert ended == "ROLLBACK"
