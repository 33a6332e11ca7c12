"""Local ids of replicas (``replica_deployment_id``) and the desired states whose ids would
collide with them (``replica_id_clashes``)."""

from __future__ import annotations

import pytest

from sbproxy.fleet.routing import (
    PeerReplica,
    replica_deployment_id,
    replica_id_clashes,
)


@pytest.mark.parametrize(
    ("deployment", "replica", "expected"),
    [("chat", 0, "chat"), ("chat", 1, "chat.r1"), ("qwen2.5-0.5b", 12, "qwen2.5-0.5b.r12")],
)
def test_replica_zero_keeps_the_deployment_id_the_others_add_their_index(
    deployment: str, replica: int, expected: str
) -> None:
    assert replica_deployment_id(deployment, replica) == expected


def test_a_negative_replica_index_is_a_caller_bug() -> None:
    with pytest.raises(ValueError, match="replica must be >= 0"):
        replica_deployment_id("chat", -1)


def test_an_id_that_another_deployment_s_replicas_may_run_under_clashes() -> None:
    ids = {"chat", "chat.r2", "chat.r0", "x.r1", "y.r01"}
    assert replica_id_clashes(ids) == [("chat.r2", "chat", 2)]
    # Whatever chat's replica count now: an earlier revision's replica 1 may still stop.
    assert replica_id_clashes(["chat", "chat.r1"]) == [("chat.r1", "chat", 1)]
    assert replica_id_clashes(["chat.r1"]) == []


def test_a_table_entry_without_a_local_id_runs_under_the_deployment_id() -> None:
    entry = PeerReplica("chat", "a", "http://n", 1, ready=True, active=0, queued=0)
    assert entry.runtime_id == "chat"
    named = PeerReplica("chat", "a", "http://n", 1, True, 0, 0, local_id="chat.r1")
    assert named.runtime_id == "chat.r1"
