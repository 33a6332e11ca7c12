"""The fleet nemesis, long: ``python benchmarks/nemesis.py --minutes N [--seed S]``.

The harness of ``tests/api/test_nemesis.py`` (:mod:`tests.support.nemesis`: three real
``sbproxy serve`` hosts on a throw-away PostgreSQL, a seeded random schedule of kills,
pauses, blackholed and refused journal links, blackholed peer links, database restarts and
freezes, applies and drains, a request loop through every gateway, invariants checked from
the processes every 200 ms) with a schedule of ``--minutes`` minutes. Progress lines go to
stderr; it prints ONE JSON object on stdout:

* ``seed``, ``wall_s``;
* ``faults``: faults injected, by kind; ``operations``: applies, drains and uncordons by
  outcome;
* ``violations``: ``count`` (must be 0), ``by_kind``, and ``each`` (``at_s`` after the
  schedule's start, ``kind``, ``detail``);
* ``requests``: requests by outcome (``ok``, ``retry_later``, ``host_down`` -- not judged:
  its host was killed or paused meanwhile -- and the failing ones), ``request_max_s``;
* ``convergence_s``: from the end of the schedule until the fleet converged (``null``: not
  within the bound);
* ``max_live_engines`` (the most seen at once, and the count allowed then) and
  ``max_allowed_engines``.

Exit status 0 when no invariant was violated, 1 otherwise (the timeline then goes to
stderr, and the hosts' directories and logs are kept). Run it from the repository root
with the test environment (``.venv``; PostgreSQL's Debian binaries, as ``scripts/test.sh``
installs them).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.nemesis import Nemesis


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="schedule length")
    parser.add_argument("--seed", type=int, default=None, help="default: a random one")
    args = parser.parse_args(argv)
    if args.minutes <= 0:
        parser.error("--minutes must be positive")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    print(f"nemesis seed {seed}", file=sys.stderr)
    root = Path(tempfile.mkdtemp(prefix="sbproxy-nemesis-"))
    report = Nemesis(
        root,
        seed=seed,
        seconds=args.minutes * 60,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    ).run()
    print(json.dumps(report.figures(), indent=2, sort_keys=True))
    if report.violations:
        # The hosts' logs stay for the post-mortem (their paths end the failure text).
        print(report.failure(), file=sys.stderr)
        return 1
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
