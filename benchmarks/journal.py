"""What durability costs: journaled steps per second, sbproxy against DBOS Transact.

Contenders, each on a fresh journal in ``--dir``, all doing the same durable work -- jobs of
``--steps`` trivial steps, one job at a time, every step's output journaled before the step
returns, the job's start and outcome recorded:

* ``sbproxy``: the real engine (``WorkflowEngine.submit`` + ``join``: submit, claim,
  replay-aware ``ctx.step``, lease heartbeat, finish, history pruning) with
  ``synchronous=FULL``;
* ``sbproxy_normal``: the same with ``synchronous=NORMAL`` (commits not fsynced), to show
  what the fsyncs cost;
* ``dbos``: DBOS Transact (``@DBOS.workflow()`` calling ``@DBOS.step()`` functions, called
  synchronously) on a SQLite system database, when the ``dbos`` package is installed (the
  ``dev`` extra); skipped, and said so, when it is not. ``--dbos-journal default`` leaves
  DBOS's own SQLite setup (rollback journal, SQLite's default ``synchronous=FULL``);
  ``wal`` switches its file to WAL first, the journal mode sbproxy uses;
* with ``--postgres``: ``sbproxy_postgresql`` (the engine on a PostgreSQL journal) and
  ``dbos_postgresql`` (DBOS's production configuration) on the same server, beside the
  SQLite contenders. DBOS is a process-wide singleton, so each DBOS contender runs in a
  process of its own (the parent waits meanwhile; the timings are taken in the workflow).

The contenders run interleaved in one process: ``--rounds`` rounds, each running
``jobs / rounds`` jobs of every contender, in an order that rotates from round to round, so
that a noisy neighbour hits all of them alike. It prints ONE JSON object on stdout:

* per contender: ``durable_steps_per_s`` (journaled steps per wall-clock second over its
  measured jobs, submit to outcome included), ``step_overhead_ms`` (each step call timed
  from inside the workflow: a trivial step does nothing, so this is the journal's cost per
  step; p50/p95/p99/mean/max), ``job_ms`` (start to outcome per job);
* ``sbproxy_over_dbos``: sbproxy's steps/s over DBOS's, and DBOS's step p50 and p95 over
  sbproxy's (above 1: sbproxy is faster), with the targets of issue 31 (step p50 at most
  0.7 ms, steps/s at least 3 times DBOS's);
* ``full_over_normal``: what FULL costs over NORMAL for sbproxy;
* ``raw_sqlite_commit_ms``: a one-row ``BEGIN IMMEDIATE`` commit through the stdlib driver
  (WAL, FULL and NORMAL), the floor that fsync sets, measured in every round too (as many
  commits as a contender ran steps);
* ``postgresql`` (with ``--postgres``): the floors there, measured the same way -- a
  one-row committed ``INSERT`` (``raw_commit_ms``) and the statement the journal sends for a
  step, executed straight through psycopg (``step_statement_ms``: what the server does for
  a step) -- and sbproxy's step p50 over each, its steps/s over DBOS's; ``smaller_records``:
  what smaller step records cost there (the end and the start as two fenced row writes
  without their events; one fenced row alone), each over the one-row commit, and
  ``one_row_plus_client_share_over_raw_commit_p50``: the smallest record plus sbproxy's own
  share of a step (its step p50 less the statement's), the ratio a journal writing one row
  per step would reach;
* ``claims``: claims per second with 4 processes competing for one journal's queue of
  ``--claim-jobs`` jobs (each process opens the journal, they start together at a barrier
  and claim until none is left), on SQLite and, with ``--postgres``, on PostgreSQL;
  ``claimed_twice`` must be 0;
* ``environment``: versions, CPUs, and the directory and file system of the journals
  (tmpfs makes fsync free: point ``--dir`` at a real disk).

Usage: ``python benchmarks/journal.py [--jobs 40] [--steps 5] [--warmup 2] [--rounds 4]
[--dir PATH] [--dbos-journal default|wal] [--no-dbos] [--postgres auto|URL]
[--claim-jobs 400]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.metadata
import importlib.util
import json
import multiprocessing
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
from pydantic import BaseModel

from sbproxy.store import EndedStep, StepStatus, Synchronous, jobs
from sbproxy.store.journal import open_journal
from sbproxy.store.postgres import translate
from sbproxy.workflows import Registry, StepContext, WorkflowContext, WorkflowEngine, step

registry = Registry()

# Where the running contender's workflow body appends each step call's duration (seconds).
_timings: list[list[float]] = [[]]

# The targets (issue 31, item 2): on SQLite, the step p50 and steps/s over DBOS on
# SQLite; on PostgreSQL, steps/s over DBOS there and the step p50 over the one-row commit.
TARGET_STEP_P50_MS = 0.7
TARGET_OVER_DBOS = 3.0
TARGET_PG_OVER_DBOS = 2.0
TARGET_PG_STEP_OVER_COMMIT = 2.0


class BenchInput(BaseModel):
    steps: int


@step("bench")
async def trivial(ctx: StepContext, value: int) -> int:
    """Do nothing but return a value, so only the journal's cost is measured.

    Idempotency: pure.
    """
    return value + 1


@registry.workflow("bench", version=1)
async def bench(ctx: WorkflowContext, arg: BenchInput) -> int:
    value = 0
    for index in range(arg.steps):
        started = time.perf_counter()
        value = await ctx.step(trivial, value, name=f"bench:{index}")
        _timings[0].append(time.perf_counter() - started)
    return value


class Contender:
    """One way of running the jobs; subclasses open, run one job and close."""

    name = ""

    def __init__(self, *, steps: int, directory: Path) -> None:
        self.steps = steps
        self.directory = directory
        self.step_times: list[float] = []
        self.job_times: list[float] = []
        self.wall_s = 0.0

    async def open(self) -> None:
        raise NotImplementedError

    async def one_job(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError

    async def run(self, jobs: int, *, measured: bool) -> None:
        """Run ``jobs`` jobs one after another; keep their timings when ``measured``."""
        step_times: list[float] = []
        job_times: list[float] = []
        _timings[0] = step_times
        started = time.perf_counter()
        for _ in range(jobs):
            job_started = time.perf_counter()
            await self.one_job()
            job_times.append(time.perf_counter() - job_started)
        wall_s = time.perf_counter() - started
        assert len(step_times) == jobs * self.steps, (len(step_times), jobs, self.steps)
        if measured:
            self.step_times += step_times
            self.job_times += job_times
            self.wall_s += wall_s

    def report(self) -> dict[str, Any]:
        steps = len(self.step_times)
        return {
            **self.describe(),
            "jobs": len(self.job_times),
            "steps_per_job": self.steps,
            "durable_steps": steps,
            "wall_s": round(self.wall_s, 3),
            "durable_steps_per_s": round(steps / self.wall_s, 1) if self.wall_s else None,
            "step_overhead_ms": _summary_ms(self.step_times),
            "job_ms": _summary_ms(self.job_times),
        }


class Sbproxy(Contender):
    """sbproxy's engine: submit, then run the job in this process (the CLI's path)."""

    def __init__(self, mode: Synchronous, *, steps: int, directory: Path) -> None:
        super().__init__(steps=steps, directory=directory)
        self.mode = mode
        self.name = "sbproxy" if mode == "FULL" else "sbproxy_normal"
        self.engine: WorkflowEngine | None = None
        self.path = directory / "journal.db"

    async def open(self) -> None:
        self.engine = await WorkflowEngine.open(self.path, registry, synchronous=self.mode)

    async def one_job(self) -> None:
        assert self.engine is not None
        submitted = await self.engine.submit(bench, BenchInput(steps=self.steps))
        job = await self.engine.join(submitted.job.id)
        assert job.status == "succeeded", job.to_dict()

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.close()

    def describe(self) -> dict[str, Any]:
        return {
            "contender": self.name,
            "engine": "sbproxy.workflows.WorkflowEngine (submit + join)",
            "journal": {"journal_mode": _journal_mode(self.path), "synchronous": self.mode},
        }


class SbproxyPostgres(Sbproxy):
    """sbproxy's engine on a PostgreSQL journal (same workflow, same path)."""

    def __init__(self, url: str, *, steps: int, directory: Path) -> None:
        super().__init__("FULL", steps=steps, directory=directory)
        self.name = "sbproxy_postgresql"
        self.url = url

    async def open(self) -> None:
        self.settings = _server_settings(self.url)
        self.engine = await WorkflowEngine.open(self.url, registry)

    def describe(self) -> dict[str, Any]:
        return {
            "contender": self.name,
            "engine": "sbproxy.workflows.WorkflowEngine (submit + join), psycopg 3",
            "journal": {"postgresql": self.settings},
        }


