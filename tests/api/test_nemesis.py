"""The fleet under a seeded random schedule of real faults (issue 30, STYLE.md 18).

Three real ``sbproxy serve`` hosts on a real PostgreSQL of the test's own, each journal
link and each peer link through a relay the test controls; :mod:`tests.support.nemesis`
kills, pauses, blackholes and refuses, restarts and freezes the database, applies and
drains in between, while a request loop runs through every gateway and invariants are
checked from the processes every 200 ms. The schedule injects faults for
:data:`SCHEDULE_S`; the whole test (set-up, convergence, teardown) stays within 3 minutes.

``SBPROXY_NEMESIS_SEED=<seed>`` replays a run; without it the seed is :data:`DEFAULT_SEED`,
printed in the output either way. A failure prints the seed, every violated invariant and
the timeline of faults. The long run is ``benchmarks/nemesis.py --minutes N``.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from tests.support.nemesis import (
    FAULTS,
    OP_SPACING_S,
    OPERATIONS,
    Nemesis,
    plan,
    seed_from_environment,
)

DEFAULT_SEED = 30
SCHEDULE_S = 70.0


@pytest.mark.parametrize("seed", [DEFAULT_SEED, 1, 2, 3, 4])
def test_a_schedule_is_replayable_and_keeps_its_bounds(seed: int) -> None:
    """The harness's own promises: one seed, one schedule; every kind in a short run; at
    most two faults at a time, never two on one host; a database fault alone; operations
    spaced; each step within its kind's duration bounds."""
    steps = plan(seed, seconds=SCHEDULE_S)
    assert steps == plan(seed, seconds=SCHEDULE_S)
    assert steps != plan(seed + 1, seconds=SCHEDULE_S)
    assert {s.kind for s in steps} == set(FAULTS) | set(OPERATIONS)
    for step in steps:
        low, high = FAULTS.get(step.kind) or OPERATIONS[step.kind]
        assert low <= step.duration <= high and step.at < SCHEDULE_S
        others = [o for o in steps if o is not step and o.at <= step.at < o.end]
        others = [o for o in others if o.kind != "apply"]
        if step.kind.startswith("db_"):
            assert others == [] and step.target is None
        else:
            assert step.target not in {o.target for o in others}
            assert not any(o.kind.startswith("db_") for o in others)
        if step.kind in FAULTS:
            assert sum(1 for o in others if o.kind in FAULTS) <= 1
    ops = [s.at for s in steps if s.kind in OPERATIONS]
    assert all(b - a >= OP_SPACING_S for a, b in itertools.pairwise(ops))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_invariant_holds_under_a_random_schedule_of_faults(tmp_path: Path) -> None:
    seed = seed_from_environment(DEFAULT_SEED)
    print(f"nemesis seed {seed} (SBPROXY_NEMESIS_SEED={seed} replays it)")
    report = Nemesis(tmp_path, seed=seed, seconds=SCHEDULE_S).run()
    print(json.dumps(report.figures(), indent=2, sort_keys=True))
    # The schedule really injected faults and the loop really sent requests.
    assert sum(report.faults.values()) >= 5, report.failure()
    assert report.requests["ok"] > 0, report.failure()
    assert report.violations == [], report.failure()
