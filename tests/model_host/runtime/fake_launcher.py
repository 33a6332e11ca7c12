"""A :class:`~sbproxy.model_host.runtime.launcher.Launcher` without processes, for unit tests
of launch policy: spawns answer from a script of failures, engines exit when told."""

from __future__ import annotations

from collections.abc import Iterable

import anyio

from sbproxy.model_host.engines import EngineError
from sbproxy.model_host.runtime.launcher import Engine, LaunchSpec, Probe


class FakeEngine:
    """An engine that is 'running' until :meth:`exit`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start_ticks: str | None = f"ticks-{pid}"
        self.status: int | None = None
        self._exited = anyio.Event()

    def alive(self) -> bool:
        return self.status is None

    async def wait_exit(self) -> int:
        await self._exited.wait()
        assert self.status is not None
        return self.status

    def stderr_tail(self, lines: int = 40) -> str:
        return "fake engine output"

    def exit(self, status: int) -> None:
        if self.status is None:
            self.status = status
            self._exited.set()


def early_exit() -> EngineError:
    return EngineError("the engine exited with status 1", code="engine_early_exit", retryable=True)


def port_lost() -> EngineError:
    return EngineError("the port is taken", code="engine_port_lost", retryable=True)


class FakeLauncher:
    """Spawns fail with ``failures`` in order, then succeed; every call is recorded."""

    def __init__(self, failures: Iterable[EngineError] = ()) -> None:
        self.failures = list(failures)
        self.specs: list[LaunchSpec] = []
        self.engines: list[FakeEngine] = []
        self.stopped: list[int] = []

    async def spawn(self, spec: LaunchSpec) -> Engine:
        self.specs.append(spec)
        await anyio.lowlevel.checkpoint()
        if self.failures:
            raise self.failures.pop(0)
        engine = FakeEngine(pid=100_000 + len(self.specs))
        self.engines.append(engine)
        return engine

    async def probe(self, engine: Engine, port: int) -> Probe:
        return Probe(health="ready" if engine.alive() else "stopped", holder="ours")

    async def stop(self, engine: Engine, *, grace_s: float, kill_wait_s: float) -> None:
        assert isinstance(engine, FakeEngine)
        engine.exit(-15)
        self.stopped.append(engine.pid)

    def kill(self, engine: Engine) -> None:
        assert isinstance(engine, FakeEngine)
        engine.exit(-9)