class Dbos(Contender):
    """DBOS Transact: a ``@DBOS.workflow()`` calling ``@DBOS.step()`` functions, on a SQLite
    system database (DBOS is a process-wide singleton: one such contender per run)."""

    name = "dbos"

    def __init__(
        self, journal: str, *, steps: int, directory: Path, postgres_url: str | None = None
    ) -> None:
        super().__init__(steps=steps, directory=directory)
        self.journal = journal
        self.path = directory / "dbos.sqlite"
        self.workflow: Callable[[int], int] | None = None
        # DBOS's production configuration: its system database on PostgreSQL.
        self.postgres_url = postgres_url
        if postgres_url is not None:
            self.name = "dbos_postgresql"

    async def open(self) -> None:
        from dbos import DBOS, DBOSConfig

        self.settings = _server_settings(self.postgres_url) if self.postgres_url else {}
        if self.journal == "wal" and self.postgres_url is None:
            # journal_mode is a property of the file: DBOS's connections inherit it.
            with sqlite3.connect(self.path) as connection:
                connection.execute("PRAGMA journal_mode=WAL")

        @DBOS.step()
        def dbos_trivial(value: int) -> int:
            return value + 1

        @DBOS.workflow()
        def dbos_bench(steps: int) -> int:
            value = 0
            for _ in range(steps):
                started = time.perf_counter()
                value = dbos_trivial(value)
                _timings[0].append(time.perf_counter() - started)
            return value

        config: DBOSConfig = {
            "name": "sbproxy-journal-bench",
            "system_database_url": self.postgres_url or f"sqlite:///{self.path}",
            "run_admin_server": False,
            "log_level": "WARNING",
            "console_log_level": "WARNING",
        }
        DBOS(config=config)
        DBOS.launch()
        self.workflow = dbos_bench

    async def one_job(self) -> None:
        assert self.workflow is not None
        # Called on the event loop's thread like a plain function: DBOS's synchronous API,
        # its fastest path (nothing else runs meanwhile).
        assert self.workflow(self.steps) == self.steps

    async def close(self) -> None:
        from dbos import DBOS

        DBOS.destroy(destroy_registry=True)

    def describe(self) -> dict[str, Any]:
        if self.postgres_url is not None:
            return {
                "contender": self.name,
                "engine": f"DBOS Transact {importlib.metadata.version('dbos')} "
                "(sync workflow + steps)",
                "journal": {"postgresql": self.settings},
            }
        return {
            "contender": self.name,
            "engine": f"DBOS Transact {importlib.metadata.version('dbos')} (sync workflow + steps)",
            "journal": {
                "journal_mode": _journal_mode(self.path),
                "synchronous": "FULL (SQLite's default; DBOS sets none)",
                "setup": self.journal,
            },
        }


