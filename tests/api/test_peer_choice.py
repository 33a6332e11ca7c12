"""Peer dispatch's choices, without a network: where a request is served from a routing
table (``serves_here``), which peer is picked (``pick``), the rotation on an injected clock,
and the credential check of a hop (``admit_hop``)."""

from __future__ import annotations

import pytest

from sbproxy.api.peers import NoReadyReplica, PeerDispatch, PeerUnauthorized
from sbproxy.config import PriorityClass
from sbproxy.fleet.routing import PeerReplica
from tests.api.fleet_hosts import CREDENTIAL, Clock, StaticDirectory


def rep(
    node: str, *, ready: bool = True, active: int = 0, queued: int = 0, loaded: bool = True
) -> PeerReplica:
    return PeerReplica(
        deployment="tiny",
        node_id=node,
        base_url=f"http://{node}.invalid:8080",
        generation=1,
        ready=ready,
        active=active,
        queued=queued,
        loaded=loaded,
    )


def dispatch(*replicas: PeerReplica, clock: Clock | None = None) -> PeerDispatch:
    directory = StaticDirectory("a")
    directory.replicas = {"tiny": replicas} if replicas else {}
    return PeerDispatch(directory, credential=CREDENTIAL, cooldown_s=5, clock=clock or Clock())


@pytest.mark.parametrize(
    ("replicas", "known", "running", "here"),
    [
        # Not a fleet deployment: this host's own, as on a single host.
        ((), True, False, True),
        ((), False, False, False),
        # The replica placed here, ready: served here, however idle the peers are.
        ((rep("a", active=50), rep("b")), True, False, True),
        # The table lists one here, but this host's runtime lacks the deployment (yet).
        ((rep("a"), rep("b")), False, False, False),
        # Placed here, listed not ready: a peer's ...
        ((rep("a", ready=False), rep("b")), True, False, False),
        # ... or none: never started by a request (its node may have fenced itself) ...
        ((rep("a", ready=False), rep("b", ready=False)), True, False, False),
        ((rep("a", ready=False),), True, False, False),
        # ... unless its engine runs here now (the table lags a load by a heartbeat).
        ((rep("a", ready=False), rep("b")), True, True, True),
        # Placed elsewhere only: never served here, even with an engine still running.
        ((rep("b"),), True, True, False),
        ((rep("b", ready=False),), True, False, False),
    ],
)
def test_where_a_request_is_served(
    replicas: tuple[PeerReplica, ...], known: bool, running: bool, here: bool
) -> None:
    found = dispatch(*replicas).serves_here("tiny", known=known, running=lambda: running)
    assert found is here


def test_the_fewest_outstanding_ready_peer_is_picked_and_ties_take_turns() -> None:
    chooser = dispatch(
        rep("a"),  # this node: never a peer
        rep("b", active=1, queued=1),
        rep("c", active=1),
        rep("d", queued=1),
        rep("e", ready=False),
    )
    picked = [chooser.pick("tiny", set()) for _ in range(4)]
    assert [p.node_id for p in picked if p is not None] == ["d", "c", "d", "c"]
    assert chooser.pick("tiny", {"c", "d"}) == rep("b", active=1, queued=1)
    assert chooser.pick("tiny", {"b", "c", "d"}) is None
    assert chooser.pick("other", set()) is None


def test_an_idle_loadable_peer_is_picked_only_when_no_loaded_one_is_left() -> None:
    chooser = dispatch(
        rep("b", loaded=False),  # idle: its node loads it first
        rep("c", active=4, queued=4),
        rep("d", active=1, loaded=False),
    )
    picked = chooser.pick("tiny", set())
    assert picked is not None and picked.node_id == "c"  # however busy
    picked = chooser.pick("tiny", {"c"})
    assert picked is not None and picked.node_id == "b"  # the least busy idle one
    picked = chooser.pick("tiny", {"b", "c"})
    assert picked is not None and picked.node_id == "d"
    # An idle one placed here is served here (its own client's request loads it).
    assert chooser.serves_here("tiny", known=True, running=lambda: False) is False
    here = dispatch(rep("a", loaded=False), rep("c"))
    assert here.serves_here("tiny", known=True, running=lambda: False) is True


def test_a_peer_holding_a_request_unanswered_past_the_first_token_limit_ranks_last() -> None:
    clock = Clock()
    chooser = dispatch(rep("b"), rep("c", active=4), rep("d", loaded=False), clock=clock)
    ticket = chooser._ticket(rep("b"), None)  # sent now; first-token limit 120 s (defaults)
    assert chooser.pick("tiny", set()) == rep("b")  # 1 in flight against c's 4
    clock.now += 120
    assert chooser.pick("tiny", set()) == rep("b")  # not past the limit yet
    clock.now += 0.1
    # Past it: after the busier loaded one and the idle one, and still there when alone.
    assert chooser.pick("tiny", set()) == rep("c", active=4)
    assert chooser.pick("tiny", {"c"}) == rep("d", loaded=False)
    assert chooser.pick("tiny", {"c", "d"}) == rep("b")
    # Its answer's headers came (a stream under way): no longer taken for hung.
    ticket.answered()
    assert chooser.pick("tiny", set()) == rep("b")
    ticket.release()
    assert chooser.in_flight("b", "tiny") == 0


