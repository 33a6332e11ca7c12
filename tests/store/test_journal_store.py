"""The journal on both backends (``journal_backend``: SQLite and a real PostgreSQL):
migrations, compare-and-set transitions, events, retention; SQLite's pragmas and the secrets
that never reach its file; PostgreSQL's schema, its refusal of a newer one and one migration
for hosts that start at once."""

from __future__ import annotations

import socket
import sqlite3
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from sqlmodel import SQLModel

from sbproxy.errors import SbproxyError
from sbproxy.redact import redact, register_secret
from sbproxy.store import (
    Database,
    ErrorInfo,
    JobStatus,
    JobStore,
    LeaseTime,
    StepStatus,
    StoreError,
    jobs,
)
from sbproxy.store.migrations import SCHEMA_VERSION
from sbproxy.store.tables import (
    DesiredRevisionRow,
    EventRow,
    GenerationRow,
    JobRow,
    RevisionRow,
    StepRow,
    UsageRow,
)
from tests.support.postgres import PostgresServer

pytestmark = pytest.mark.anyio


@pytest.fixture
async def store(journal_location: Path | str) -> AsyncIterator[JobStore]:
    database = await Database.open(journal_location)
    try:
        yield JobStore(database)
    finally:
        await database.close()


async def submit(store: JobStore, key: str | None = None, kind: str = "demo") -> str:
    outcome = await store.submit(
        kind=kind, workflow_version=1, input_json="{}", idempotency_key=key
    )
    return outcome.job.id


@pytest.mark.parametrize("journal_backend", ["sqlite"], indirect=True)
async def test_pragmas_and_schema_version(store: JobStore) -> None:
    path = store.database.path
    with sqlite3.connect(path) as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        version = raw.execute("SELECT MAX(version) FROM schema_migrations").fetchone()[0]
    assert version == SCHEMA_VERSION
    for run in (store.database.read, store.database.write):
        synchronous, busy = await run(
            lambda tx: (tx.scalar("PRAGMA synchronous"), tx.scalar("PRAGMA busy_timeout"))
        )
        assert synchronous == 2  # FULL, on the reader connections and on the writer
        assert busy == 30_000


