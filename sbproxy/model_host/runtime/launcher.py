"""The runtime's effects on engine processes, behind one protocol.

:class:`Launcher` is everything the runtime manager does to an engine: **spawn** one and
wait until it is ready (its socket ours, ``/health`` 200), **probe** a ready one (socket
ownership first, then ``/health``), **stop** one with a grace period, **kill** one at once.
:class:`EngineLauncher` is the real one over ``engines/`` (child processes, psutil, httpx);
unit tests give the manager a fake (``tests/model_host/runtime/fake_launcher.py``) so that
launch policy runs without a process.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import anyio.to_thread

from sbproxy.model_host.engines import EngineProcess, LaunchRequest, launch, plan_llama_launch
from sbproxy.workflows import WorkerIdentity

__all__ = ["Engine", "EngineLauncher", "Health", "LaunchSpec", "Launcher", "Probe"]

Health = Literal["ready", "unhealthy", "stopped"]
Holder = Literal["ours", "foreign", "none"]


class Engine(Protocol):
    """One running engine, as the runtime sees it."""

    @property
    def pid(self) -> int:
        """The engine's process id."""
        ...

    @property
    def start_ticks(self) -> str | None:
        """The process's start time in clock ticks (tells a reused pid apart)."""
        ...

    def alive(self) -> bool:
        """Whether it has not exited."""
        ...

    async def wait_exit(self) -> int:
        """Wait for its exit; the exit status."""
        ...

    def stderr_tail(self, lines: int = 40) -> str:
        """Its last output lines (redacted)."""
        ...


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """One engine to start.

    Attributes:
        request: What the driver plans from (artifact, port, context, ...).
        executable: The engine binary.
        log_path: Where its output goes.
        label: ``deployment/generation`` (ownership record, logs).
        ready_timeout_s: Longest readiness wait, in seconds.
    """

    request: LaunchRequest
    executable: Path
    log_path: Path
    label: str
    ready_timeout_s: float


@dataclass(frozen=True, slots=True)
class Probe:
    """One maintenance probe of a ready engine: its health and who holds its port."""

    health: Health
    holder: Holder


class Launcher(Protocol):
    """Effects on engines (see the module docstring)."""

    async def spawn(self, spec: LaunchSpec) -> Engine:
        """Start ``spec`` and wait until it is ready on ``spec.request.port``.

        Raises:
            EngineError: ``engine_spawn_failed``, ``engine_early_exit``, ``engine_port_lost``
                or ``engine_readiness_timeout`` (the child is stopped first; so on
                cancellation).
        """
        ...

    async def probe(self, engine: Engine, port: int) -> Probe:
        """Who holds ``port``, and -- only when it is ours -- what ``/health`` says."""
        ...

    async def stop(self, engine: Engine, *, grace_s: float, kill_wait_s: float) -> None:
        """SIGTERM, ``grace_s``, SIGKILL, ``kill_wait_s``.

        Raises:
            EngineError: ``engine_shutdown_failed`` (it survived SIGKILL).
        """
        ...

    def kill(self, engine: Engine) -> None:
        """SIGKILL now, no grace."""
        ...


class EngineLauncher:
    """The real :class:`Launcher`: llama-server children through ``engines/``.

    Args:
        owned_dir: Where ownership records of the children go (orphan reaping).
        identity: This host's identity (recorded as the children's owner).
    """

    def __init__(self, *, owned_dir: Path, identity: WorkerIdentity) -> None:
        self.owned_dir = owned_dir
        self.identity = identity

    async def spawn(self, spec: LaunchSpec) -> Engine:
        """See :meth:`Launcher.spawn`."""
        return await launch(
            plan_llama_launch(spec.request, executable=spec.executable),
            log_path=spec.log_path,
            owned_dir=self.owned_dir,
            label=spec.label,
            identity=self.identity,
            ready_timeout_s=spec.ready_timeout_s,
        )

    async def probe(self, engine: Engine, port: int) -> Probe:
        """See :meth:`Launcher.probe`."""
        process = _process(engine)
        holder: Holder = await anyio.to_thread.run_sync(process.port_holder, port)
        health: Health = "stopped" if not process.alive() else "unhealthy"
        if holder == "ours":
            found = await process.probe(f"http://127.0.0.1:{port}/health")
            health = "ready" if found == "ready" else "stopped" if found == "stopped" else health
        return Probe(health=health, holder=holder)

    async def stop(self, engine: Engine, *, grace_s: float, kill_wait_s: float) -> None:
        """See :meth:`Launcher.stop`."""
        await _process(engine).shutdown(grace_s=grace_s, kill_wait_s=kill_wait_s)

    def kill(self, engine: Engine) -> None:
        """See :meth:`Launcher.kill`."""
        _process(engine).kill()


def _process(engine: Engine) -> EngineProcess:
    if not isinstance(engine, EngineProcess):
        raise TypeError(f"EngineLauncher only drives its own engines, not {engine!r}")
    return engine
