"""Supervised engine processes: spawn, readiness, health, logs, shutdown, orphan reaping.

A child engine:

* is started from an argv list, never through a shell, with a minimal environment (the
  baseline below plus what the driver adds) and stdin closed;
* leads its own process group (so shutdown signals reach its helpers too) and gets
  ``SIGKILL`` from the kernel if the host process dies (``PR_SET_PDEATHSIG``);
* has an **ownership record** ``<owned dir>/<pid>-<start ticks>.json`` naming the host
  process that owns it. A restarted host reaps every engine whose owner is gone -- and
  checks the engine's start ticks first, so a pid reused by an unrelated process is never
  signalled;
* writes stdout and stderr to a log file and to a bounded in-memory ring buffer whose tail
  (redacted) goes into errors.

Shutdown: ``SIGTERM`` to the group, a grace period, ``SIGKILL`` to the group, then a
bounded wait; a process still present after that is ``engine_shutdown_failed``. A host told
to stop at once (a second Ctrl-C) cuts every grace period short with :func:`kill_owned`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import json
import logging
import os
import signal
import ssl
import subprocess
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import anyio
import anyio.to_thread
import httpx
import psutil

from sbproxy.model_host.engines.errors import EngineError
from sbproxy.redact import redact
from sbproxy.workflows import WorkerIdentity, owner_is_gone, process_start_ticks

if TYPE_CHECKING:
    from psutil._ntuples import pconn, sconn

__all__ = [
    "BASELINE_ENV",
    "EngineProcess",
    "PortHolder",
    "ReapReport",
    "kill_owned",
    "minimal_env",
    "port_is_listening",
    "reap_orphans",
    "spawn_engine",
]

# Environment variables an engine may inherit; everything else (tokens, passwords, cloud
# credentials) is withheld. Follows the reference's baseline list.
BASELINE_ENV = (
    "PATH",
    "HOME",
    "TMPDIR",
    "TEMP",
    "TMP",
    "LANG",
    "LC_ALL",
    "TZ",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "LD_LIBRARY_PATH",
)
RING_BYTES = 64 * 1024
TAIL_LINES = 40
# How long an exited engine's log reader may take to reach end-of-file, seconds.
SETTLE_S = 2.0
_PR_SET_PDEATHSIG = 1

PortHolder = Literal["ours", "foreign", "none"]

logger = logging.getLogger(__name__)


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One TLS context for every probe client, made once.

    Probes are plain HTTP on loopback, but httpx builds a TLS context for each client it
    creates, and loading the CA bundle took ~26 ms (p50) of event-loop time here: once a
    second per deployment, it was the largest stall behind the gateway's p99
    (benchmarks/proxy.py with a stall sampler; a shared context costs 0.1 ms per client).
    """
    return ssl.create_default_context()


