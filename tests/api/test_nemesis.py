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

import json
from pathlib import Path

import pytest

from tests.support.nemesis import Nemesis, seed_from_environment

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

DEFAULT_SEED = 30
SCHEDULE_S = 70.0


def test_every_invariant_holds_under_a_random_schedule_of_faults(tmp_path: Path) -> None:
    seed = seed_from_environment(DEFAULT_SEED)
    print(f"nemesis seed {seed} (SBPROXY_NEMESIS_SEED={seed} replays it)")
    report = Nemesis(tmp_path, seed=seed, seconds=SCHEDULE_S).run()
    print(json.dumps(report.figures(), indent=2, sort_keys=True))
    # The schedule really injected faults and the loop really sent requests.
    assert sum(report.faults.values()) >= 5, report.failure()
    assert report.requests["ok"] > 0, report.failure()
    assert report.violations == [], report.failure()