def _dbos_child(
    connection: Any, journal: str, steps: int, directory: str, postgres_url: str | None
) -> None:
    """A process of its own for one :class:`Dbos` contender (DBOS is one per process): runs
    the jobs it is told (``(jobs, measured)``) until told ``None``, then sends back its
    timings and description."""

    async def serve() -> None:
        contender = Dbos(journal, steps=steps, directory=Path(directory), postgres_url=postgres_url)
        await contender.open()
        try:
            connection.send("open")
            while (command := connection.recv()) is not None:
                jobs, measured = command
                await contender.run(jobs, measured=measured)
                connection.send("ran")
            description = contender.describe()
        finally:
            await contender.close()
        connection.send((contender.step_times, contender.job_times, contender.wall_s, description))

    anyio.run(serve)


class DbosProcess(Contender):
    """A :class:`Dbos` contender run in a process of its own, so that DBOS on SQLite and
    DBOS on PostgreSQL take part in one run side by side (DBOS is a process-wide singleton).
    The parent waits while it runs: the timings are its own, taken inside its workflow."""

    def __init__(
        self, journal: str, *, steps: int, directory: Path, postgres_url: str | None = None
    ) -> None:
        super().__init__(steps=steps, directory=directory)
        self.name = "dbos" if postgres_url is None else "dbos_postgresql"
        self.args = (journal, steps, str(directory), postgres_url)
        self.description: dict[str, Any] = {"contender": self.name}
        self.process: Any = None
        self.connection: Any = None

    async def open(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_dbos_child, args=(child, *self.args))
        self.process.start()
        child.close()
        assert self.connection.recv() == "open"

    async def run(self, jobs: int, *, measured: bool) -> None:
        self.connection.send((jobs, measured))
        assert self.connection.recv() == "ran"

    async def close(self) -> None:
        if self.process is None:
            return
        try:
            self.connection.send(None)
            step_times, job_times, wall_s, self.description = self.connection.recv()
            self.step_times, self.job_times, self.wall_s = step_times, job_times, wall_s
        finally:
            self.process.join(timeout=60)
            self.process = None

    def describe(self) -> dict[str, Any]:
        return {**self.description, "process": "its own (DBOS is one per process)"}


def _journal_mode(path: Path) -> str | None:
    if not path.exists():
        return None
    with sqlite3.connect(path) as connection:
        return str(connection.execute("PRAGMA journal_mode").fetchone()[0])


