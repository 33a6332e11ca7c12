"""A PostgreSQL journal whose server goes away: writes and reads are refused at once with
``journal_unavailable`` naming ``host:port`` (never a password), nothing acknowledged is
lost, and the same store reconnects by itself once the server is back."""

from __future__ import annotations

import logging

import psycopg
import pytest

from sbproxy.errors import SbproxyError
from sbproxy.store import Database, JobStatus, JobStore, postgres
from tests.support.postgres import PostgresServer
from tests.support.tcp_relay import TcpRelay

pytestmark = pytest.mark.anyio


async def test_a_lost_server_is_journal_unavailable_and_the_store_resumes(
    own_postgres_server: PostgresServer,
) -> None:
    user = own_postgres_server.user  # postgres under root, else the OS user running the tests
    url = own_postgres_server.create_database().replace(f"{user}@", f"{user}:pw-never-shown@", 1)
    assert "pw-never-shown" in url
    database = await Database.open(url)
    store = JobStore(database)
    try:
        acknowledged = (await store.submit(kind="demo", workflow_version=1, input_json="{}")).job
        claimed = await store.claim(owner="w", lease_ms=60_000)
        assert claimed is not None

        own_postgres_server.stop_server("fast")
        for attempt in (
            store.submit(kind="demo", workflow_version=1, input_json="{}"),
            store.get(acknowledged.id),
        ):
            with pytest.raises(SbproxyError) as refused:
                await attempt
            assert refused.value.code == "journal_unavailable"
            assert refused.value.retryable
            message = str(refused.value)
            assert f"127.0.0.1:{own_postgres_server.port}" in message
            assert "pw-never-shown" not in message
            assert "\n" not in refused.value.message

        own_postgres_server.start_server()
        # The same store, its threads' connections reopened at their next transaction.
        assert await store.begin_step(
            acknowledged.id, owner="w", attempt=claimed.attempt, seq=0, name="s"
        )
        finished = await store.finish(
            acknowledged.id, owner="w", attempt=claimed.attempt, status=JobStatus.SUCCEEDED
        )
        assert finished is not None
        assert finished.status == JobStatus.SUCCEEDED
        again = await store.get(acknowledged.id)
        assert again is not None
        assert again.status == JobStatus.SUCCEEDED
    finally:
        await database.close()


async def test_a_connection_lost_under_a_pipelined_statement_is_one_error_and_no_log(
    postgres_server: PostgresServer, caplog: pytest.LogCaptureFixture
) -> None:
    # A hot statement's first use on a connection goes in a pipeline of its own (with its
    # preparation). A connection lost there fails the pipeline's end too; psycopg would log
    # that second failure ("error ignored terminating <psycopg.Pipeline [BAD]>") before a
    # CLI prints its one line. It is one journal_unavailable, and nothing else.
    caplog.set_level(logging.DEBUG)
    with TcpRelay(postgres_server.port) as relay:
        url = postgres_server.create_database().replace(
            f":{postgres_server.port}/", f":{relay.port}/", 1
        )
        database = await Database.open(url)
        store = JobStore(database)
        try:
            job = (await store.submit(kind="demo", workflow_version=1, input_json="{}")).job
            claimed = await store.claim(owner="w", lease_ms=60_000, job_id=job.id)
            assert claimed is not None
            relay.cut()
            with pytest.raises(SbproxyError) as refused:
                await store.begin_step(job.id, owner="w", attempt=claimed.attempt, seq=0, name="s")
            assert refused.value.code == "journal_unavailable"
            # The same with statements held before it and a COMMIT after (a grouped write).
            relay.heal()
            direct = psycopg.connect(url)
            relay.cut()
            with pytest.raises(psycopg.OperationalError):
                postgres._run_prepared(direct, ["BEGIN"], "SELECT 1", (), ["COMMIT"])
            direct.close()
        finally:
            relay.heal()
            await database.close()
    said = [record.getMessage() for record in caplog.records if record.name.startswith("psycopg")]
    assert not [line for line in said if "error ignored" in line], said
