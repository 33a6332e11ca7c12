"""Prefix-aware routing's pure parts (issue 34, item 1): the key of a request's head, the
rendezvous order of replicas for a key, and the choice bounded by load."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from sbproxy.api.prefix_route import local_choice
from sbproxy.fleet.agent import routing_policies
from sbproxy.fleet.control import definition_digest
from sbproxy.fleet.prefix import (
    PREFIX_BLOCK_BYTES,
    Choice,
    PrefixOutcome,
    choose,
    load_bound,
    prefix_key,
    rendezvous_order,
)

CHAT = "/v1/chat/completions"
SYSTEM = {"role": "system", "content": "You answer questions about the fleet. " * 40}
OTHER = {"role": "system", "content": "You translate into French. " * 40}
REPLICAS = ["node-a/chat", "node-a/chat.r1", "node-b/chat", "node-c/chat"]


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def chat_key(*messages: dict[str, Any]) -> bytes | None:
    return prefix_key(CHAT, {"messages": list(messages)})


def keys(count: int) -> list[bytes]:
    found = [
        chat_key({"role": "system", "content": f"prompt {i}"}, user("hi")) for i in range(count)
    ]
    assert all(k is not None for k in found)
    return [k for k in found if k is not None]


# -- the key --------------------------------------------------------------------------------


def test_every_turn_of_a_conversation_keys_on_its_system_prompt() -> None:
    first = chat_key(SYSTEM, user("What is a replica?"))
    later = chat_key(
        SYSTEM,
        user("What is a replica?"),
        {"role": "assistant", "content": "A copy of a deployment."},
        user("And a node?"),
    )
    other_user = chat_key(SYSTEM, user("Something else entirely"))
    assert first is not None and len(first) == 16
    assert first == later == other_user
    assert chat_key(OTHER, user("What is a replica?")) != first


def test_the_head_is_every_leading_system_or_developer_message() -> None:
    developer = {"role": "developer", "content": "Be brief."}
    assert chat_key(SYSTEM, developer, user("a")) == chat_key(SYSTEM, developer, user("b"))
    assert chat_key(SYSTEM, developer, user("a")) != chat_key(SYSTEM, user("a"))


def test_without_a_system_prompt_the_first_message_is_the_head() -> None:
    opening = user("Summarise this long document: " + "text " * 500)
    turn_one = chat_key(opening)
    turn_two = chat_key(opening, {"role": "assistant", "content": "Done."}, user("Shorter?"))
    assert turn_one is not None and turn_one == turn_two
    assert chat_key(user("another opening")) != turn_one


def test_the_encoding_is_canonical_key_order_does_not_matter() -> None:
    reordered = {"content": SYSTEM["content"], "role": "system"}
    assert chat_key(reordered, user("x")) == chat_key(SYSTEM, user("x"))


def test_the_key_covers_the_first_block_only() -> None:
    head = "a" * PREFIX_BLOCK_BYTES
    late = chat_key({"role": "system", "content": head + "one"}, user("x"))
    other_late = chat_key({"role": "system", "content": head + "two"}, user("x"))
    early = chat_key({"role": "system", "content": "b" + head[1:] + "one"}, user("x"))
    assert late == other_late
    assert early != late


def test_completions_key_on_the_prompts_first_block() -> None:
    path = "/v1/completions"
    base = "Once upon a time " * 400
    assert len(base.encode()) > PREFIX_BLOCK_BYTES
    assert prefix_key(path, {"prompt": base + "A"}) == prefix_key(path, {"prompt": base + "B"})
    assert prefix_key(path, {"prompt": "short one"}) != prefix_key(path, {"prompt": "short two"})
    assert prefix_key(path, {"prompt": [1, 2, 3]}) == prefix_key(path, {"prompt": [1, 2, 3]})
    assert prefix_key(path, {"prompt": [1, 2, 3]}) != prefix_key(path, {"prompt": [1, 2, 4]})


@pytest.mark.parametrize(
    ("path", "document"),
    [
        ("/v1/embeddings", {"input": "text"}),
        ("/v1/completions", {"prompt": ""}),
        ("/v1/completions", {"prompt": []}),
        (CHAT, {"messages": []}),
        (CHAT, {}),
    ],
)
def test_what_has_no_key(path: str, document: dict[str, Any]) -> None:
    assert prefix_key(path, document) is None


# -- the rendezvous order ---------------------------------------------------------------------


def test_two_independent_routers_agree_whatever_order_they_list_replicas_in() -> None:
    for key in keys(50):
        one = rendezvous_order(key, REPLICAS)
        other = rendezvous_order(key, list(reversed(REPLICAS)))
        assert one == other
        assert sorted(one) == sorted(REPLICAS)
        # A fresh decode of the same request gives the same key, hence the same order.
        again = chat_key(json.loads(json.dumps({"role": "system", "content": "x"})), user("y"))
        assert again == chat_key({"role": "system", "content": "x"}, user("z"))


def test_keys_spread_over_the_replicas() -> None:
    first = Counter(rendezvous_order(key, REPLICAS)[0] for key in keys(800))
    assert set(first) == set(REPLICAS)
    assert all(120 <= count <= 280 for count in first.values()), first


def test_a_removed_replica_moves_only_its_own_prefixes_and_spreads_them() -> None:
    gone = "node-b/chat"
    left = [r for r in REPLICAS if r != gone]
    moved: Counter[str] = Counter()
    for key in keys(400):
        before = rendezvous_order(key, REPLICAS)
        after = rendezvous_order(key, left)
        if before[0] == gone:
            assert after[0] == before[1]  # to its next in order
            moved[after[0]] += 1
        else:
            assert after[0] == before[0]
    assert set(moved) == set(left)


def test_an_added_replica_takes_prefixes_only_from_where_they_were() -> None:
    grown = [*REPLICAS, "node-d/chat"]
    taken = 0
    for key in keys(400):
        before, after = rendezvous_order(key, REPLICAS)[0], rendezvous_order(key, grown)[0]
        if after != before:
            assert after == "node-d/chat"
            taken += 1
    assert 40 <= taken <= 130  # about a fifth


# -- the load bound ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "replicas", "bound"),
    [(0, 1, 2), (0, 2, 1), (1, 2, 2), (2, 2, 2), (3, 2, 3), (7, 2, 5), (10, 4, 4), (0, 4, 1)],
)
def test_the_bound_is_the_fair_share_times_the_factor(
    total: int, replicas: int, bound: int
) -> None:
    assert load_bound(total, replicas) == bound


@pytest.mark.parametrize(
    ("total", "replicas", "factor"), [(0, 0, 1.25), (-1, 2, 1.25), (0, 2, 0.9)]
)
def test_a_bound_of_nothing_is_a_caller_bug(total: int, replicas: int, factor: float) -> None:
    with pytest.raises(ValueError, match="need replicas"):
        load_bound(total, replicas, factor)


def test_an_idle_fleet_sends_a_key_to_its_first_choice() -> None:
    key = keys(1)[0]
    first = rendezvous_order(key, REPLICAS)[0]
    assert choose(key, dict.fromkeys(REPLICAS, 0)) == Choice(first, PrefixOutcome.FIRST_CHOICE)
    assert choose(key, {}) is None


def test_a_busy_first_choice_passes_the_key_to_the_next_in_order() -> None:
    key = keys(1)[0]
    order = rendezvous_order(key, REPLICAS)
    loads = {order[0]: 6, order[1]: 5, order[2]: 0, order[3]: 1}  # total 12: bound 5
    assert choose(key, loads) == Choice(order[2], PrefixOutcome.LOAD_BOUND)


def test_one_hot_prefix_never_takes_a_replica_over_its_bound() -> None:
    key = keys(1)[0]
    loads = dict.fromkeys(REPLICAS, 0)
    outcomes: Counter[PrefixOutcome] = Counter()
    for _ in range(40):  # every request stays in flight
        bound = load_bound(sum(loads.values()), len(loads))
        choice = choose(key, loads)
        assert choice is not None
        assert loads[choice.replica] < bound
        loads[choice.replica] += 1
        outcomes[choice.outcome] += 1
    order = rendezvous_order(key, REPLICAS)
    assert loads[order[0]] == max(loads.values()) <= load_bound(39, 4)
    # The first choice holds no more than its share times the factor (13 of 40); the rest
    # overflowed in rendezvous order, over at least two more replicas.
    assert sum(1 for count in loads.values() if count) >= 3
    assert outcomes[PrefixOutcome.FIRST_CHOICE] > 0 and outcomes[PrefixOutcome.LOAD_BOUND] > 0


def test_a_negative_load_is_a_caller_bug() -> None:
    with pytest.raises(ValueError, match="loads must be"):
        choose(keys(1)[0], {"node-a/chat": -1})


# -- the switch -------------------------------------------------------------------------------


def test_the_routing_table_takes_each_deployments_routing_from_the_desired_state() -> None:
    document = json.dumps(
        {
            "deployments": {
                "chat": {"model": "m", "routing": "prefix"},
                "embed": {"model": "e"},
            }
        }
    )
    assert routing_policies(document) == {"chat": "prefix", "embed": "least_outstanding"}
    assert routing_policies(None) == {}


def test_switching_routing_does_not_roll_the_replicas() -> None:
    before = {"model": "m", "variant": "q4_k_m", "max_concurrency": 4}
    assert definition_digest({**before, "routing": "prefix"}) == definition_digest(before)
    assert definition_digest({**before, "max_concurrency": 2}) != definition_digest(before)


def test_a_hop_picks_the_replica_its_caller_chose_among_its_nodes_own() -> None:
    # The calling gateway chose over every replica of the fleet; the node it chose picks
    # among its own replicas with the same key and ids: the same one, while within bounds.
    agreed = 0
    for key in keys(200):
        first = rendezvous_order(key, REPLICAS)[0]
        node, local = first.split("/")
        own = {r.split("/")[1]: 0 for r in REPLICAS if r.startswith(f"{node}/")}
        assert local_choice(key, node, own) == local
        agreed += len(own) > 1
    assert agreed > 0  # some keys landed on the node with two replicas
    assert local_choice(keys(1)[0], "node-a", {}) is None
