"""Node states: the transition table, state derived from the lease, the self-fence verdict."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sbproxy.config import FleetConfig
from sbproxy.fleet.membership import (
    NODE_TRANSITIONS,
    FenceVerdict,
    FleetTiming,
    IllegalNodeTransition,
    NodeState,
    PeerAnswer,
    derive_state,
    fence_verdict,
    idle_loadable,
    move,
    replica_state,
)

S = NodeState
TIMING = FleetTiming(heartbeat_ms=1_000, fence_after_ms=4_000, lost_after_ms=8_000)


@pytest.mark.parametrize(
    ("expected", "to"),
    [
        (S.READY, S.SUSPECT),
        (S.READY, S.LOST),
        (S.READY, S.CORDONED),
        (S.READY, S.DRAINING),
        (S.READY, S.LEFT),
        (S.SUSPECT, S.READY),
        (S.SUSPECT, S.LOST),
        (S.CORDONED, S.READY),
        (S.CORDONED, S.DRAINING),
        (S.DRAINING, S.CORDONED),
        (S.DRAINING, S.READY),
        (S.LOST, S.READY),
        (S.LOST, S.CORDONED),
        (S.LOST, S.LEFT),
        (S.READY, S.LEAVING),
        (S.LEAVING, S.READY),  # restarted within its grace
        (S.LEAVING, S.LOST),  # its grace ran out
    ],
)
def test_move_allows_listed_transitions(expected: NodeState, to: NodeState) -> None:
    transition = move(expected, to)
    assert (transition.from_state, transition.to_state) == (expected, to)
    assert transition.to_dict() == {"from": expected.value, "to": to.value}


@pytest.mark.parametrize(
    ("expected", "to"),
    [
        (S.LEFT, S.READY),
        (S.LEFT, S.LOST),
        (S.LEFT, S.CORDONED),
        (S.READY, S.READY),
        (S.LOST, S.LOST),
    ],
)
def test_move_refuses_what_the_table_does_not_list(expected: NodeState, to: NodeState) -> None:
    with pytest.raises(IllegalNodeTransition) as caught:
        move(expected, to)
    assert caught.value.code == "illegal_transition"
    assert caught.value.details == {"from_state": expected.value, "to_state": to.value}
    assert expected.value in caught.value.message


def test_left_is_terminal_and_every_state_has_a_row() -> None:
    assert set(NODE_TRANSITIONS) == set(NodeState)
    assert NODE_TRANSITIONS[S.LEFT] == frozenset()
    assert all(state not in targets for state, targets in NODE_TRANSITIONS.items())


@pytest.mark.parametrize(
    ("elapsed_ms", "cordoned", "draining", "left", "state"),
    [
        (0, False, False, False, S.READY),
        (1_000, False, False, False, S.READY),  # the next renewal is just due
        (1_500, False, False, False, S.READY),  # half a period of slack
        (1_501, False, False, False, S.SUSPECT),
        (7_999, False, False, False, S.SUSPECT),
        (8_000, False, False, False, S.LOST),
        (60_000, False, False, False, S.LOST),
        (-50, False, False, False, S.READY),  # "now" read before the renewal committed
        (0, True, False, False, S.CORDONED),
        (5_000, True, False, False, S.SUSPECT),  # a late renewal beats the flag (item 6)
        (5_000, False, True, False, S.SUSPECT),
        (0, False, True, False, S.DRAINING),
        (0, True, True, False, S.DRAINING),
        (8_000, True, False, False, S.LOST),  # liveness loss beats the flag
        (8_000, False, True, False, S.LOST),
        (0, False, False, True, S.LEFT),
        (99_000, True, True, True, S.LEFT),
    ],
)
def test_derive_state_from_lease_age_and_flags(
    elapsed_ms: int, cordoned: bool, draining: bool, left: bool, state: NodeState
) -> None:
    now = 1_700_000_000_000
    derived = derive_state(
        last_renewal_ms=now - elapsed_ms,
        now_ms=now,
        timing=TIMING,
        cordoned=cordoned,
        draining=draining,
        left=left,
    )
    assert derived is state


@pytest.mark.parametrize(
    ("leaving_for_ms", "grace_ms", "state"),
    [
        (0, None, S.LEAVING),  # out of rotation at once
        (TIMING.lost_after_ms // 2 - 1, None, S.LEAVING),  # default grace: half of lost
        (TIMING.lost_after_ms // 2, None, S.LOST),  # re-placed well before lost_after_ms
        (1_999, 2_000, S.LEAVING),
        (2_000, 2_000, S.LOST),
    ],
)
def test_a_node_that_stopped_gracefully_is_leaving_then_lost_after_its_grace(
    leaving_for_ms: int, grace_ms: int | None, state: NodeState
) -> None:
    """Issue 30, item 5: a graceful stop costs rejoin_grace_ms, not lost_after_ms."""
    timing = FleetTiming(
        heartbeat_ms=TIMING.heartbeat_ms,
        fence_after_ms=TIMING.fence_after_ms,
        lost_after_ms=TIMING.lost_after_ms,
        rejoin_grace_ms=grace_ms,
    )
    now = 1_700_000_000_000
    derived = derive_state(
        last_renewal_ms=now - leaving_for_ms - 10,
        now_ms=now,
        timing=timing,
        cordoned=True,
        leaving_since_ms=now - leaving_for_ms,
    )
    assert derived is state


@given(
    previous=st.sampled_from([s for s in NodeState if s is not S.LEFT]),
    elapsed=st.integers(min_value=-10_000, max_value=100_000),
    cordoned=st.booleans(),
    draining=st.booleans(),
    left=st.booleans(),
)
def test_every_derived_change_is_a_legal_move(
    previous: NodeState, elapsed: int, cordoned: bool, draining: bool, left: bool
) -> None:
    derived = derive_state(
        last_renewal_ms=100_000,
        now_ms=100_000 + elapsed,
        timing=TIMING,
        cordoned=cordoned,
        draining=draining,
        left=left,
    )
    if derived is not previous:
        move(previous, derived)


@pytest.mark.parametrize(
    ("heartbeat", "fence", "lost", "phrase"),
    [
        (0, 4_000, 8_000, "heartbeat_ms must be > 0"),
        (1_000, 1_000, 8_000, "greater than heartbeat_ms"),
        (5_000, 4_000, 8_000, "greater than heartbeat_ms"),
        (1_000, 8_000, 8_000, "less than lost_after_ms"),
        (1_000, 9_000, 8_000, "less than lost_after_ms"),
    ],
)
def test_timing_refuses_a_broken_order(heartbeat: int, fence: int, lost: int, phrase: str) -> None:
    with pytest.raises(ValueError, match=phrase):
        FleetTiming(heartbeat_ms=heartbeat, fence_after_ms=fence, lost_after_ms=lost)


def test_timing_from_config_and_suspect_threshold() -> None:
    timing = FleetTiming.from_config(
        FleetConfig(heartbeat_ms=2_000, fence_after_ms=9_000, lost_after_ms=21_000)
    )
    assert (timing.heartbeat_ms, timing.fence_after_ms, timing.lost_after_ms) == (
        2_000,
        9_000,
        21_000,
    )
    assert timing.suspect_after_ms == 3_000
    assert FleetTiming.from_config(FleetConfig()).lost_after_ms == 20_000
    assert FleetTiming.from_config(FleetConfig()).placement_timeout_ms == 600_000
    slow = FleetConfig(lost_after_ms=21_000, placement_timeout_ms=30_000)
    assert FleetTiming.from_config(slow).placement_timeout_ms == 30_000


def test_timing_refuses_a_placement_timeout_not_past_lost_after() -> None:
    with pytest.raises(ValueError, match=r"placement_timeout_ms \(8000\) must be greater"):
        FleetTiming(
            heartbeat_ms=1_000,
            fence_after_ms=4_000,
            lost_after_ms=8_000,
            placement_timeout_ms=8_000,
        )


# This node lost the database at database time 50_000 (its cut-off).
CUT_OFF_MS = 50_000
# Renewing all along, since before this node's failures began.
REACHED_RENEWING = PeerAnswer(
    node_id="b", reached=True, renewed_at_ms=CUT_OFF_MS + 200, streak_since_ms=1_000
)
REACHED_STUCK = PeerAnswer(
    node_id="c", reached=True, renewed_at_ms=CUT_OFF_MS - 100, streak_since_ms=1_000
)
UNREACHED = PeerAnswer(node_id="d", reached=False)


@pytest.mark.parametrize(
    ("since_ms", "peers_known", "answers", "verdict"),
    [
        (3_999, 2, [], FenceVerdict.SERVE),  # not overdue yet, nobody asked
        (3_999, 2, [UNREACHED, UNREACHED], FenceVerdict.SERVE),
        (4_000, 2, [REACHED_RENEWING, UNREACHED], FenceVerdict.FENCE),  # the odd one out
        (4_000, 2, [REACHED_STUCK, REACHED_RENEWING], FenceVerdict.FENCE),
        (4_000, 2, [UNREACHED, UNREACHED], FenceVerdict.FENCE),  # minority partition
        (4_000, 2, [], FenceVerdict.FENCE),  # peers exist, none reached
        (4_000, 2, [REACHED_STUCK, UNREACHED], FenceVerdict.HOLD),  # database down for all
        (4_000, 0, [], FenceVerdict.HOLD),  # a one-node fleet: nobody could re-place
        (50_000, 1, [REACHED_STUCK], FenceVerdict.HOLD),
    ],
)
def test_fence_verdict(
    since_ms: int, peers_known: int, answers: list[PeerAnswer], verdict: FenceVerdict
) -> None:
    assert (
        fence_verdict(
            since_own_renewal_ms=since_ms,
            cut_off_at_ms=CUT_OFF_MS,
            timing=TIMING,
            peers_known=peers_known,
            answers=answers,
        )
        is verdict
    )


def test_an_outage_for_everyone_fences_nobody_whoever_reaches_its_deadline_first() -> None:
    """Issue 30, item 0: three hosts renewed at 1_000, 1_100 and 1_150 (database time),
    then the database went down for all of them. The first to reach its deadline sees
    peers whose last renewals are younger than fence_after_ms -- 'recent' -- but none
    renewed after it had lost the database, so none fences."""
    renewed = {"a": 1_000, "b": 1_100, "c": 1_150}
    # Each one's first renewal after the outage failed a heartbeat later.
    cut_off = {node: at + TIMING.heartbeat_ms for node, at in renewed.items()}
    for node in renewed:
        answers = [
            PeerAnswer(node_id=peer, reached=True, renewed_at_ms=at)
            for peer, at in renewed.items()
            if peer != node
        ]
        verdict = fence_verdict(
            since_own_renewal_ms=TIMING.fence_after_ms,
            cut_off_at_ms=cut_off[node],
            timing=TIMING,
            peers_known=2,
            answers=answers,
        )
        assert verdict is FenceVerdict.HOLD, node


@pytest.mark.parametrize(
    ("streak_since_ms", "verdict"),
    [
        # The database came back for everyone at 20_000: the peer's renewals began again
        # after this node's last failure (19_900) -- it was down too. Hold; this node's next
        # renewal succeeds.
        (20_050, FenceVerdict.HOLD),
        # The peer renewed all along while this node failed: this node is the odd one out.
        (14_000, FenceVerdict.FENCE),
        # The peer's renewals broke once (a blip) after this node's failures began and go
        # on while this node still fails: fence too.
        (17_000, FenceVerdict.FENCE),
    ],
)
def test_the_end_of_an_outage_for_everyone_fences_nobody(
    streak_since_ms: int, verdict: FenceVerdict
) -> None:
    """This node's renewals failed from 15_000 to 19_900 (database time); the peer's last
    renewal was at 20_050, a moment before this node asks."""
    peer = PeerAnswer(
        node_id="b", reached=True, renewed_at_ms=20_050, streak_since_ms=streak_since_ms
    )
    got = fence_verdict(
        since_own_renewal_ms=TIMING.fence_after_ms,
        cut_off_at_ms=15_000,
        failing_until_ms=19_900,
        timing=TIMING,
        peers_known=1,
        answers=[peer],
    )
    assert got is verdict


def test_the_fence_bound_is_derived_and_a_timing_that_cannot_meet_it_is_refused() -> None:
    """Issue 30, item 22: the fence takes fence_after_ms plus two asks a heartbeat apart;
    a 5 s / 10 s / 15 s timing would fence at 19 s, after the fleet declared the node lost."""
    timing = FleetTiming(heartbeat_ms=2_000, fence_after_ms=10_000, lost_after_ms=20_000)
    assert timing.peer_ask_timeout_ms == 2_000
    assert timing.fence_bound_ms == 10_000 + 2 * 2_000 + 2_000
    with pytest.raises(ValueError, match=r"fence bound \(19000\)"):
        FleetTiming(heartbeat_ms=5_000, fence_after_ms=10_000, lost_after_ms=15_000)
    with pytest.raises(ValueError, match="lost_after_ms 15000 is too short"):
        FleetConfig(heartbeat_ms=5_000, fence_after_ms=10_000, lost_after_ms=15_000)


@pytest.mark.parametrize(
    ("node_state", "reported", "shown"),
    [
        (NodeState.READY, "ready", "ready"),
        (NodeState.SUSPECT, "ready", "unreachable"),  # no gateway routes there now
        (NodeState.LEAVING, "ready", "unreachable"),
        (NodeState.CORDONED, "ready", "ready"),
        (NodeState.DRAINING, "draining", "draining"),
        (NodeState.LOST, "ready", "unreachable"),
        (NodeState.LEFT, "ready", "unreachable"),
        ("lost", None, "unreachable"),
        (None, "ready", "ready"),  # a node the reader does not know yet
        (NodeState.READY, None, None),
    ],
)
def test_a_replica_on_a_lost_or_departed_node_is_shown_unreachable(
    node_state: NodeState | str | None, reported: str | None, shown: str | None
) -> None:
    assert replica_state(node_state, reported) == shown


@pytest.mark.parametrize(
    ("node_state", "reported", "reason_code", "shown"),
    [
        (NodeState.READY, "stopped", "keep_alive", "idle"),
        (NodeState.CORDONED, "stopped", "keep_alive", "idle"),
        (NodeState.LOST, "stopped", "keep_alive", "unreachable"),
        (NodeState.READY, "stopped", None, "stopped"),  # stopped by hand: not idle
        (NodeState.READY, "failed", "keep_alive", "failed"),
        (NodeState.READY, "ready", None, "ready"),
    ],
)
def test_a_replica_keep_alive_stopped_is_shown_idle(
    node_state: NodeState, reported: str, reason_code: str | None, shown: str
) -> None:
    assert replica_state(node_state, reported, reason_code=reason_code) == shown
    assert idle_loadable({"state": reported, "reason_code": reason_code}) is (
        reported == "stopped" and reason_code == "keep_alive"
    )