def _percentile(values: list[float], pct: int) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[pct - 1]


def _summary_ms(seconds: list[float]) -> dict[str, float] | None:
    if not seconds:
        return None
    ms = [value * 1000 for value in seconds]
    return {
        "p50": round(_percentile(ms, 50), 3),
        "p95": round(_percentile(ms, 95), 3),
        "p99": round(_percentile(ms, 99), 3),
        "mean": round(statistics.fmean(ms), 3),
        "max": round(max(ms), 3),
    }


class RawCommits:
    """The floor fsync sets: one-row ``BEGIN IMMEDIATE`` commits through the stdlib driver
    (WAL), measured in every round beside the contenders."""

    def __init__(self, mode: Synchronous, *, directory: Path) -> None:
        self.connection = sqlite3.connect(
            directory / f"raw-{mode.lower()}.db", isolation_level=None
        )
        self.connection.execute("PRAGMA journal_mode=WAL")
        self.connection.execute(f"PRAGMA synchronous={mode}")
        self.connection.execute("CREATE TABLE t (n INTEGER)")
        self.timings: list[float] = []

    def run(self, commits: int) -> None:
        for index in range(commits):
            started = time.perf_counter()
            self.connection.execute("BEGIN IMMEDIATE")
            self.connection.execute("INSERT INTO t VALUES (?)", (index,))
            self.connection.execute("COMMIT")
            self.timings.append(time.perf_counter() - started)

    def close(self) -> None:
        self.connection.close()


class RawPgCommits:
    """The PostgreSQL floor: one-row committed ``INSERT`` s (autocommit, the server's
    ``synchronous_commit``), measured in every round beside the contenders."""

    def __init__(self, url: str) -> None:
        import psycopg

        self.connection = psycopg.connect(url, autocommit=True)
        self.connection.execute("CREATE TABLE IF NOT EXISTS raw_commits (n BIGINT)")
        self.timings: list[float] = []

    def run(self, commits: int) -> None:
        for index in range(commits):
            started = time.perf_counter()
            self.connection.execute("INSERT INTO raw_commits VALUES (%s)", (index,))
            self.timings.append(time.perf_counter() - started)

    def close(self) -> None:
        self.connection.close()


class PgStepStatements:
    """The server's share of a step: the very statement the journal sends for one (the end
    of the step before it and its own start, fenced, with their events), executed
    prepared straight through psycopg on a job of its own, one after another, measured in
    every round beside the contenders. Between it and the one-row commit lies what the
    statement makes the server do; between it and sbproxy's step, the client's cost."""

    def __init__(self, url: str) -> None:
        import psycopg

        self.job_id, self.attempt = anyio.run(_claimed_job, url)
        self.connection = psycopg.connect(url, autocommit=True)
        self.seq = 0
        self.timings: list[float] = []

    def run(self, commits: int) -> None:
        import psycopg

        for _ in range(commits):
            self.seq += 1
            # What the engine records for a job claimed with no recoveries: the count's
            # reset is skipped (EndedStep.reset_recoveries).
            ended = EndedStep(
                seq=self.seq - 1,
                name=f"s{self.seq - 1}",
                output_json="1",
                reset_recoveries=False,
            )
            ending = jobs._Ending.success(self.job_id, "bench", self.attempt, ended)
            statement, params = jobs._begin_step_pg(
                {
                    "id": self.job_id,
                    "seq": self.seq,
                    "name": f"s{self.seq}",
                    "now": int(time.time() * 1000),
                    "owner": "bench",
                    "attempt": self.attempt,
                    "event": jobs._step_event(self.seq, f"s{self.seq}", StepStatus.RUNNING),
                },
                ending,
            )
            text = translate(statement)
            started = time.perf_counter()
            cursor = psycopg.Cursor(self.connection)
            cursor.execute(text, params, prepare=True)
            assert cursor.fetchone() is not None
            self.timings.append(time.perf_counter() - started)

    def close(self) -> None:
        self.connection.close()


