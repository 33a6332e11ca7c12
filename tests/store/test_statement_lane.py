"""The statement lane (``sbproxy/store/lane.py``): on PostgreSQL a write of one statement -- a
step's start and end, a submit, a finish -- goes from the event loop on a connection of its
own; the writer thread takes it when the lane is busy, or shut after a failure. Real server,
real relay for the faults."""

from __future__ import annotations

import asyncio
import time

import anyio
import pytest

from sbproxy.errors import SbproxyError
from sbproxy.store import Database, EndedStep, JobStore, StepRecord, StepStatus
from sbproxy.store.postgres import STATEMENT_DEADLINE_S
from tests.support.postgres import PostgresServer
from tests.support.relayed_journal import relayed_journal

pytestmark = pytest.mark.anyio

# Slack on a bound for this shared, slow machine.
SLACK_S = 3.0


def _writes(database: Database) -> tuple[int, int]:
    """Writes committed so far ``(by the lane, by the writer thread)``."""
    lane = database._lane
    assert lane is not None
    return lane.writes, database._writer.writes


async def _claimed(store: JobStore) -> tuple[str, int]:
    job = (await store.submit(kind="demo", workflow_version=1, input_json="{}")).job
    claimed = await store.claim(owner="w", lease_ms=60_000, job_id=job.id)
    assert claimed is not None
    return job.id, claimed.attempt


async def test_steps_take_the_lane_and_one_that_finds_it_busy_takes_the_writer(
    postgres_server: PostgresServer,
) -> None:
    database = await Database.open(postgres_server.create_database())
    store = JobStore(database)
    try:
        first, second = await _claimed(store), await _claimed(store)
        lane_before, writer_before = _writes(database)
        started = await store.begin_step(first[0], owner="w", attempt=first[1], seq=0, name="a")
        assert isinstance(started, StepRecord)
        assert _writes(database) == (lane_before + 1, writer_before)
        # Two at once: the lane holds one statement at a time, the writer takes the other.
        answers: list[object] = []

        async def step(job_id: str, attempt: int, seq: int) -> None:
            ending = EndedStep(seq=seq - 1, name="a", output_json="1") if seq else None
            answers.append(
                await store.begin_step(
                    job_id, owner="w", attempt=attempt, seq=seq, name="b", ending=ending
                )
            )

        async with anyio.create_task_group() as group:
            group.start_soon(step, first[0], first[1], 1)
            group.start_soon(step, second[0], second[1], 0)
        assert all(isinstance(answer, StepRecord) for answer in answers), answers
        assert _writes(database) == (lane_before + 2, writer_before + 1)
        # Both durable, as recorded.
        steps = [(s.seq, s.status, s.output_json) for s in await store.steps(first[0])]
        assert steps == [(0, StepStatus.SUCCEEDED, "1"), (1, StepStatus.RUNNING, None)]
        assert [s.seq for s in await store.steps(second[0])] == [0]
    finally:
        await database.close()


async def test_a_step_through_a_silent_link_is_unavailable_in_time_then_runs_again(
    postgres_server: PostgresServer,
) -> None:
    async with relayed_journal(postgres_server) as (relay, database, store):
        job_id, attempt = await _claimed(store)
        relay.blackhole()
        began = time.monotonic()
        with pytest.raises(SbproxyError) as refused:
            await asyncio.wait_for(
                store.begin_step(job_id, owner="w", attempt=attempt, seq=0, name="a"),
                STATEMENT_DEADLINE_S + SLACK_S,
            )
        took = time.monotonic() - began
        assert refused.value.code == "journal_unavailable"
        assert f"127.0.0.1:{relay.port}" in str(refused.value)
        assert STATEMENT_DEADLINE_S <= took < STATEMENT_DEADLINE_S + SLACK_S
        relay.heal()
        lane_before, writer_before = _writes(database)
        # The lane is shut after its failure: the writer runs the next write, on a fresh
        # connection; the lane reopens for the one after.
        again = await store.begin_step(job_id, owner="w", attempt=attempt, seq=0, name="a")
        assert isinstance(again, StepRecord)
        assert _writes(database) == (lane_before, writer_before + 1)
        assert await store.end_step(
            job_id, owner="w", attempt=attempt, seq=0, name="a", output_json="1"
        )
        assert _writes(database) == (lane_before + 1, writer_before + 1)
        [step] = await store.steps(job_id)
        assert (step.status, step.output_json) == (StepStatus.SUCCEEDED, "1")


async def test_a_server_restarted_under_an_idle_lane_is_met_by_a_fresh_connection(
    own_postgres_server: PostgresServer,
) -> None:
    database = await Database.open(own_postgres_server.create_database())
    store = JobStore(database)
    try:
        job_id, attempt = await _claimed(store)
        own_postgres_server.stop_server("fast")
        # A read meets the outage first; the writing connections, idle, are reopened at
        # their next use rather than found lost by the next write.
        with pytest.raises(SbproxyError) as refused:
            await store.get(job_id)
        assert refused.value.code == "journal_unavailable"
        own_postgres_server.start_server()
        lane_before, writer_before = _writes(database)
        started = await store.begin_step(job_id, owner="w", attempt=attempt, seq=0, name="a")
        assert isinstance(started, StepRecord)
        assert _writes(database) == (lane_before + 1, writer_before)
    finally:
        await database.close()


async def test_a_lane_that_cannot_connect_hands_its_step_to_the_writer_which_reconnects(
    postgres_server: PostgresServer,
) -> None:
    # A connect refused or closed at once sent nothing: the step goes to the writer thread,
    # whose reconnect window spans a link that comes back meanwhile (the lane alone would
    # have failed it at once).
    async with relayed_journal(postgres_server) as (relay, database, store):
        job_id, attempt = await _claimed(store)
        relay.cut()  # every connection closed; new ones closed as accepted
        # A read meets the outage: the idle writing connections are reopened at their
        # next use.
        with pytest.raises(SbproxyError):
            await store.get(job_id)
        refused = relay.refused
        lane_before, writer_before = _writes(database)
        step = asyncio.ensure_future(
            store.begin_step(job_id, owner="w", attempt=attempt, seq=0, name="a")
        )
        # The lane's connect, then the writer's first reconnect, both refused.
        while relay.refused < refused + 2:
            assert not step.done(), step
            await asyncio.sleep(0.01)
        relay.heal()
        started = await asyncio.wait_for(step, 30)
        assert isinstance(started, StepRecord)
        assert _writes(database) == (lane_before, writer_before + 1)
