"""The Deployment's one transition function: a compare-and-set against the table that
queues its journal event and never yields, table-tested without a process."""

from __future__ import annotations

import inspect
import itertools

import anyio
import anyio.lowlevel
import pytest

from sbproxy.config import DeploymentConfig
from sbproxy.model_host.runtime.admission import AdmissionGate
from sbproxy.model_host.runtime.deployment import (
    Deployment,
    IllegalTransition,
    Outbox,
    Transition,
)
from sbproxy.model_host.runtime.state import DEPLOYMENT_TRANSITIONS, DeploymentState

S = DeploymentState
CONFIG = DeploymentConfig.model_validate({"model": "tiny", "variant": "q4_k_m"})


def fresh(moved: list[Transition] | None = None) -> tuple[Deployment, Outbox]:
    outbox = Outbox()
    gate = AdmissionGate("tiny", max_active=1, max_queue=1, queue_timeout_s=1.0)
    hook = moved.append if moved is not None else None
    return Deployment("tiny", CONFIG, gate=gate, outbox=outbox, on_move=hook), outbox


def placed(state: DeploymentState) -> tuple[Deployment, Outbox]:
    """A deployment brought to ``state`` along allowed moves, its outbox emptied."""
    found, outbox = fresh()
    path = {
        S.CONFIGURED: [],
        S.PREPARING: [S.PREPARING],
        S.READY: [S.PREPARING, S.READY],
        S.DRAINING: [S.DRAINING],
        S.STOPPED: [S.DRAINING, S.STOPPED],
        S.FAILED: [S.PREPARING, S.FAILED],
    }[state]
    for step in path:
        found._move({found.state}, step)
    outbox.take()
    assert found.state is state
    return found, outbox


@pytest.mark.parametrize(
    ("before", "after"), list(itertools.product(DeploymentState, DeploymentState))
)
def test_a_move_the_table_allows_is_made_and_queued_and_any_other_is_refused(
    before: DeploymentState, after: DeploymentState
) -> None:
    found, outbox = placed(before)
    allowed = after is before or after in DEPLOYMENT_TRANSITIONS[before]
    if not allowed:
        with pytest.raises(IllegalTransition) as refused:
            found._move({before}, after, job_id="j1")
        assert refused.value.code == "illegal_transition"
        assert found.state is before
        assert len(outbox) == 0
        return
    found._move({before}, after, job_id="j1", reason_code="why")
    assert found.state is after
    assert found.reason_code == "why"
    queued = outbox.take()
    if after is before:
        assert queued == []  # the same state only updates the reason
    else:
        assert queued == [Transition("tiny", 0, before, after, "why", "j1")]


@pytest.mark.parametrize("actual", list(DeploymentState))
def test_a_move_from_a_state_the_caller_did_not_expect_is_refused(
    actual: DeploymentState,
) -> None:
    """Compare before set: the table allows X -> failed, but the caller expected another."""
    found, outbox = placed(actual)
    expected = {s for s in DeploymentState if s is not actual}
    with pytest.raises(IllegalTransition):
        found._move(expected, S.FAILED)
    assert found.state is actual
    assert len(outbox) == 0


def test_the_hook_sees_every_move_in_order_and_the_event_names_its_job() -> None:
    moved: list[Transition] = []
    found, outbox = fresh(moved)
    found.failed_before_launch("manual_artifact_missing", "no file", job_id="load-1")
    assert [(t.before, t.after) for t in moved] == [
        (S.CONFIGURED, S.PREPARING),
        (S.PREPARING, S.FAILED),
    ]
    events = [t.event_data() for t in outbox.take()]
    assert events[1] == {
        "deployment": "tiny",
        "generation": 0,
        "from": "preparing",
        "to": "failed",
        "reason_code": "manual_artifact_missing",
    }
    assert found.last_error == "no file"