async def test_migrations_are_idempotent_and_match_the_mappings(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    for _ in range(2):
        database = await Database.open(path)
        await database.close()
    with sqlite3.connect(path) as raw:
        applied = raw.execute("SELECT COUNT(*) FROM schema_migrations").fetchone()[0]
        assert applied == SCHEMA_VERSION
        for row_type in (
            JobRow,
            StepRow,
            EventRow,
            GenerationRow,
            RevisionRow,
            UsageRow,
            DesiredRevisionRow,
        ):
            table = SQLModel.metadata.tables[str(row_type.__tablename__)]
            columns = {r[1] for r in raw.execute(f"PRAGMA table_info({table.name})")}
            assert columns == {c.name for c in table.columns}, table.name


async def test_a_newer_journal_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    database = await Database.open(path)
    await database.close()
    with sqlite3.connect(path) as raw:
        raw.execute(
            "INSERT INTO schema_migrations VALUES (?, 'from the future', 0)", (SCHEMA_VERSION + 1,)
        )
    with pytest.raises(StoreError) as info:
        await Database.open(path)
    assert info.value.code == "store_version_mismatch"


async def test_unusable_journal_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    path.write_bytes(b"this is not a sqlite database" * 100)
    with pytest.raises(StoreError) as info:
        await Database.open(path)
    assert info.value.code == "store_failed"
    assert str(path) in str(info.value)


async def test_idempotency_key_joins_the_unfinished_job(store: JobStore) -> None:
    first = await store.submit(
        kind="demo", workflow_version=1, input_json="{}", idempotency_key="k"
    )
    again = await store.submit(
        kind="demo", workflow_version=1, input_json="{}", idempotency_key="k"
    )
    assert first.created and not again.created
    assert again.job.id == first.job.id
    # Once the job is finished, the key is free again.
    claimed = await store.claim(owner="w", lease_ms=10_000)
    assert claimed is not None
    assert await store.finish(
        claimed.id, owner="w", attempt=1, status=JobStatus.SUCCEEDED, output_json="1"
    )
    later = await store.submit(
        kind="demo", workflow_version=1, input_json="{}", idempotency_key="k"
    )
    assert later.created and later.job.id != first.job.id


async def test_claim_is_compare_and_set(store: JobStore) -> None:
    job_id = await submit(store)
    assert (await store.claim(owner="a", lease_ms=10_000, job_id=job_id)) is not None
    assert (await store.claim(owner="b", lease_ms=10_000, job_id=job_id)) is None
    assert (await store.claim(owner="b", lease_ms=10_000)) is None
    # Only the lease owner may finish or heartbeat it.
    assert not await store.finish(job_id, owner="b", attempt=1, status=JobStatus.SUCCEEDED)
    assert not await store.heartbeat(job_id, owner="b", attempt=1, lease_ms=10_000)
    assert await store.heartbeat(job_id, owner="a", attempt=1, lease_ms=10_000)
    job = await store.get(job_id)
    assert job is not None
    assert job.status == JobStatus.RUNNING
    assert job.lease_owner == "a"
    assert job.attempt == 1


async def test_terminal_jobs_are_immutable(store: JobStore) -> None:
    job_id = await submit(store)
    await store.claim(owner="a", lease_ms=10_000)
    assert await store.finish(
        job_id, owner="a", attempt=1, status=JobStatus.SUCCEEDED, output_json='"ok"'
    )
    assert not await store.finish(job_id, owner="a", attempt=1, status=JobStatus.FAILED)
    cancelled = await store.request_cancel(job_id)
    assert cancelled is not None
    assert cancelled.status == JobStatus.SUCCEEDED
    retried = await store.retry(job_id)
    assert retried is not None
    assert retried.status == JobStatus.SUCCEEDED


async def test_expired_leases_return_to_the_queue(journal_location: Path | str) -> None:
    now = [1_000_000]
    database = await Database.open(journal_location)
    store = JobStore(database, lease_clock=lambda: LeaseTime(clock="boot", ms=now[0]))
    try:
        job_id = await submit(store)
        await store.claim(owner="dead", lease_ms=5_000)
        now[0] += 5_000
        assert await store.requeue_expired() == []  # at the deadline it still holds
        now[0] += 1
        assert await store.requeue_expired() == [job_id]
        job = await store.get(job_id)
        assert job is not None
        assert job.status == JobStatus.QUEUED
        assert job.lease_owner is None
        # The dead owner can no longer write.
        assert not await store.finish(job_id, owner="dead", attempt=1, status=JobStatus.SUCCEEDED)
    finally:
        await database.close()


async def test_cancel_is_immediate_when_queued_and_cooperative_when_running(
    store: JobStore,
) -> None:
    queued = await submit(store)
    job = await store.request_cancel(queued)
    assert job is not None
    assert job.status == JobStatus.CANCELLED
    running = await submit(store)
    await store.claim(owner="w", lease_ms=10_000, job_id=running)
    job = await store.request_cancel(running)
    assert job is not None
    assert job.status == JobStatus.RUNNING
    assert job.cancel_requested
    assert await store.cancel_requested(running)
    assert await store.request_cancel("01ARZ3NDEKTSV4RRFFQ69G5FAV") is None


async def test_retry_only_from_failed_or_parked(store: JobStore) -> None:
    job_id = await submit(store, key="r")
    await store.claim(owner="w", lease_ms=10_000)
    assert await store.finish(
        job_id, owner="w", attempt=1, status=JobStatus.FAILED, error=ErrorInfo("boom", "it broke")
    )
    job = await store.retry(job_id)
    assert job is not None
    assert job.status == JobStatus.QUEUED
    assert job.error is None
    # A retried job holds its key again: a new submit joins it.
    again = await store.submit(
        kind="demo", workflow_version=1, input_json="{}", idempotency_key="r"
    )
    assert again.job.id == job_id


async def test_event_sequence_is_monotonic_across_reopen(journal_location: Path | str) -> None:
    path = journal_location
    database = await Database.open(path)
    store = JobStore(database)
    job_id = await submit(store)
    await store.claim(owner="w", lease_ms=10_000)
    await store.report_progress(
        job_id, owner="w", attempt=1, progress={"done": 1, "total": 2}, event=True
    )
    first = await store.events(job_id)
    await database.close()

    database = await Database.open(path)
    store = JobStore(database)
    await store.report_progress(
        job_id, owner="w", attempt=1, progress={"done": 2, "total": 2}, event=True
    )
    events = await store.events(job_id)
    await database.close()
    seqs = [e.seq for e in events]
    assert seqs == sorted(seqs)
    assert len(set(seqs)) == len(seqs)
    assert seqs[: len(first)] == [e.seq for e in first]
    assert [e.type for e in events] == ["status", "status", "progress", "progress"]
    assert events[-1].data == {"done": 2, "total": 2}
    database = await Database.open(path)
    tail = await JobStore(database).events(job_id, after_seq=first[-1].seq)
    await database.close()
    assert [e.seq for e in tail] == seqs[len(first) :]


async def test_retention_never_prunes_active_jobs(store: JobStore) -> None:
    active = await submit(store, kind="long")
    finished = []
    for index in range(4):
        job_id = await submit(store, kind="short")
        claimed = await store.claim(owner="w", lease_ms=10_000, job_id=job_id)
        assert claimed is not None
        await store.finish(
            job_id, owner="w", attempt=1, status=JobStatus.FAILED, error=ErrorInfo("x", str(index))
        )
        finished.append(job_id)
    deleted = await store.prune_terminal(keep=2)
    assert deleted == 2
    remaining = {job.id for job in await store.list_jobs()}
    assert remaining == {active, finished[2], finished[3]}


async def test_pruning_keeps_every_other_node_s_history(journal_location: Path | str) -> None:
    """Issue 30, item 27: in a shared journal a busy node prunes only its own finished
    jobs; another node's, and a fleet job a placement points to, stay."""
    database = await Database.open(journal_location)
    try:
        busy, quiet = JobStore(database, node="busy"), JobStore(database, node="quiet")
        theirs = await submit(quiet, kind="short")
        assert await quiet.claim(owner="q", lease_ms=10_000, job_id=theirs) is not None
        await quiet.finish(theirs, owner="q", attempt=1, status=JobStatus.SUCCEEDED)
        mine = []
        for _ in range(3):
            job_id = await submit(busy, kind="short")
            assert await busy.claim(owner="b", lease_ms=10_000, job_id=job_id) is not None
            await busy.finish(
                job_id, owner="b", attempt=1, status=JobStatus.SUCCEEDED, keep_finished=1
            )
            mine.append(job_id)
        remaining = {job.id for job in await busy.list_jobs()}
        assert remaining == {theirs, mine[-1]}
    finally:
        await database.close()


async def test_a_finish_prunes_the_oldest_finished_jobs_in_its_own_transaction(
    store: JobStore,
) -> None:
    active = await submit(store, kind="long")
    finished = []
    for _ in range(4):
        job_id = await submit(store, kind="short")
        claimed = await store.claim(owner="w", lease_ms=10_000, job_id=job_id)
        assert claimed is not None
        done = await store.finish(
            job_id, owner="w", attempt=1, status=JobStatus.SUCCEEDED, keep_finished=2
        )
        assert done is not None and done.status == JobStatus.SUCCEEDED
        finished.append(job_id)
        # After each finish: the newest two finished jobs (this one among them), never the
        # active one.
        remaining = {job.id for job in await store.list_jobs()}
        assert remaining == {active, *finished[-2:]}
    # A parked job is not finished: it prunes nothing and stays.
    parked = await submit(store, kind="short")
    assert await store.claim(owner="w", lease_ms=10_000, job_id=parked) is not None
    await store.finish(
        parked,
        owner="w",
        attempt=1,
        status=JobStatus.PARKED,
        error=ErrorInfo("x", "y"),
        keep_finished=1,
    )
    assert {job.id for job in await store.list_jobs()} == {active, parked, *finished[-2:]}
    # A finish fenced off writes nothing and deletes nothing.
    late = await submit(store, kind="short")
    assert await store.claim(owner="w", lease_ms=10_000, job_id=late) is not None
    fenced = await store.finish(
        late, owner="w", attempt=2, status=JobStatus.SUCCEEDED, keep_finished=1
    )
    assert fenced is None
    assert {job.id for job in await store.list_jobs()} == {active, parked, late, *finished[-2:]}


async def test_secrets_never_reach_the_database_file(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    database = await Database.open(path)
    store = JobStore(database)
    secrets = [
        "hf_SuperSecretTokenValue1234567890",
        "eyJhbGciOiJIUzI1NiJ9.payload.signature",
        "hunter2-admin-password",
    ]
    job_id = await submit(store)
    await store.claim(owner="w", lease_ms=10_000)
    await store.begin_step(job_id, owner="w", attempt=1, seq=0, name="download")
    await store.end_step(
        job_id,
        owner="w",
        attempt=1,
        seq=0,
        name="download",
        error=ErrorInfo(
            "http_error",
            f"401 with Authorization: Bearer {secrets[1]} and token {secrets[0]}",
        ),
    )
    await store.report_progress(
        job_id,
        owner="w",
        attempt=1,
        progress={"current": f"https://u:{secrets[2]}@host/x"},
        event=True,
    )
    await store.finish(
        job_id,
        owner="w",
        attempt=1,
        status=JobStatus.FAILED,
        error=ErrorInfo("http_error", f'{{"password": "{secrets[2]}"}} bearer {secrets[0]}'),
    )
    job = await store.get(job_id)
    await database.close()
    assert job is not None
    assert job.error is not None
    assert "[REDACTED]" in job.error.message
    blob = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("journal.db"))
    for secret in secrets:
        assert secret.encode() not in blob, secret


async def test_generations_are_monotonic_across_reopen(journal_location: Path | str) -> None:
    from sbproxy.store import RuntimeStore

    path = journal_location
    database = await Database.open(path)
    runtime = RuntimeStore(database)
    assert [await runtime.next_generation("a") for _ in range(3)] == [1, 2, 3]
    assert await runtime.next_generation("b") == 1
    assert await runtime.latest_revision() is None
    first = await runtime.commit_revision(content_digest="d1", desired={"x": 1})
    await database.close()
    database = await Database.open(path)
    runtime = RuntimeStore(database)
    assert await runtime.next_generation("a") == 4
    second = await runtime.commit_revision(content_digest="d2", desired={"x": 2})
    latest = await runtime.latest_revision()
    await database.close()
    assert second == first + 1
    assert latest is not None
    assert (latest.revision, latest.content_digest, dict(latest.desired)) == (
        second,
        "d2",
        {"x": 2},
    )


async def test_list_jobs_limit_minus_one_returns_every_match(store: JobStore) -> None:
    ids = {await submit(store, kind="bulk") for _ in range(105)}
    assert len(await store.list_jobs(kind="bulk")) == 100  # the default cap
    assert {job.id for job in await store.list_jobs(kind="bulk", limit=-1)} == ids


# -- PostgreSQL only -----------------------------------------------------------------------


@pytest.mark.parametrize("journal_backend", ["postgresql"], indirect=True)
async def test_postgres_schema_matches_the_mappings(
    journal_location: str, postgres_server: PostgresServer
) -> None:
    for _ in range(2):
        database = await Database.open(journal_location)
        await database.close()
    name = journal_location.rsplit("/", 1)[1]
    applied = postgres_server.psql("SELECT COUNT(*) FROM schema_migrations", name)
    assert int(applied) == SCHEMA_VERSION
    for row_type in (
        JobRow,
        StepRow,
        EventRow,
        GenerationRow,
        RevisionRow,
        UsageRow,
        DesiredRevisionRow,
    ):
        table = SQLModel.metadata.tables[str(row_type.__tablename__)]
        listed = postgres_server.psql(
            "SELECT column_name || ':' || data_type FROM information_schema.columns"  # noqa: S608 - a fixed table name
            f" WHERE table_name = '{table.name}'",
            name,
        ).split()
        assert {c.split(":")[0] for c in listed} == {c.name for c in table.columns}, table.name
        # Every integer column holds 64 bits (epoch milliseconds do not fit in 32).
        assert not [c for c in listed if c.endswith(":integer")], table.name


@pytest.mark.parametrize("journal_backend", ["postgresql"], indirect=True)
async def test_postgres_refuses_a_newer_schema(
    journal_location: str, postgres_server: PostgresServer
) -> None:
    database = await Database.open(journal_location)
    await database.close()
    postgres_server.psql(
        f"INSERT INTO schema_migrations VALUES ({SCHEMA_VERSION + 1}, 'new', 0)",  # noqa: S608
        journal_location.rsplit("/", 1)[1],
    )
    with pytest.raises(StoreError) as info:
        await Database.open(journal_location)
    assert info.value.code == "journal_schema_newer"
    assert info.value.details["schema_version"] == SCHEMA_VERSION + 1


@pytest.mark.parametrize("journal_backend", ["postgresql"], indirect=True)
async def test_postgres_hosts_opening_at_once_migrate_once(
    journal_location: str, postgres_server: PostgresServer
) -> None:
    opened: list[Database] = []

    async def open_one() -> None:
        opened.append(await Database.open(journal_location))

    async with anyio.create_task_group() as group:
        for _ in range(4):
            group.start_soon(open_one)
    for database in opened:
        await database.close()
    listed = postgres_server.psql(
        "SELECT version FROM schema_migrations ORDER BY version",
        journal_location.rsplit("/", 1)[1],
    ).split()
    assert [int(v) for v in listed] == list(range(1, SCHEMA_VERSION + 1))


async def test_postgres_journal_never_shows_the_password(postgres_server: PostgresServer) -> None:
    user = postgres_server.user  # postgres under root, else the OS user running the tests
    url = postgres_server.create_database().replace(f"{user}@", f"{user}:s3cret-pw@", 1)
    assert "s3cret-pw" in url
    database = await Database.open(url)  # trust authentication ignores the password
    try:
        assert "s3cret-pw" not in database.location
        assert database.location.startswith(f"postgresql://{user}@127.0.0.1:")
    finally:
        await database.close()
    closed = f"postgresql://{user}:s3cret-pw@127.0.0.1:{_closed_port()}/nothing"
    with pytest.raises(SbproxyError) as info:
        await Database.open(closed)
    assert info.value.code == "journal_unavailable"
    assert "s3cret-pw" not in str(info.value)
    assert f"127.0.0.1:{closed.split(':')[3].split('/', maxsplit=1)[0]}" in str(info.value)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    "name",
    [
        "download:model.gguf",
        "fetch:https://u:pa55word@host/x?token=hf_" + "a" * 24,
        'quote "and" back\\slash, ünïcode',
        "huge:" + "x" * (17 * 1024),
    ],
)
def test_a_step_event_is_the_text_the_general_event_encoder_writes(name: str) -> None:
    # Every step writes two of these, built without the general encoder's tree walk: the
    # same text (keys sorted, the name redacted, too large: truncated) all the same.
    for seq, status in ((0, StepStatus.RUNNING), (7, StepStatus.SUCCEEDED)):
        general = jobs._event_json({"seq": seq, "name": name, "status": status.value})
        assert jobs._step_event(seq, name, status) == general
    assert "hf_aaaa" not in jobs._step_event(0, name, StepStatus.RUNNING)


def test_a_step_name_is_redacted_once_not_at_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # Jobs of one workflow name their steps alike: the redactor's patterns run once per
    # name, not twice a step (the events read the same, the test above says).
    calls: list[str] = []

    def counting(text: str) -> str:
        calls.append(text)
        return redact(text)

    monkeypatch.setattr(jobs, "redact", counting)
    name = f"download:{uuid.uuid4().hex}"
    events = {jobs._step_event(seq, name, StepStatus.RUNNING) for seq in range(10)}
    events |= {jobs._step_event(seq, name, StepStatus.SUCCEEDED) for seq in range(10)}
    assert len(events) == 20
    assert calls == [name]


def test_a_kept_step_name_is_redacted_anew_once_a_secret_is_registered() -> None:
    secret = f"step-secret-{uuid.uuid4().hex}"
    name = f"fetch:{secret}"
    assert secret in jobs._step_event(0, name, StepStatus.RUNNING)  # no secret yet
    register_secret(secret)
    event = jobs._step_event(1, name, StepStatus.RUNNING)
    assert secret not in event
    assert event == jobs._event_json({"seq": 1, "name": name, "status": "running"})
