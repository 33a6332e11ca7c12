"""Named fault points that tests arm to kill the process at an exact place.

Crash safety is proven, not assumed: a test arms a point, the process dies there with
``SIGKILL`` (no cleanup, no ``finally``), a new process resumes the job, and the test checks
the final state and how often each side effect happened.

Arming:

* environment ``SBPROXY_FAULT_POINTS="step:publish:after,pull.after_download"``; an entry
  ``name=N`` fires on the N-th time the point is reached (default: the first); an entry
  ``name@stop`` (or ``name=N@stop``) makes the process ``SIGSTOP`` itself there instead of
  dying, so a test can let the world move on (a lease lapse, a take-over) and then resume
  it with ``SIGCONT`` at that exact place;
* in-process, :func:`arm` with an optional action (tests that raise instead of dying).

The executor passes three points for every step that runs (a replayed step passes none):

* ``step:<step name>:before``: the journal says running, the side effect is not yet done;
* ``step:<step name>:after``: the side effect is done, its output not yet recorded;
* ``step:<step name>:committed``: the output has committed to the journal (``end_step``
  returned) and the next step has not begun. A run resumed from here replays the step's
  recorded output instead of running it, so whatever the step left in the world (a process,
  a port, a file) must still match that output, or the code after it must check.

Domain code adds its own points with :func:`fault_point`.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

__all__ = ["ENV_VAR", "arm", "disarm_all", "fault_point"]

ENV_VAR = "SBPROXY_FAULT_POINTS"

_lock = threading.Lock()
_hits: dict[str, int] = {}
_armed: dict[str, tuple[int, Callable[[], None] | None]] = {}


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _pause() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


def _from_env() -> dict[str, tuple[int, Callable[[], None] | None]]:
    points: dict[str, tuple[int, Callable[[], None] | None]] = {}
    for entry in os.environ.get(ENV_VAR, "").split(","):
        armed, _, how = entry.strip().partition("@")
        name, _, count = armed.partition("=")
        if name:
            on_hit = int(count) if count.isdigit() and int(count) > 0 else 1
            points[name] = (on_hit, _pause if how == "stop" else None)
    return points


def arm(name: str, *, on_hit: int = 1, action: Callable[[], None] | None = None) -> None:
    """Arm ``name`` in this process: on its ``on_hit``-th hit run ``action`` (default SIGKILL)."""
    with _lock:
        _armed[name] = (on_hit, action)
        _hits.pop(name, None)


def disarm_all() -> None:
    """Forget every in-process arming and hit count."""
    with _lock:
        _armed.clear()
        _hits.clear()


def fault_point(name: str) -> None:
    """Pass a fault point: does nothing unless ``name`` is armed and its hit count is due."""
    env_points = _from_env() if ENV_VAR in os.environ else {}
    with _lock:
        armed = _armed.get(name) or env_points.get(name)
        if armed is None:
            return
        _hits[name] = _hits.get(name, 0) + 1
        if _hits[name] != armed[0]:
            return
        action = armed[1]
    (action or _kill)()