def minimal_env(
    extra: Mapping[str, str] | None = None, *, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The baseline variables present in ``environ`` (default: this process) plus ``extra``."""
    source = os.environ if environ is None else environ
    env = {name: source[name] for name in BASELINE_ENV if name in source}
    env.update(extra or {})
    return env


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@dataclass(frozen=True)
class OwnershipRecord:
    """Who owns an engine process, written beside its siblings in the owned directory."""

    pid: int
    start_ticks: str
    owner: str
    label: str
    executable: str

    def path(self, directory: Path) -> Path:
        """Where this record lives."""
        return directory / f"{self.pid}-{self.start_ticks}.json"


class EngineProcess:
    """One running engine child. Create with :func:`spawn_engine`."""

    def __init__(
        self,
        process: asyncio.subprocess.Process,
        *,
        record: OwnershipRecord,
        record_path: Path,
        log_path: Path,
    ) -> None:
        self._process = process
        self.record = record
        self.record_path = record_path
        self.log_path = log_path
        self.pid = process.pid
        self._ring: deque[bytes] = deque()
        self._ring_bytes = 0
        self._reader = asyncio.get_running_loop().create_task(self._pump())

    @property
    def start_ticks(self) -> str | None:
        """The child's start time in clock ticks, as its ownership record has it."""
        return self.record.start_ticks

    @property
    def returncode(self) -> int | None:
        """Exit status once the process has exited (negative: killed by that signal)."""
        return self._process.returncode

    def alive(self) -> bool:
        """Whether the process has not exited yet."""
        return self._process.returncode is None

    async def wait_exit(self) -> int:
        """Wait until the process exits; its exit status (negative: killed by that signal)."""
        return await self._process.wait()

    def listens_on(self, port: int) -> bool:
        """Whether this engine -- its own process or one it started -- holds the listening
        TCP socket on loopback ``port`` (psutil: pid to socket). A foreign process that took
        the port is never mistaken for the engine. Blocking (reads ``/proc``)."""
        if not self.alive() or process_start_ticks(self.pid) != self.record.start_ticks:
            return False
        try:
            root = psutil.Process(self.pid)
            family = [root, *root.children(recursive=True)]
        except psutil.Error:
            return False
        for member in family:
            try:
                sockets = member.net_connections(kind="inet")
            except psutil.Error:
                continue
            if any(_listening_on(sock, port) for sock in sockets):
                return True
        return False

    def port_holder(self, port: int) -> PortHolder:
        """Who holds the listening socket on ``port``: ``ours`` (this engine or a process it
        started), ``foreign`` (another process) or ``none``. Nothing is sent to the port --
        not even a TCP connection -- so a foreign listener never hears from us. Blocking
        (reads ``/proc``)."""
        if self.listens_on(port):
            return "ours"
        if not port_is_listening(port):
            return "none"
        # The engine may have bound the port between the two looks: ask again.
        return "ours" if self.listens_on(port) else "foreign"

    async def _pump(self) -> None:
        stream = self._process.stdout
        if stream is None:
            return
        with self.log_path.open("ab") as log:
            while line := await stream.readline():
                log.write(line)
                log.flush()
                self._ring.append(line)
                self._ring_bytes += len(line)
                while self._ring_bytes > RING_BYTES and len(self._ring) > 1:
                    self._ring_bytes -= len(self._ring.popleft())

    def stderr_tail(self, lines: int = TAIL_LINES) -> str:
        """The last ``lines`` lines the engine printed, redacted."""
        text = b"".join(list(self._ring)[-lines:]).decode("utf-8", "replace")
        return redact(text)

    def _error(self, code: str, message: str, *, retryable: bool = False) -> EngineError:
        tail = self.stderr_tail()
        return EngineError(
            message + (f"\n--- last engine output ---\n{tail}" if tail else ""),
            code=code,
            retryable=retryable,
            details={"pid": self.pid, "log": str(self.log_path)},
        )

    async def wait_ready(
        self, url: str, *, timeout_s: float, port: int | None = None, poll_s: float = 0.1
    ) -> None:
        """Poll ``url`` until it answers 200 -- from this engine: with ``port``, ``url`` is
        asked only once the listening socket on ``port`` belongs to this process (or one it
        started), so a foreign process on the port never receives a request.

        Raises:
            EngineError: ``engine_port_lost`` (retryable) when another process holds
                ``port`` (the engine exited on a bind failure, or something else listens
                there), having stopped the engine; ``engine_early_exit`` (retryable) if the
                process exits first; ``engine_readiness_timeout`` (retryable) after
                ``timeout_s``, having killed the process.
        """
        deadline = time.monotonic() + timeout_s
        # trust_env=False: an engine is on loopback; HTTP_PROXY (set for downloads) must not
        # send its probes to a proxy, which would find no engine on its own loopback.
        async with httpx.AsyncClient(timeout=2.0, verify=_tls_context(), trust_env=False) as client:
            while True:
                if not self.alive():
                    await self._settle()
                    if port is not None and await anyio.to_thread.run_sync(port_is_listening, port):
                        raise self._port_lost(port)
                    raise self._error(
                        "engine_early_exit",
                        f"the engine exited with status {self.returncode} before it was ready",
                        retryable=True,
                    )
                holder = "ours"
                if port is not None:
                    holder = await anyio.to_thread.run_sync(self.port_holder, port)
                if holder == "foreign" and self.alive():
                    await self.shutdown(grace_s=1.0)
                    raise self._port_lost(port or 0)
                if holder == "ours":
                    with contextlib.suppress(httpx.HTTPError):
                        if (await client.get(url)).status_code == 200:
                            return
                if time.monotonic() >= deadline:
                    await self.shutdown(grace_s=1.0)
                    raise self._error(
                        "engine_readiness_timeout",
                        f"the engine was not ready within {timeout_s:g} s; it was stopped",
                        retryable=True,
                    )
                await anyio.sleep(poll_s)

    def _port_lost(self, port: int) -> EngineError:
        return self._error(
            "engine_port_lost",
            f"loopback port {port} is held by another process, not by engine pid {self.pid}",
            retryable=True,
        )

    async def probe(self, url: str, *, timeout_s: float = 2.0) -> str:
        """One health probe: ``ready``, ``unhealthy`` (answers, not 200, or no answer) or
        ``stopped`` (the process exited)."""
        if not self.alive():
            return "stopped"
        try:
            async with httpx.AsyncClient(
                timeout=timeout_s, verify=_tls_context(), trust_env=False
            ) as client:
                response = await client.get(url)
        except httpx.HTTPError:
            return "unhealthy" if self.alive() else "stopped"
        return "ready" if response.status_code == 200 else "unhealthy"

    async def _settle(self) -> None:
        """After the exit: let the log reader drain what the engine wrote, drop the
        ownership record. Safe to call any number of times.

        The reader ends at end-of-file, which a process the engine left behind can hold off
        for good (it inherited the pipe). After :data:`SETTLE_S` the reader is cancelled and
        the pipe closed; it is never awaited again, since awaiting a cancelled task raises
        ``CancelledError`` into the caller -- which, on a task group, reads as the group's
        own cancellation and ended the whole host once.
        """
        if not self._reader.done():
            await asyncio.wait({self._reader}, timeout=SETTLE_S)
        if not self._reader.done():
            logger.warning(
                "engine pid %d exited but its output pipe is still held open (by a process "
                "it left behind); no longer reading it",
                self.pid,
            )
            self._reader.cancel()
            pipe = self._process._transport.get_pipe_transport(1)  # type: ignore[attr-defined]
            if pipe is not None:
                pipe.close()
        self.record_path.unlink(missing_ok=True)

    def kill(self) -> None:
        """SIGKILL the engine's process group now (no grace); :meth:`shutdown` still reaps."""
        self._signal_group(signal.SIGKILL)

    def _signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)

    async def shutdown(self, *, grace_s: float = 10.0, kill_wait_s: float = 5.0) -> None:
        """Stop the engine: SIGTERM to its group, ``grace_s``, SIGKILL, ``kill_wait_s``.

        Idempotent. Raises:
            EngineError: ``engine_shutdown_failed`` when the process survives SIGKILL.
        """
        if self.alive():
            self._signal_group(signal.SIGTERM)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._process.wait(), timeout=grace_s)
        if self.alive():
            self._signal_group(signal.SIGKILL)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._process.wait(), timeout=kill_wait_s)
        if self.alive():
            raise self._error(
                "engine_shutdown_failed",
                f"engine pid {self.pid} is still running after SIGKILL",
            )
        # Helpers the engine started in its group die with it; sweep any straggler.
        self._signal_group(signal.SIGKILL)
        await self._settle()