# Smaller step records than the journal's, for what each part of its statement costs: the
# end of the step before and the start of the next as two fenced row writes without their
# events (the journal's steps table, its foreign key kept), and one fenced row alone (a
# table of its own, no foreign key, no event: what a journal that wrote one row per step and
# derived the rest would send).
_SHAPE_FENCE = "status = 'running' AND lease_owner = %(owner)s AND attempt = %(attempt)s"
_SHAPES = {
    "end_and_start_rows": (
        "WITH ended AS (UPDATE steps SET status = 'succeeded', output_json = '1',"  # noqa: S608 - fixed text
        " ended_at_ms = %(now)s WHERE job_id = %(id)s AND seq = %(end_seq)s"
        " AND status = 'running'"
        f" AND EXISTS (SELECT 1 FROM jobs WHERE id = %(id)s AND {_SHAPE_FENCE})"
        " RETURNING job_id)"
        " INSERT INTO steps (job_id, seq, name, status, attempts, started_at_ms)"
        " SELECT id, %(seq)s, %(name)s, 'running', 1, %(now)s FROM jobs"
        f" WHERE id = %(id)s AND {_SHAPE_FENCE} AND cancel_requested = 0"
        " AND EXISTS (SELECT 1 FROM ended) RETURNING seq"
    ),
    "one_row": (
        "INSERT INTO bench_step_log (job_id, seq, name, output_json, at_ms)"  # noqa: S608 - fixed text
        " SELECT id, %(seq)s, %(name)s, '1', %(now)s FROM jobs"
        f" WHERE id = %(id)s AND {_SHAPE_FENCE} AND cancel_requested = 0 RETURNING seq"
    ),
}


class PgRecordShapes:
    """What smaller step records cost on the same server (:data:`_SHAPES`), each on a job
    of its own, prepared straight through psycopg like :class:`PgStepStatements`, measured
    in every round beside it: how far below the journal's statement a step could go, and
    which of its writes the difference is."""

    def __init__(self, url: str) -> None:
        import psycopg

        self.connection = psycopg.connect(url, autocommit=True)
        self.connection.execute(
            "CREATE TABLE bench_step_log (job_id TEXT NOT NULL, seq BIGINT NOT NULL,"
            " name TEXT NOT NULL, output_json TEXT, at_ms BIGINT NOT NULL,"
            " PRIMARY KEY (job_id, seq))"
        )
        # Per shape: its job's id and claim attempt, and the last step position written.
        self.jobs: dict[str, tuple[str, int]] = {
            shape: anyio.run(_claimed_job, url) for shape in _SHAPES
        }
        self.seq = dict.fromkeys(_SHAPES, 0)
        self.timings: dict[str, list[float]] = {shape: [] for shape in _SHAPES}

    def run(self, commits: int) -> None:
        import psycopg

        for shape, statement in _SHAPES.items():
            job_id, attempt = self.jobs[shape]
            for _ in range(commits):
                self.seq[shape] += 1
                seq = self.seq[shape]
                params = {
                    "id": job_id,
                    "attempt": attempt,
                    "owner": "bench",
                    "seq": seq,
                    "end_seq": seq - 1,
                    "name": f"s{seq}",
                    "now": int(time.time() * 1000),
                }
                started = time.perf_counter()
                cursor = psycopg.Cursor(self.connection)
                cursor.execute(statement, params, prepare=True)
                assert cursor.fetchone() is not None, shape  # the fence held, it wrote
                self.timings[shape].append(time.perf_counter() - started)

    def close(self) -> None:
        self.connection.close()


async def _claimed_job(url: str) -> tuple[str, int]:
    """A job claimed by owner ``bench`` on the journal at ``url`` (created here), its first
    step begun: ``(job id, attempt)``."""
    store = await open_journal(url)
    try:
        job = (await store.submit(kind="bench-statement", workflow_version=1, input_json="{}")).job
        claimed = await store.claim(owner="bench", lease_ms=3_600_000, job_id=job.id)
        assert claimed is not None
        await store.begin_step(job.id, owner="bench", attempt=claimed.attempt, seq=0, name="s0")
        return job.id, claimed.attempt
    finally:
        await store.close()


def _server_settings(url: str) -> dict[str, Any]:
    """The durability settings of the server at ``url`` (and its version)."""
    import psycopg

    with psycopg.connect(url) as connection:
        shown = {
            name: connection.execute(f"SHOW {name}").fetchone()[0]  # type: ignore[index]
            for name in ("server_version", "fsync", "synchronous_commit", "wal_sync_method")
        }
    return shown


class PostgresDatabases:
    """Fresh databases for the PostgreSQL contenders: on a throw-away server started here
    (``--postgres auto``: Debian's binaries, ``tests/support/postgres.py``), or created
    through the given URL's server (``--postgres URL``, a role that may CREATE DATABASE)."""

    def __init__(self, choice: str) -> None:
        self.server: Any = None
        if choice == "auto":
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from tests.support.postgres import PostgresServer, postgres_bin_dir

            bin_dir = postgres_bin_dir()
            if bin_dir is None:
                raise SystemExit("--postgres auto: PostgreSQL's initdb is not installed")
            self.server = PostgresServer(bin_dir)
            self.server.start()
        self.admin_url = choice
        self.count = 0

    def create(self) -> str:
        if self.server is not None:
            return str(self.server.create_database())
        import psycopg

        self.count += 1
        name = f"sbproxy_bench_{os.getpid()}_{self.count}"
        with psycopg.connect(self.admin_url, autocommit=True) as connection:
            connection.execute(f"CREATE DATABASE {name}")
        return self.admin_url.rsplit("/", 1)[0] + "/" + name

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


