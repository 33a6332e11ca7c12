"""``sbproxy apply``'s fleet summary (pure): the fleet's change, deployment by deployment --
never a local plan's ``added -`` for a new deployment or ``preserved`` for a replica change."""

from __future__ import annotations

from typing import Any

from sbproxy.api.desired import fleet_change
from sbproxy.cli.apply_cmd import fleet_summary

TINY = {"model": "tiny", "variant": "q4_k_m"}


def answer(before: dict[str, Any], after: dict[str, Any], *, revision: int) -> dict[str, Any]:
    return {
        "revision": revision,
        "previous_revision": revision - 1 if revision > 1 else None,
        "written": True,
        "change": fleet_change(before, after),
    }


def test_a_new_deployment_is_added_with_its_replicas() -> None:
    lines = fleet_summary(answer({}, {"chat": {**TINY, "replicas": 2}}, revision=1))
    assert lines == ["fleet revision 1 committed (the first)", "  added     chat (2 replicas)"]


def test_a_replica_count_change_and_other_fields_are_named() -> None:
    before = {"chat": {**TINY, "replicas": 2}, "old": TINY, "same": TINY}
    after = {
        "chat": {**TINY, "replicas": 3},
        "same": {**TINY, "replicas": 1},  # the default, spelled out: unchanged
        "embed": {**TINY, "max_context": 2048},
    }
    assert fleet_summary(answer(before, after, revision=3)) == [
        "fleet revision 3 committed (was 2)",
        "  added     embed (1 replica)",
        "  changed   chat: replicas 2 -> 3",
        "  removed   old (1 replica)",
        "  unchanged same",
    ]
    both = fleet_change({"chat": TINY}, {"chat": {**TINY, "replicas": 2, "max_context": 2048}})
    (row,) = both["changed"]
    assert row == {
        "deployment": "chat",
        "fields": ["max_context", "replicas"],
        "replicas": {"from": 1, "to": 2},
    }
    lines = fleet_summary({"revision": 2, "previous_revision": 1, "written": True, "change": both})
    assert lines[1] == "  changed   chat: replicas 1 -> 2; max_context"


def test_an_unchanged_revision_says_so_and_lists_nothing() -> None:
    unchanged = {"revision": 4, "previous_revision": 4, "written": False, "change": {}}
    assert fleet_summary(unchanged) == [
        "fleet revision 4 unchanged: the fleet runs these deployments already"
    ]