def test_a_peer_that_advertises_no_url_is_never_picked() -> None:
    unreachable = PeerReplica("tiny", "b", "", 1, True, 0, 0)
    assert dispatch(unreachable, rep("c", active=9)).pick("tiny", set()) == rep("c", active=9)
    assert dispatch(unreachable).pick("tiny", set()) is None


def test_a_failed_peer_is_out_of_rotation_for_the_cool_down_only() -> None:
    clock = Clock()
    chooser = dispatch(rep("b"), rep("c", active=3), clock=clock)
    chooser.out_of_rotation(rep("b"), "ClientConnectorError")
    assert chooser.out_now() == ["b"]
    picked = chooser.pick("tiny", set())
    assert picked is not None
    assert picked.node_id == "c"
    clock.now += 4.9
    assert chooser.out_now() == ["b"]
    clock.now += 0.1
    assert chooser.out_now() == []
    picked = chooser.pick("tiny", set())
    assert picked is not None
    assert picked.node_id == "b"


def test_a_hop_needs_the_fleet_credential_and_carries_the_callers_class() -> None:
    chooser = dispatch()
    caller = chooser.admit_hop(f"Bearer {CREDENTIAL}", "batch")
    assert (caller.name, caller.priority) == (None, PriorityClass.BATCH)
    assert chooser.admit_hop(f"bearer {CREDENTIAL}", None).priority is PriorityClass.STANDARD
    assert chooser.admit_hop(f"Bearer {CREDENTIAL}", "nonsense").priority is PriorityClass.STANDARD
    for wrong in (None, "", CREDENTIAL, f"Basic {CREDENTIAL}", f"Bearer {CREDENTIAL}x"):
        with pytest.raises(PeerUnauthorized) as refused:
            chooser.admit_hop(wrong, None)
        assert refused.value.code == "peer_unauthorized"
        assert CREDENTIAL not in refused.value.message
    without = PeerDispatch(StaticDirectory("a"), credential=None)
    with pytest.raises(PeerUnauthorized):
        without.admit_hop(f"Bearer {CREDENTIAL}", None)


def test_a_reload_takes_the_new_credential_and_keeps_the_rotation() -> None:
    chooser = dispatch(rep("b"))
    chooser.out_of_rotation(rep("b"), "test")
    chooser.configure(credential="another-fleet-credential-0123", cooldown_s=5)
    assert chooser.out_now() == ["b"]
    with pytest.raises(PeerUnauthorized):
        chooser.admit_hop(f"Bearer {CREDENTIAL}", None)
    chooser.admit_hop("Bearer another-fleet-credential-0123", None)


def test_no_ready_replica_is_retryable() -> None:
    error = NoReadyReplica("none", details={"deployment": "tiny"})
    assert (error.code, error.retryable) == ("no_ready_replica", True)


COLD = {"state": "cold", "ready_replicas": 0, "desired_replicas": 1}


@pytest.mark.parametrize(
    ("replicas", "local", "expected"),
    [
        ((), None, ("unavailable", 0, 0)),
        ((), COLD, ("cold", 0, 1)),  # not the fleet's: this host's own
        ((rep("b"), rep("c")), None, ("ready", 2, 2)),
        ((rep("b"), rep("c", ready=False)), None, ("ready", 1, 2)),
        # Idle and loadable: a request loads it, as a single host's idle deployment.
        ((rep("b", loaded=False), rep("c")), None, ("ready", 1, 2)),
        ((rep("b", loaded=False), rep("c", ready=False)), None, ("cold", 0, 2)),
        # Listed, none ready: nothing answers now (the gateway starts no fleet replica).
        ((rep("a", ready=False), rep("b", ready=False)), COLD, ("unavailable", 0, 2)),
        ((rep("b", ready=False),), COLD, ("unavailable", 0, 1)),
    ],
)
def test_what_the_model_list_says_of_a_fleet_deployment(
    replicas: tuple[PeerReplica, ...],
    local: dict[str, object] | None,
    expected: tuple[str, int, int],
) -> None:
    found = dispatch(*replicas).availability("tiny", local=local)
    assert (found["state"], found["ready_replicas"], found["desired_replicas"]) == expected


def test_a_peer_out_of_rotation_is_not_counted_ready() -> None:
    chooser = dispatch(rep("b"), rep("c"))
    chooser.out_of_rotation(rep("b"), "test")
    assert chooser.availability("tiny", local=None)["ready_replicas"] == 1
