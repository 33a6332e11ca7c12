"""The engine guard: a small child process of a fleet host that kills the host's engines when
the host itself stops running -- paused (``SIGSTOP``), frozen by a debugger or a stuck
kernel call -- for longer than a deadline (issue 30: "no engine runs on a host more than
``fence_after_ms`` after it was cut off").

Engines are processes of their own: when their host is paused they keep running, holding
their devices, while the fleet, after ``lost_after_ms``, starts their replicas elsewhere.
The host cannot fence itself while it is paused, so a process that is not paused does it:

* the host's :class:`EngineGuard` writes one byte to the guard's stdin every quarter of the
  deadline, from a thread of its own (a busy event loop does not trip it; a paused process
  does, because every thread of it stops);
* the guard (``python -m sbproxy.model_host.engines.guard OWNED_DIR OWNER DEADLINE_MS``)
  SIGKILLs every engine the host owns (:func:`~sbproxy.model_host.engines.process.
  kill_owned`: its ownership records, start ticks checked) once no byte came for the
  deadline, and again while the silence lasts; a host that resumes sees its engines gone
  (its supervision and the fleet agent take it from there: a host paused past
  ``lost_after_ms`` fences itself, one paused less starts its still-placed replicas again);
* ``q`` on stdin ends the guard quietly (a graceful stop: the runtime stops its engines
  itself); end of file (the host died) kills the engines and ends it.

The guard runs with a minimal environment and no shell, like an engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from sbproxy.model_host.engines.process import kill_owned, minimal_env

__all__ = ["EngineGuard", "main"]

logger = logging.getLogger(__name__)

_QUIT = b"q"
_TICK = b"."


class EngineGuard:
    """The host side: starts the guard process and ticks it (module docstring).

    Args:
        owned_dir: The runtime's ownership records (``RuntimeManager.owned_dir``).
        owner: The host's worker identity (``WorkerIdentity.owner``).
        deadline_s: Silence after which the guard kills the engines (``fence_after_ms``).
    """

    def __init__(self, owned_dir: Path, *, owner: str, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        environment = minimal_env(
            {k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "VIRTUAL_ENV")}
        )
        argv = [
            sys.executable,
            "-m",
            "sbproxy.model_host.engines.guard",
            str(owned_dir),
            owner,
            str(int(deadline_s * 1000)),
        ]
        self._process = subprocess.Popen(  # noqa: S603 - our own module, argv list, no shell
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            env=environment,
            start_new_session=True,
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="engine-guard", daemon=True)
        self._thread.start()

    @property
    def pid(self) -> int:
        """The guard process's pid."""
        return self._process.pid

    def _tick(self) -> None:
        period = self.deadline_s / 4
        while not self._stop.wait(period):
            if not self._send(_TICK):
                return

    def _send(self, byte: bytes) -> bool:
        stdin = self._process.stdin
        if stdin is None:
            return False
        try:
            stdin.write(byte)
            stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            return False
        return True

    def close(self) -> None:
        """End the guard without touching the engines (the runtime stopped them)."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._send(_QUIT)
        with contextlib.suppress(OSError):
            if self._process.stdin is not None:
                self._process.stdin.close()
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def main(argv: list[str] | None = None) -> int:
    """The guard process (module docstring); exit status 0, or 2 for bad arguments."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or not args[2].isdigit():
        print(
            "usage: python -m sbproxy.model_host.engines.guard OWNED_DIR OWNER MS", file=sys.stderr
        )
        return 2
    owned_dir, owner, deadline_s = Path(args[0]), args[1], int(args[2]) / 1000
    stdin = sys.stdin.fileno()
    last = time.monotonic()
    silent_kills = 0
    while True:
        readable, _, _ = select.select([stdin], [], [], max(0.01, deadline_s / 8))
        if readable:
            data = os.read(stdin, 4096)
            if not data:  # the host is gone: its engines go with it
                kill_owned(owned_dir, owner=owner)
                return 0
            if _QUIT in data:
                return 0
            last = time.monotonic()
            silent_kills = 0
            continue
        if time.monotonic() - last >= deadline_s:
            killed = kill_owned(owned_dir, owner=owner)
            if killed or silent_kills == 0:
                print(
                    f"sbproxy engine guard: the host has not run for {deadline_s:.1f} s "
                    f"(paused?): killed engines {list(killed)}",
                    file=sys.stderr,
                    flush=True,
                )
            silent_kills += 1


if __name__ == "__main__":
    sys.exit(main())
