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
from dataclasses import dataclass, field

__all__ = ["DURATION_BUCKETS_S", "DurationHistogram", "JobOutcomes"]

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


@dataclass
class DurationHistogram:
    """Observations of one workflow's durations.

    Attributes:
        buckets: Count per bucket of :data:`DURATION_BUCKETS_S`, plus one for ``+Inf``
            (not cumulative).
        total_s: Sum of all observations, seconds.
        count: Number of observations.
    """

    buckets: list[int] = field(default_factory=lambda: [0] * (len(DURATION_BUCKETS_S) + 1))
    total_s: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        """Add one observation."""
        self.buckets[bisect.bisect_left(DURATION_BUCKETS_S, seconds)] += 1
        self.total_s += seconds
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, cumulative count)`` per bucket, ending with ``("+Inf", count)``."""
        running = 0
        out: list[tuple[str, int]] = []
        for bound, value in zip((*DURATION_BUCKETS_S, float("inf")), self.buckets, strict=True):
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
            return {
                kind: DurationHistogram(list(h.buckets), h.total_s, h.count)
                for kind, h in self._durations.items()
            }