def test_every_state_changing_method_is_synchronous() -> None:
    """A sequence of transitions cannot yield midway if nothing in it can await."""
    methods = [
        getattr(Deployment, name)
        for name in dir(Deployment)
        if not name.startswith("__") and callable(getattr(Deployment, name))
    ]
    assert methods
    assert [m.__name__ for m in methods if inspect.iscoroutinefunction(m)] == []


@pytest.mark.anyio
async def test_no_other_task_runs_between_two_transitions_of_one_sequence() -> None:
    """A watcher task that records the state at every scheduling point never sees the
    ``preparing`` that a failed load passes through on its way to ``failed``."""
    found, _ = fresh()
    seen: list[DeploymentState] = []
    stop = anyio.Event()

    async def watch() -> None:
        while not stop.is_set():
            seen.append(found.state)
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as group:
        group.start_soon(watch)
        for _ in range(3):
            await anyio.lowlevel.checkpoint()
        found.failed_before_launch("prepare_failed", "boom", job_id="j")
        for _ in range(3):
            await anyio.lowlevel.checkpoint()
        stop.set()
    assert S.CONFIGURED in seen and S.FAILED in seen
    assert S.PREPARING not in seen


def test_a_drain_keeps_a_failed_deployment_failed_with_its_error() -> None:
    found, outbox = placed(S.FAILED)
    found._move({S.FAILED}, S.FAILED, reason_code="crash_loop", error="exited 1")
    retained = found.begin_drain(job_id="d", reason="stop")
    assert found.state is S.DRAINING
    found.drained(retained, job_id="d", reason="stop")
    assert (found.state, found.reason_code, found.last_error) == (
        S.FAILED,
        "crash_loop",
        "exited 1",
    )
    assert [(t.before, t.after) for t in outbox.take()] == [
        (S.FAILED, S.DRAINING),
        (S.DRAINING, S.FAILED),
    ]


def test_unhealthy_after_consecutive_timeouts_asks_for_one_restart() -> None:
    found, _ = placed(S.READY)
    unhealthy_after = CONFIG.unhealthy_after
    answers = [found.count_outcome(0, timed_out=True) for _ in range(unhealthy_after + 2)]
    assert answers == [False] * (unhealthy_after - 1) + [True, False, False]
    found.restart_finished()
    assert found.count_outcome(0, timed_out=False) is False
    assert found.timeouts == 0
    assert found.count_outcome(7, timed_out=True) is False  # another generation


def test_an_eviction_is_marked_until_drained_and_an_operator_drain_over_it_is_not() -> None:
    found, _ = placed(S.READY)
    retained = found.begin_evict(job_id="job-of-the-swap")
    assert (found.state, found.evicting) == (S.DRAINING, True)
    found.drained(retained, job_id="job-of-the-swap", reason="evicted")
    assert (found.state, found.reason_code, found.evicting) == (S.STOPPED, "evicted", False)

    found, _ = placed(S.READY)
    found.begin_evict(job_id=None)
    found.begin_drain(job_id="stop", reason="stop")  # an operator's stop meets the eviction
    assert (found.state, found.evicting) == (S.DRAINING, False)


def held_by(found: Deployment) -> str | None:
    return found.exhausted_job


def test_an_exhausted_load_holds_failed_until_reset_or_an_explicit_load() -> None:
    found, outbox = placed(S.CONFIGURED)
    found.load_exhausted("job-1", "recovered 3 times without completing a step")
    assert (found.state, found.reason_code, found.job_id) == (
        S.FAILED,
        "recovery_exhausted",
        "job-1",
    )
    assert held_by(found) == "job-1"
    assert found.last_error == "recovered 3 times without completing a step"
    assert [(t.before, t.after) for t in outbox.take()] == [
        (S.CONFIGURED, S.PREPARING),
        (S.PREPARING, S.FAILED),
    ]
    assert found.reset(job_id="reset-1") is True
    assert (found.state, held_by(found)) == (S.CONFIGURED, None)

    found, _ = placed(S.STOPPED)
    found.load_exhausted("job-2", "died in launch")
    found.clear_exhausted()
    assert (found.state, held_by(found)) == (S.FAILED, None)  # failed until it launches