# Claims: processes competing for one journal's queue, and the jobs queued for them.
CLAIMERS = 4
CLAIM_LEASE_MS = 600_000


def _claimer(location: str, owner: str, start: Any) -> tuple[list[str], float, float]:
    """One competing process: open the journal, wait at ``start`` (a barrier of every
    claimer), then claim queued jobs until none is left; the ids it won, and when it began
    and ended (``time.time()``)."""

    async def claim_all() -> tuple[list[str], float, float]:
        store = await open_journal(location)
        won: list[str] = []
        try:
            start.wait()
            began = time.time()
            while (job := await store.claim(owner=owner, lease_ms=CLAIM_LEASE_MS)) is not None:
                won.append(job.id)
            return won, began, time.time()
        finally:
            await store.close()

    return anyio.run(claim_all)


def measure_claims(location: str, *, jobs: int, processes: int = CLAIMERS) -> dict[str, Any]:
    """``processes`` processes claiming ``jobs`` queued jobs of one journal at once.

    Returns claims per second (all processes together, first start to last end), how many
    each won, and ``claimed_twice`` (jobs more than one process claimed: must be 0).
    """

    async def queue_jobs() -> None:
        store = await open_journal(location)
        try:
            for _ in range(jobs):
                await store.submit(kind="bench-claim", workflow_version=1, input_json="{}")
        finally:
            await store.close()

    anyio.run(queue_jobs)
    context = multiprocessing.get_context("spawn")
    with (
        context.Manager() as manager,
        concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool,
    ):
        start = manager.Barrier(processes)
        futures = [
            pool.submit(_claimer, location, f"claimer-{index}", start) for index in range(processes)
        ]
        results = [future.result() for future in futures]
    won = [ids for ids, _, _ in results]
    every = [job_id for ids in won for job_id in ids]
    wall = max(end for _, _, end in results) - min(began for _, began, _ in results)
    return {
        "processes": processes,
        "jobs": jobs,
        "claimed": len(every),
        "claimed_twice": len(every) - len(set(every)),
        "per_process": [len(ids) for ids in won],
        "wall_s": round(wall, 3),
        "claims_per_s": round(len(every) / wall, 1) if wall > 0 else None,
    }


def _all_claims(root: Path, postgres: PostgresDatabases | None, *, jobs: int) -> dict[str, Any]:
    """:func:`measure_claims` on a fresh SQLite journal and, when given, a PostgreSQL one."""
    (root / "claims").mkdir()
    claims = {"sqlite": measure_claims(str(root / "claims" / "journal.db"), jobs=jobs)}
    if postgres is not None:
        claims["postgresql"] = measure_claims(postgres.create(), jobs=jobs)
    return claims


