"""In-process tallies of finished jobs, for metrics: counts by workflow and terminal status,
and a histogram of run durations by workflow.

:class:`~sbproxy.store.JobStore` records a job here right after the compare-and-set write
that made it terminal committed, so each transition is counted once by the process that made
it, and a scrape reads these tallies without touching the database. Counts start at zero
with each process (Prometheus counters reset on restart).
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field, replace

__all__ = [
    "DURATION_BUCKETS_S",
    "GROUP_SIZE_BUCKETS",
    "WRITE_BUCKETS_S",
    "DurationHistogram",
    "JobOutcomes",
    "WriteTallies",
]

# Upper bounds (seconds) of the duration buckets: jobs range from a sub-second reset to a
# pull of tens of GiB that runs for an hour.
DURATION_BUCKETS_S: tuple[float, ...] = (
    0.1,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
)

# Upper bounds (seconds) of the journal write buckets: a commit on a quiet SSD takes ~0.2 ms;
# a write that waits seconds means another process holds the database or the disk stalls.
WRITE_BUCKETS_S: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

# Upper bounds of the group-commit size buckets (writes sharing one COMMIT; at most 64).
GROUP_SIZE_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class DurationHistogram:
    """Observations of one workflow's durations.

    Attributes:
        bounds: Upper bounds of the buckets (default :data:`DURATION_BUCKETS_S`).
        buckets: Count per bucket of ``bounds``, plus one for ``+Inf`` (not cumulative).
        total_s: Sum of all observations, seconds.
        count: Number of observations.
    """

    bounds: tuple[float, ...] = DURATION_BUCKETS_S
    buckets: list[int] = field(default_factory=list)
    total_s: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.buckets:
            self.buckets = [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float) -> None:
        """Add one observation."""
        self.buckets[bisect.bisect_left(self.bounds, seconds)] += 1
        self.total_s += seconds
        self.count += 1

    def copy(self) -> DurationHistogram:
        """An independent copy (what a scrape reads while observations go on)."""
        return replace(self, buckets=list(self.buckets))

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, cumulative count)`` per bucket, ending with ``("+Inf", count)``."""
        running = 0
        out: list[tuple[str, int]] = []
        for bound, value in zip((*self.bounds, float("inf")), self.buckets, strict=True):
            running += value
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


class JobOutcomes:
    """Jobs that reached a terminal status in this process, since it started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}
        self._durations: dict[str, DurationHistogram] = {}

    def record(self, *, kind: str, status: str, duration_s: float | None) -> None:
        """Count one job of workflow ``kind`` that became ``status``.

        Args:
            kind: The workflow name.
            status: The terminal status (``succeeded``, ``failed``, ``cancelled``).
            duration_s: Seconds from its first start to its end; ``None`` for a job that
                never ran (cancelled while queued), which is counted but not timed.
        """
        with self._lock:
            self._counts[(kind, status)] = self._counts.get((kind, status), 0) + 1
            if duration_s is not None:
                histogram = self._durations.setdefault(kind, DurationHistogram())
                histogram.observe(max(0.0, duration_s))

    def counts(self) -> dict[tuple[str, str], int]:
        """A copy of the counts by ``(workflow, status)``."""
        with self._lock:
            return dict(self._counts)

    def durations(self) -> dict[str, DurationHistogram]:
        """A copy of the duration histograms by workflow."""
        with self._lock:
            return {kind: h.copy() for kind, h in self._durations.items()}


class WriteTallies:
    """How this process's journal writes went, for metrics: seconds each write waited before
    its transaction began (queued behind other writes, then ``BEGIN IMMEDIATE`` waiting for
    another process's lock), seconds each ``COMMIT`` took (the fsync: the disk's share), and
    how many writes shared each commit. A busy host shows in the wait; a slow disk in the
    commit.

    Written by the writer thread, read by a scrape: guarded by a lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waits = DurationHistogram(bounds=WRITE_BUCKETS_S)
        self._commits = DurationHistogram(bounds=WRITE_BUCKETS_S)
        self._groups = DurationHistogram(bounds=GROUP_SIZE_BUCKETS)

    def began(self, waits_s: list[float]) -> None:
        """One transaction began; ``waits_s``: how long each of its writes waited."""
        with self._lock:
            for wait in waits_s:
                self._waits.observe(wait)

    def committed(self, *, seconds: float, writes: int) -> None:
        """One ``COMMIT`` took ``seconds`` and made ``writes`` writes durable."""
        with self._lock:
            self._commits.observe(seconds)
            self._groups.observe(writes)

    def snapshot(self) -> tuple[DurationHistogram, DurationHistogram, DurationHistogram]:
        """Copies of ``(waits, commits, group sizes)``."""
        with self._lock:
            return self._waits.copy(), self._commits.copy(), self._groups.copy()