async def spawn_engine(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    log_path: Path,
    owned_dir: Path,
    label: str,
    identity: WorkerIdentity,
    cwd: Path | None = None,
) -> EngineProcess:
    """Start an engine child (see the module docstring).

    Raises:
        EngineError: ``engine_spawn_failed`` when the executable cannot be started.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    owned_dir.mkdir(parents=True, exist_ok=True)
    try:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    except OSError as exc:
        raise EngineError(
            f"cannot start {argv[0]}: {exc.strerror or exc}",
            code="engine_spawn_failed",
            remediation="Check that the engine executable exists and is executable.",
        ) from exc
    record = OwnershipRecord(
        pid=process.pid,
        start_ticks=process_start_ticks(process.pid) or "0",
        owner=identity.owner,
        label=label,
        executable=str(argv[0]),
    )
    record_path = record.path(owned_dir)
    temporary = record_path.with_suffix(".tmp")
    temporary.write_text(json.dumps(record.__dict__))
    temporary.replace(record_path)
    return EngineProcess(process, record=record, record_path=record_path, log_path=log_path)


def _listening_on(sock: sconn | pconn, port: int) -> bool:
    return bool(sock.status == psutil.CONN_LISTEN and sock.laddr and sock.laddr.port == port)


def port_is_listening(port: int) -> bool:
    """Whether any process on this host listens on TCP ``port`` (from the kernel's socket
    tables through psutil; nothing is sent to the port). Blocking."""
    try:
        sockets = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return False
    return any(_listening_on(sock, port) for sock in sockets)


@dataclass(frozen=True)
class ReapReport:
    """What :func:`reap_orphans` did."""

    killed: tuple[int, ...]
    cleared: tuple[str, ...]


def reap_orphans(owned_dir: Path, *, grace_s: float = 5.0) -> ReapReport:
    """Stop engines whose owner process is gone; drop records of engines already gone.

    An engine is signalled only if its pid still has the start ticks recorded at spawn, so
    a reused pid is never touched. Blocking (it may wait ``grace_s``): run it at startup.
    """
    killed: list[int] = []
    cleared: list[str] = []
    if not owned_dir.is_dir():
        return ReapReport((), ())
    for path in sorted(owned_dir.glob("*.json")):
        try:
            record = OwnershipRecord(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            path.unlink(missing_ok=True)
            cleared.append(path.name)
            continue
        if not owner_is_gone(record.owner):
            continue
        if process_start_ticks(record.pid) == record.start_ticks:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(record.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while process_start_ticks(record.pid) == record.start_ticks:
                if time.monotonic() > deadline:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(record.pid, signal.SIGKILL)
                    break
                time.sleep(0.05)
            killed.append(record.pid)
        path.unlink(missing_ok=True)
        cleared.append(path.name)
    return ReapReport(tuple(killed), tuple(cleared))


def kill_owned(owned_dir: Path, *, owner: str) -> tuple[int, ...]:
    """SIGKILL the group of every live engine that ``owner`` (a
    :attr:`~sbproxy.workflows.WorkerIdentity.owner`) started; the pids signalled.

    For a host that must stop now: whoever supervises each engine still sees it exit, waits
    for it and removes its record. Only a pid that still has the start ticks recorded at
    spawn is signalled, so a reused pid is never touched. Quick (no waiting): safe to call
    on the event loop. Idempotent.
    """
    killed: list[int] = []
    for pid in owned_alive(owned_dir, owner=owner):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
            killed.append(pid)
    return tuple(killed)


def owned_alive(owned_dir: Path, *, owner: str) -> tuple[int, ...]:
    """The pids of the live engines ``owner`` started, from their ownership records: a pid
    whose start ticks differ from the record's (reused) is not one. Quick, no waiting."""
    alive: list[int] = []
    if not owned_dir.is_dir():
        return ()
    for path in sorted(owned_dir.glob("*.json")):
        try:
            record = OwnershipRecord(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # half written or gone; the reaper of the next start deals with it
        if record.owner == owner and process_start_ticks(record.pid) == record.start_ticks:
            alive.append(record.pid)
    return tuple(alive)
