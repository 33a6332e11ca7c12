"""The runtime's clock seam: monotonic time and sleeping, replaceable in tests.

Keep-alive, launch backoff, restart backoff and swap waits read :meth:`Clock.now` and wait
with :meth:`Clock.sleep`; neither moves when the wall clock is stepped (NTP, an operator's
``date -s``), because the default is :func:`time.monotonic`. Tests inject a manual clock and
advance it instead of sleeping.
"""

from __future__ import annotations

import time
from typing import Protocol

import anyio

__all__ = ["Clock", "MonotonicClock"]


class Clock(Protocol):
    """Monotonic seconds and a sleep on the same time line."""

    def now(self) -> float:
        """Seconds on a monotonic time line (only differences mean anything)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Return once ``seconds`` have passed on this clock."""
        ...


class MonotonicClock:
    """The process's monotonic clock (:func:`time.monotonic`, :func:`anyio.sleep`)."""

    def now(self) -> float:
        """``time.monotonic()``."""
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        """``anyio.sleep(seconds)``."""
        await anyio.sleep(max(0.0, seconds))
