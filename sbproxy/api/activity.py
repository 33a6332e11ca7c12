"""The gateway's recent activity: a bounded in-memory ring of finished requests, and a
bounded series of load samples, for the operator console's Activity page.

Each entry is what the access log knows when a routed request ends (:mod:`sbproxy.api.access`):
when it ended, the deployment, the caller's key *name* (never the key), the status, the
reason code of an abnormal end, prompt and completion tokens from the answer's ``usage``,
time to first token for a stream, and the duration. No prompt or completion text is kept.

The ring holds the last :data:`REQUESTS_KEPT` requests, the series the last
:data:`SAMPLES_KEPT` samples of active and queued requests (one every
:data:`SAMPLE_INTERVAL_S`: ten minutes). Both live in memory only and start empty with
the process.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Final

import msgspec

__all__ = ["REQUESTS_KEPT", "SAMPLE_INTERVAL_S", "Activity", "LoadSample", "RequestRecord"]

REQUESTS_KEPT: Final = 500
SAMPLE_INTERVAL_S: Final = 2.0
SAMPLES_KEPT: Final = 300


class RequestRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One finished gateway request (immutable).

    A msgspec struct rather than a frozen dataclass: one is built for every request, and a
    frozen dataclass sets each of its ten fields through ``object.__setattr__``.

    Attributes:
        ended_at_ms: Wall-clock end, milliseconds since the epoch.
        deployment: The deployment it was routed to.
        key_name: The caller's key name (``None``: keyless).
        path: The request path (``/v1/chat/completions``).
        status: The status logged (``499``: the client went away).
        outcome: Reason code of an abnormal end, else ``None``.
        prompt_tokens: From the answer's ``usage`` (``None`` when there was none).
        completion_tokens: From the answer's ``usage`` (``None`` when there was none).
        first_token_ms: Arrival to the first relayed event of a stream (``None``: not a
            stream, or no event).
        duration_ms: Arrival to end.
    """

    ended_at_ms: int
    deployment: str
    key_name: str | None
    path: str
    status: int
    outcome: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    first_token_ms: float | None
    duration_ms: float

    @property
    def tokens_per_s(self) -> float | None:
        """Completion tokens per second of generation: after the first token for a stream
        (decode speed), over the whole duration for a plain answer; ``None`` without tokens."""
        if not self.completion_tokens:
            return None
        span_ms = self.duration_ms - (self.first_token_ms or 0.0)
        if span_ms <= 0:
            return None
        return self.completion_tokens * 1000.0 / span_ms


@dataclass(frozen=True, slots=True)
class LoadSample:
    """Active and queued requests over every deployment at ``at_ms`` (epoch ms)."""

    at_ms: int
    active: int
    queued: int


class Activity:
    """The bounded ring of finished requests and the series of load samples."""

    def __init__(self, *, requests_kept: int = REQUESTS_KEPT, samples_kept: int = SAMPLES_KEPT):
        self._requests: deque[RequestRecord] = deque(maxlen=requests_kept)
        self._samples: deque[LoadSample] = deque(maxlen=samples_kept)

    def record(self, entry: RequestRecord) -> None:
        """Keep ``entry`` (the oldest one goes when the ring is full)."""
        self._requests.append(entry)

    def sample(self, *, active: int, queued: int, at_ms: int | None = None) -> None:
        """Keep one load sample (now, unless ``at_ms`` is given)."""
        now = int(time.time() * 1000) if at_ms is None else at_ms
        self._samples.append(LoadSample(at_ms=now, active=active, queued=queued))

    def recent(self, limit: int = REQUESTS_KEPT) -> list[RequestRecord]:
        """The last ``limit`` requests, newest first."""
        entries = list(self._requests)[-limit:] if limit > 0 else []
        entries.reverse()
        return entries

    def samples(self) -> list[LoadSample]:
        """Every kept load sample, oldest first."""
        return list(self._samples)