def _filesystem(path: Path) -> str | None:
    """The type of the file system holding ``path`` (Linux ``/proc/mounts``), if known."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    target = str(path.resolve())
    best: tuple[int, str] | None = None
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount_point = fields[1]
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and (best is None or len(mount_point) > best[0]):
            best = (len(mount_point), fields[2])
    return best[1] if best else None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 2) if numerator and denominator else None


def _split(total: int, parts: int) -> list[int]:
    """``total`` jobs over ``parts`` rounds, as evenly as they go."""
    return [total // parts + (1 if index < total % parts else 0) for index in range(parts)]


async def _measure(
    contenders: list[Contender],
    floors: list[Any],
    *,
    jobs: int,
    warmup: int,
    rounds: int,
) -> None:
    for contender in contenders:
        await contender.open()
    try:
        for contender in contenders:
            if warmup:
                await contender.run(warmup, measured=False)
        for index, count in enumerate(_split(jobs, rounds)):
            if not count:
                continue
            shift = index % len(contenders)
            for contender in contenders[shift:] + contenders[:shift]:
                await contender.run(count, measured=True)
            for floor in floors:
                floor.run(count * contenders[0].steps)
    finally:
        for contender in contenders:
            await contender.close()


def _comparison(sbproxy: dict[str, Any], dbos: dict[str, Any] | None) -> dict[str, Any]:
    p50 = sbproxy["step_overhead_ms"]["p50"]
    targets: dict[str, Any] = {
        "step_overhead_p50_ms_at_most": TARGET_STEP_P50_MS,
        "steps_per_s_over_dbos_at_least": TARGET_OVER_DBOS,
        "step_overhead_p50_met": p50 <= TARGET_STEP_P50_MS,
    }
    if dbos is None:
        return {"targets": targets}
    over = _ratio(sbproxy["durable_steps_per_s"], dbos["durable_steps_per_s"])
    targets["steps_per_s_over_dbos_met"] = over is not None and over >= TARGET_OVER_DBOS
    return {
        "durable_steps_per_s": over,
        "dbos_step_p50_over_sbproxy": _ratio(dbos["step_overhead_ms"]["p50"], p50),
        "dbos_step_p95_over_sbproxy": _ratio(
            dbos["step_overhead_ms"]["p95"], sbproxy["step_overhead_ms"]["p95"]
        ),
        "dbos_job_p50_over_sbproxy": _ratio(dbos["job_ms"]["p50"], sbproxy["job_ms"]["p50"]),
        "targets": targets,
    }


def _postgres_summary(reports: dict[str, Any], floors: list[Any]) -> dict[str, Any]:
    """sbproxy on PostgreSQL against DBOS on PostgreSQL and the one-row commit floor."""
    sb_pg, dbos_pg = reports["sbproxy_postgresql"], reports.get("dbos_postgresql")
    floor_pg = _summary_ms(floors[2].timings)
    statement = _summary_ms(floors[3].timings)
    p50 = sb_pg["step_overhead_ms"]["p50"]
    over_floor = _ratio(p50, floor_pg["p50"] if floor_pg else None)
    over_dbos = (
        _ratio(sb_pg["durable_steps_per_s"], dbos_pg["durable_steps_per_s"]) if dbos_pg else None
    )
    shapes = {
        shape: {
            "p50_ms": summary["p50"],
            "over_raw_commit_p50": _ratio(summary["p50"], floor_pg["p50"] if floor_pg else None),
        }
        for shape, timings in floors[4].timings.items()
        if (summary := _summary_ms(timings)) is not None
    }
    # sbproxy's own share of a step (its step p50 less the statement's), added to the
    # smallest record: the step p50 a one-row journal would reach.
    client_ms = p50 - statement["p50"] if statement else None
    one_row = shapes.get("one_row")
    return {
        "raw_commit_ms": floor_pg,
        "step_statement_ms": statement,
        "smaller_records": shapes,
        "sbproxy_client_share_ms": round(client_ms, 3) if client_ms is not None else None,
        "one_row_plus_client_share_over_raw_commit_p50": _ratio(
            one_row["p50_ms"] + client_ms if one_row and client_ms is not None else None,
            floor_pg["p50"] if floor_pg else None,
        ),
        "sbproxy_step_p50_over_raw_commit_p50": over_floor,
        "step_statement_p50_over_raw_commit_p50": _ratio(
            statement["p50"] if statement else None, floor_pg["p50"] if floor_pg else None
        ),
        "sbproxy_step_p50_over_step_statement_p50": _ratio(
            p50, statement["p50"] if statement else None
        ),
        "sbproxy_steps_per_s_over_dbos": over_dbos,
        "targets": {
            "steps_per_s_over_dbos_at_least": TARGET_PG_OVER_DBOS,
            # Not measured without DBOS (null), like sbproxy_over_dbos.
            "steps_per_s_over_dbos_met": None
            if over_dbos is None
            else over_dbos >= TARGET_PG_OVER_DBOS,
            "step_p50_over_raw_commit_at_most": TARGET_PG_STEP_OVER_COMMIT,
            "step_p50_over_raw_commit_met": over_floor is not None
            and over_floor <= TARGET_PG_STEP_OVER_COMMIT,
        },
    }


def _contenders(
    args: argparse.Namespace, root: Path, postgres: PostgresDatabases | None, *, with_dbos: bool
) -> list[Contender]:
    """Every contender of this run, each on a fresh journal under ``root``."""
    contenders: list[Contender] = []
    for mode in ("FULL", "NORMAL"):
        (root / mode.lower()).mkdir()
        contenders.append(Sbproxy(mode, steps=args.steps, directory=root / mode.lower()))
    if postgres is not None:
        contenders.append(SbproxyPostgres(postgres.create(), steps=args.steps, directory=root))
    if with_dbos:
        # Each DBOS in a process of its own: on SQLite always, and with --postgres on
        # PostgreSQL too (its production configuration), side by side in one run.
        (root / "dbos").mkdir()
        contenders.append(DbosProcess(args.dbos_journal, steps=args.steps, directory=root / "dbos"))
        if postgres is not None:
            (root / "dbos-pg").mkdir()
            contenders.append(
                DbosProcess(
                    args.dbos_journal,
                    steps=args.steps,
                    directory=root / "dbos-pg",
                    postgres_url=postgres.create(),
                )
            )
    return contenders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--jobs", type=int, default=40, help="measured jobs per contender")
    parser.add_argument("--steps", type=int, default=5, help="trivial steps per job")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured jobs per contender")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds")
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="where the temporary journals live (its file system decides fsync cost)",
    )
    parser.add_argument(
        "--dbos-journal",
        choices=("default", "wal"),
        default="default",
        help="DBOS's own SQLite setup (rollback journal), or its file switched to WAL",
    )
    parser.add_argument("--no-dbos", action="store_true", help="leave DBOS out")
    parser.add_argument(
        "--postgres",
        default=None,
        help="add the PostgreSQL contenders: 'auto' starts a throw-away server from Debian's "
        "binaries, or a URL whose role may CREATE DATABASE; DBOS then runs on PostgreSQL too, "
        "its production configuration, beside DBOS on SQLite (each in a process of its own)",
    )
    parser.add_argument(
        "--claim-jobs",
        type=int,
        default=400,
        help=f"jobs queued for the claims figure ({CLAIMERS} processes competing; 0: skip)",
    )
    args = parser.parse_args()
    if args.jobs < 1 or args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("--jobs, --steps and --rounds must be at least 1, --warmup at least 0")

    dbos_skipped: str | None = None
    if args.no_dbos:
        dbos_skipped = "--no-dbos"
    elif importlib.util.find_spec("dbos") is None:
        dbos_skipped = "the dbos package is not installed (pip install -e '.[dev]')"

    postgres = PostgresDatabases(args.postgres) if args.postgres else None
    with tempfile.TemporaryDirectory(prefix="journal-bench-", dir=args.dir) as tmp:
        root = Path(tmp)
        contenders = _contenders(args, root, postgres, with_dbos=dbos_skipped is None)
        floors: list[Any] = [RawCommits(mode, directory=root) for mode in ("FULL", "NORMAL")]
        if postgres is not None:
            floors.append(RawPgCommits(postgres.create()))
            floors.append(PgStepStatements(postgres.create()))
            floors.append(PgRecordShapes(postgres.create()))
        claims: dict[str, Any] | None = None
        try:
            anyio.run(_measure_all, contenders, floors, args.jobs, args.warmup, args.rounds)
            if args.claim_jobs > 0:
                claims = _all_claims(root, postgres, jobs=args.claim_jobs)
        finally:
            for floor in floors:
                floor.close()
            if postgres is not None:
                postgres.close()
        reports = {contender.name: contender.report() for contender in contenders}

    full, normal = reports["sbproxy"], reports["sbproxy_normal"]
    dbos = reports.get("dbos")
    on_postgres = _postgres_summary(reports, floors) if postgres is not None else None
    report = {
        "benchmark": "journal",
        "shape": {
            "jobs": args.jobs,
            "steps_per_job": args.steps,
            "warmup_jobs": args.warmup,
            "rounds": args.rounds,
            "order": "interleaved, one job at a time, the order rotating each round",
        },
        "contenders": reports,
        "dbos_skipped": dbos_skipped,
        "sbproxy_over_dbos": _comparison(full, dbos) if dbos else _comparison(full, None),
        "postgresql": on_postgres,
        "claims": claims,
        "full_over_normal": {
            "step_overhead_p50": _ratio(
                full["step_overhead_ms"]["p50"], normal["step_overhead_ms"]["p50"]
            ),
            "steps_per_s_normal_over_full": _ratio(
                normal["durable_steps_per_s"], full["durable_steps_per_s"]
            ),
        },
        "raw_sqlite_commit_ms": {
            "wal_full": _summary_ms(floors[0].timings),
            "wal_normal": _summary_ms(floors[1].timings),
        },
        "environment": {
            "sqlite_version": sqlite3.sqlite_version,
            "python": sys.version.split()[0],
            "implementation": platform.python_implementation(),
            "platform": platform.platform(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "load_average": _load_average(),
            "journal_dir": str(args.dir),
            "journal_filesystem": _filesystem(args.dir),
        },
    }
    print(json.dumps(report, indent=2))


async def _measure_all(
    contenders: list[Contender], floors: list[Any], jobs: int, warmup: int, rounds: int
) -> None:
    await _measure(contenders, floors, jobs=jobs, warmup=warmup, rounds=rounds)


def _load_average() -> list[float] | None:
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return None


if __name__ == "__main__":
    main()
