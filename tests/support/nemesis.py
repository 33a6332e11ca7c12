"""A nemesis for the fleet (issue 30, STYLE.md 17-18): a seeded, bounded random schedule of
real faults over three real ``sbproxy serve`` hosts on one real PostgreSQL, with a request
loop through every gateway and invariants checked from outside every 200 ms.

The set-up: a throw-away PostgreSQL of the run's own (it is restarted and frozen), an
HF-shaped mirror, three :class:`~tests.api.cluster_hosts.FleetHost` members (the stand-in
engine, fleet timing heartbeat 200 ms / fence 1.5 s / lost 3 s). Each host's journal URL
goes through its own :class:`~tests.support.tcp_relay.TcpRelay` (so that one host alone can
be cut off from the database), and each host advertises a relay in front of its gateway as
its ``advertise_url`` (so that peers lose it while its clients still reach it). Deployment
``tiny`` starts at 2 replicas.

**The schedule** (:func:`plan`) is drawn up front from ``random.Random(seed)``, so a seed
replays the same faults at the same offsets (what the product does in between depends on
timing, so a replay may differ in its outcome): every kind once in a shuffled order first,
then weighted draws, each 1-4 s after the last one started. Faults (each lasts a bounded
random time, then heals; at most two at a time, never two on one host; a database fault
alone, and only :data:`FAULT_QUIET_S` after the last fault healed):

* ``kill`` -- SIGKILL of a host (its engines die with it: ``PR_SET_PDEATHSIG``), restarted
  after 1-6 s (its gateway's requests are not judged until it listens again);
* ``pause`` -- SIGSTOP of a host for 0.3-1.2 s (a stall shorter than ``fence_after_ms``),
  then SIGCONT;
* ``pause_long`` -- SIGSTOP for 4-6 s, past ``lost_after_ms``: its engines are separate
  processes and keep running, and they count (a frozen host cannot stop them; the fleet
  re-places its replicas meanwhile);
* ``journal_blackhole`` / ``journal_refuse`` -- the host's journal relay drops every byte /
  refuses every connection for 2-7 s;
* ``peer_blackhole`` -- the relay in front of the host's gateway (what its peers reach)
  drops every byte for 2-8 s;
* ``db_restart`` -- ``pg_ctl stop -m fast``, down 2-6 s, ``pg_ctl start``;
* ``db_freeze`` -- SIGSTOP of the postmaster and every backend for 2-6 s, then SIGCONT.

Between faults, operations: ``apply`` (``sbproxy apply``, replicas 2 -> 1 or 1 -> 2) and
``drain`` (``sbproxy nodes drain <node>``, ``sbproxy nodes uncordon <node>`` 4-10 s later,
retried twice as an operator would), :data:`OP_SPACING_S` apart, never during a database
fault and never within :data:`OP_QUIET_S` before one; each goes through a host that runs
and reaches the database at that moment.

**Invariants** (ground truth: the processes through psutil and the relays' and the
database's fault state the harness itself set -- never the product's API):

* ``engines_over_replicas`` -- the live stand-in engines of ``tiny`` on all hosts (a zombie or
  a SIGSTOPped engine does not count; an engine of a SIGSTOPped host does) are at most the
  desired replicas plus the surge. The desired count is the larger of the old and new one
  from an apply's start until the change settled; the surge is 1 while an apply or a drain
  is settling (a rolling change and a drain both start the new engine before the old one
  stops: docs/cluster.md, "Rollouts" in ``sbproxy/fleet/placement.py``), else 0. A change
  settles once the live count equals the desired count for :data:`SETTLE_S` in a row (and a
  drained node holds no engine), or after :data:`SETTLE_MAX_S` at most;
* ``engine_after_cut`` -- no engine runs on a host more than ``fence_after_ms`` +
  :data:`FENCE_SLACK_S` after its journal link was blackholed or refused while the database
  was up for the others (the slack makes the bound ``lost_after_ms`` + 0.5 s: a cut-off host
  must have stopped its engines before the fleet re-places them, with 0.5 s for the
  check's own period and the kill). A database down or frozen for everyone is not a cut:
  the hosts must keep serving then (next invariant);
* ``engine_lost_in_outage`` -- while the database is down or frozen for every host, and for
  :data:`OUTAGE_TAIL_S` after it is back (a fence decided in the outage lands late), no
  engine that ran at the outage's start stops, unless a fault or a drain begun since hit
  its host, or
  its host already broke ``engine_after_cut`` and has not been seen without engines since
  (its stop is that late fence: logged in the timeline, not counted twice);
* ``host_exited`` -- no serving host process exits by itself (the harness restarts one that
  does, as a supervisor would; one that exits while it boots -- it cannot reach its journal
  then -- is restarted and logged, not judged);
* ``request_unbounded`` / ``request_bad_answer`` / ``request_failed`` -- every request
  through a gateway ends within :data:`REQUEST_BOUND_S` with 200, or 503/429 with
  ``Retry-After``, or -- for a request that may already have reached an engine, which is
  never sent twice -- the documented 502 ``upstream_unavailable`` or 504 ``engine_timeout``;
  a request whose gateway's host was killed or paused while it was in
  flight is recorded (``host_down``) but not judged;
* ``operation_unbounded`` -- every ``sbproxy apply`` / ``nodes drain`` / ``nodes uncordon``
  ends within :data:`OP_BOUND_S` (the request bound plus the CLI's own start), answered or
  refused; a refusal during a fault is recorded, not judged (a failed apply's count is then
  read from the journal's ``desired_revisions``: it may have committed);
* ``not_converged`` -- after the schedule (every fault healed, every host running), within
  :data:`CONVERGE_S`: exactly the desired number (the last revision in ``desired_revisions``)
  of live engines, each answering ``/health`` with 200, and every gateway answering a chat
  request with 200;
* ``job_not_terminal`` -- then, in the ``jobs`` table: no job ``queued``, or ``running``
  without an unexpired lease (``lease_expires_at_ms`` in the future on database time), that
  was last updated more than :data:`JOB_BOUND_S` ago. A job a live worker holds a lease on
  is being worked on; anything else not terminal is stuck.

:class:`Nemesis` runs it and returns a :class:`Report`; :meth:`Report.failure` is the text
to print when an invariant failed: the seed (``SBPROXY_NEMESIS_SEED=<seed>`` replays it),
each violation, and the timeline of faults and operations.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg

from tests.api.cluster_hosts import FENCE_AFTER_MS, LOST_AFTER_MS, FleetHost
from tests.api.pg_hosts import FILE, PASSWORD, REPO, REVISION, catalog, poll, tiny_gguf
from tests.support.hf_server import HfMirror
from tests.support.postgres import PostgresServer, running_server
from tests.support.tcp_relay import TcpRelay

__all__ = ["FAULTS", "OPERATIONS", "Nemesis", "Report", "Step", "Violation", "plan"]

NODES = ("node-a", "node-b", "node-c")
DEPLOYMENT = "tiny"
TINY = {"model": "tiny", "variant": "q4_k_m"}
CHECK_PERIOD_S = 0.2
REQUEST_BOUND_S = 20.0
FENCE_SLACK_S = (LOST_AFTER_MS - FENCE_AFTER_MS) / 1000 + 0.5
SETTLE_S = 3.0
SETTLE_MAX_S = 30.0
OP_QUIET_S = 12.0
OP_SPACING_S = 8.0
FAULT_QUIET_S = LOST_AFTER_MS / 1000 + 3.0
CONVERGE_S = 60.0
JOB_BOUND_S = 30.0
OUTAGE_TAIL_S = LOST_AFTER_MS / 1000
OP_BOUND_S = REQUEST_BOUND_S + 5.0
REQUEST_GAP_S = 0.25

FAULTS: dict[str, tuple[float, float]] = {
    "kill": (1.0, 6.0),
    "pause": (0.3, 1.2),
    "pause_long": (4.0, 6.0),
    "journal_blackhole": (2.0, 7.0),
    "journal_refuse": (2.0, 7.0),
    "peer_blackhole": (2.0, 8.0),
    "db_restart": (2.0, 6.0),
    "db_freeze": (2.0, 6.0),
}
"""Each fault kind and the bounds of how long it lasts (seconds)."""

OPERATIONS: dict[str, tuple[float, float]] = {"apply": (0.0, 0.0), "drain": (4.0, 10.0)}
"""Each operation and how long it lasts (a drain: until its uncordon)."""

_WEIGHTS = {
    "kill": 2,
    "pause": 1,
    "pause_long": 1,
    "journal_blackhole": 2,
    "journal_refuse": 2,
    "peer_blackhole": 1,
    "db_restart": 1,
    "db_freeze": 1,
    "apply": 1,
    "drain": 1,
}
_DATABASE = ("db_restart", "db_freeze")


@dataclass(frozen=True)
class Step:
    """One fault or operation of a schedule.

    Attributes:
        at: Seconds after the schedule's start.
        kind: A key of :data:`FAULTS` or :data:`OPERATIONS`.
        target: The node it hits (a drain's node; the host an apply goes through); ``None``
            for a database fault.
        duration: Seconds until it heals (0 for an apply).
    """

    at: float
    kind: str
    target: str | None
    duration: float

    @property
    def end(self) -> float:
        return self.at + self.duration


def plan(seed: int, *, seconds: float, nodes: tuple[str, ...] = NODES) -> list[Step]:
    """The schedule of ``seed``: steps starting within ``seconds`` (each healed by
    ``seconds`` + its longest duration), in start order. Pure: equal inputs, equal plans.

    Each step's kind is drawn first (every kind once, in a shuffled order, then weighted
    draws), then it waits for the first moment it may start: at most two faults at a time,
    never two on one host (a drain's node counts as busy); a database fault only while
    nothing else is active and :data:`OP_QUIET_S` after the last operation; no operation
    during a database fault, and operations :data:`OP_SPACING_S` apart, so that each change
    settles before the next; one drain at a time.
    """
    rng = random.Random(seed)  # noqa: S311 - a replayable schedule, not a secret
    kinds = list(_WEIGHTS)
    rng.shuffle(kinds)  # every kind once first, so that a short run meets them all
    steps: list[Step] = []
    now = 1.0

    def blocked(kind: str, at: float) -> bool:
        active = [s for s in steps if s.at <= at < s.end and s.kind != "apply"]
        free = [n for n in nodes if n not in {s.target for s in active}]
        last_op = max((s.at for s in steps if s.kind in OPERATIONS), default=-OP_QUIET_S)
        if kind in _DATABASE:
            # Alone, and after the last fault had time to play out (a cut-off host may
            # still be fencing after its link healed): an outage for everyone, not a mix.
            last_end = max((s.end for s in steps if s.kind in FAULTS), default=-FAULT_QUIET_S)
            return bool(active) or at - last_op < OP_QUIET_S or at - last_end < FAULT_QUIET_S
        if any(s.kind in _DATABASE for s in active) or not free:
            return True
        if kind in OPERATIONS:
            drains = any(s.kind == "drain" for s in active)
            return at - last_op < OP_SPACING_S or (kind == "drain" and drains)
        return sum(1 for s in active if s.kind in FAULTS) >= 2

    while now < seconds:
        kind = kinds.pop(0) if kinds else rng.choices(list(_WEIGHTS), list(_WEIGHTS.values()))[0]
        while blocked(kind, now):
            now = round(now + 0.25, 2)
        if now >= seconds:
            break
        active = {s.target for s in steps if s.at <= now < s.end and s.kind != "apply"}
        low, high = FAULTS.get(kind) or OPERATIONS[kind]
        duration = round(rng.uniform(low, high), 2)
        target = None if kind in _DATABASE else rng.choice([n for n in nodes if n not in active])
        steps.append(Step(at=now, kind=kind, target=target, duration=duration))
        now = round(now + rng.uniform(1.0, 4.0), 2)
    return steps


@dataclass(frozen=True)
class Violation:
    """An invariant that did not hold: ``at`` seconds after the schedule's start, its
    ``kind`` (an invariant name of the module docstring) and what was seen."""

    at: float
    kind: str
    detail: str


@dataclass
class Report:
    """What one run saw.

    Attributes:
        seed: The schedule's seed.
        schedule: The planned steps.
        faults: Faults injected, by kind.
        operations: Operations run, by kind and outcome (``apply:ok``, ``drain:failed``...).
        violations: Every invariant violation, in time order.
        requests: Requests by outcome (``ok``, ``retry_later``, ``host_down``, ``timeout``...).
        request_max_s: The longest judged request (seconds).
        convergence_s: Seconds from the end of the schedule until the fleet converged
            (``None``: not within :data:`CONVERGE_S`).
        max_live: The most live engines seen at once, and the allowed count then.
        max_allowed: The most engines ever allowed at once.
        timeline: ``(seconds, text)`` of every fault, heal and operation.
        wall_s: Seconds the whole run took, set-up and teardown included.
        logs: Each host's stderr log (every run of it), for a failure's post-mortem.
    """

    seed: int
    schedule: list[Step]
    faults: Counter[str] = field(default_factory=Counter)
    operations: Counter[str] = field(default_factory=Counter)
    violations: list[Violation] = field(default_factory=list)
    requests: Counter[str] = field(default_factory=Counter)
    request_max_s: float = 0.0
    convergence_s: float | None = None
    max_live: tuple[int, int] = (0, 0)
    max_allowed: int = 0
    timeline: list[tuple[float, str]] = field(default_factory=list)
    wall_s: float = 0.0
    logs: list[str] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        """The run's figures as JSON-ready data."""
        return {
            "seed": self.seed,
            "wall_s": round(self.wall_s, 1),
            "faults": dict(sorted(self.faults.items())),
            "operations": dict(sorted(self.operations.items())),
            "violations": {
                "count": len(self.violations),
                "by_kind": dict(Counter(v.kind for v in self.violations)),
                "each": [
                    {"at_s": round(v.at, 2), "kind": v.kind, "detail": v.detail}
                    for v in self.violations
                ],
            },
            "requests": dict(sorted(self.requests.items())),
            "request_max_s": round(self.request_max_s, 2),
            "convergence_s": None if self.convergence_s is None else round(self.convergence_s, 2),
            "max_live_engines": {"seen": self.max_live[0], "allowed_then": self.max_live[1]},
            "max_allowed_engines": self.max_allowed,
        }

    def failure(self) -> str:
        """The seed, the violations and the timeline, for a failed run."""
        lines = [
            f"nemesis seed {self.seed}: {len(self.violations)} invariant violation(s);"
            f" replay with SBPROXY_NEMESIS_SEED={self.seed}",
            *(f"  VIOLATION t={v.at:7.2f}s {v.kind}: {v.detail}" for v in self.violations),
            "timeline (faults, heals, operations, violations):",
            *(
                f"  t={t:7.2f}s {text}"
                for t, text in sorted(
                    [*self.timeline, *((v.at, f"VIOLATION {v.kind}") for v in self.violations)]
                )
            ),
            f"figures: {json.dumps(self.figures(), sort_keys=True)}",
            f"host logs: {', '.join(self.logs)}",
        ]
        return "\n".join(lines)


def _cli(host: FleetHost, *args: str, timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    """``sbproxy <args> --format json`` against ``host``'s admin API (a timeout: rc 124)."""
    admin = f"http://127.0.0.1:{host.admin}"
    command = [sys.executable, "-m", "sbproxy.cli", *args, "--admin-url", admin,
               "--password", PASSWORD, "--format", "json"]  # fmt: skip
    try:
        return subprocess.run(
            command, env=host.env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(command, 124, "", f"no answer within {timeout_s} s")


@dataclass
class _Engine:
    pid: int
    host: str
    port: int | None


def _live_engines(hosts: list[FleetHost]) -> list[_Engine]:
    """Every live stand-in engine of ``hosts`` (by its cache path in the command line): not
    a zombie, not stopped. One scan of the process table."""
    caches = {str(h.cache): h.node for h in hosts}
    found: list[_Engine] = []
    for process in psutil.process_iter(["cmdline", "status"]):
        argv = process.info.get("cmdline") or []
        line = " ".join(argv)
        if "fake_llama_server" not in line:
            continue
        if process.info.get("status") in (psutil.STATUS_ZOMBIE, psutil.STATUS_STOPPED):
            continue
        for cache, node in caches.items():
            if cache in line:
                port = None
                if "--port" in argv and argv.index("--port") + 1 < len(argv):
                    with contextlib.suppress(ValueError):
                        port = int(argv[argv.index("--port") + 1])
                found.append(_Engine(process.pid, node, port))
    return found


class Nemesis:
    """One run: set up, schedule, check, converge, tear down (see the module docstring).

    Args:
        root: A fresh directory for the hosts' caches, configs and logs.
        seed: The schedule's seed.
        seconds: How long the schedule injects faults.
        log: Where progress lines go (``print`` by default).
    """

    def __init__(
        self,
        root: Path,
        *,
        seed: int,
        seconds: float,
        log: Callable[[str], None] = print,
    ) -> None:
        self.root = root
        self.seed = seed
        self.seconds = seconds
        self.log = log
        self.report = Report(seed=seed, schedule=plan(seed, seconds=seconds))
        self.hosts: list[FleetHost] = []
        self.journal: dict[str, TcpRelay] = {}
        self.peer: dict[str, TcpRelay] = {}
        self.server: PostgresServer | None = None
        self.url = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        # Fault state the checker reads (under _lock).
        self._down: dict[str, str] = {}  # node -> "kill" | "pause" | "pause_long"
        self._disturbed: dict[str, float] = {}  # node -> last time it was down
        self._paused_from: dict[str, str | None] = {}  # node -> its state when paused
        self._cut_since: dict[str, float] = {}  # node -> when its journal link went bad
        self._cut_flagged: set[str] = set()
        # Hosts that kept an engine past the fence bound of a cut, until seen with none:
        # an engine of theirs that stops later is that late fence, not an outage's doing.
        self._unfenced: set[str] = set()
        self._last_cut: dict[str, float] = {}  # node -> when its last cut began
        self._outage: dict[int, str] | None = None  # engines (pid -> node) at outage start
        self._outage_flagged: set[int] = set()
        self._outage_until: float | None = None  # the outage's check ends then (after heal)
        self.desired = 2
        self._desired_alt: int | None = None
        self._desired_known = True
        self._settling_since: float | None = None
        self._settled_for: float | None = None
        self._drained: str | None = None
        self._over_since: float | None = None
        self._over_max = self._over_allowed = 0
        self._over_where: list[str] = []
        self._operations: list[threading.Thread] = []
        self._last_error = ""

    # -- time, log ----------------------------------------------------------------------

    def _now(self) -> float:
        return time.monotonic() - self._t0

    def _event(self, text: str) -> None:
        at = self._now()
        with self._lock:
            self.report.timeline.append((at, text))
        self.log(f"[nemesis t={at:7.2f}s] {text}")

    def _violate(self, kind: str, detail: str) -> None:
        at = self._now()
        with self._lock:
            self.report.violations.append(Violation(at, kind, detail))
        self.log(f"[nemesis t={at:7.2f}s] VIOLATION {kind}: {detail}")

    # -- the run -----------------------------------------------------------------------

    def run(self) -> Report:
        """Set up, run the schedule, converge, tear down; the report (also on an error
        in the set-up, which propagates)."""
        started = time.monotonic()
        try:
            with self._fleet():
                self._t0 = time.monotonic()
                self._event(f"schedule starts: seed {self.seed}, {len(self.report.schedule)} steps")
                threads = [
                    threading.Thread(target=self._requests, args=(h,), daemon=True)
                    for h in self.hosts
                ]
                threads.append(threading.Thread(target=self._checker, daemon=True))
                for thread in threads:
                    thread.start()
                try:
                    self._schedule()
                    self._converge()
                finally:
                    self._stop.set()
                    for thread in threads:
                        thread.join(timeout=REQUEST_BOUND_S + 5)
                    if self._over_since is not None:  # an episode still open at the end
                        self._end_over(time.monotonic())
                self._jobs()
        finally:
            self.report.wall_s = time.monotonic() - started
        self.report.violations.sort(key=lambda v: v.at)
        return self.report

    @contextlib.contextmanager
    def _fleet(self) -> Iterator[None]:
        pulled = tiny_gguf(self.root / "src", vocab=50)
        imported = tiny_gguf(self.root / "imp", vocab=60)
        catalog(self.root / "catalog.yaml", pulled, imported)
        with contextlib.ExitStack() as stack:
            mirror = stack.enter_context(HfMirror())
            mirror.add_file(REPO, REVISION, FILE, pulled)
            self.server = stack.enter_context(running_server())
            self.url = self.server.create_database()
            for node in NODES:
                journal = stack.enter_context(TcpRelay(self.server.port))
                host = FleetHost(node, self.root / node, "", mirror.url)
                peer = stack.enter_context(TcpRelay(host.gateway))
                host.url = self.url.replace(f":{self.server.port}/", f":{journal.port}/")
                host.advertise_url = f"http://127.0.0.1:{peer.port}"
                host.write({})
                self.journal[node], self.peer[node] = journal, peer
                self.hosts.append(host)
                self.report.logs.append(str(host.log))
            stack.callback(self._teardown)
            for host in self.hosts:
                host.start()

            def joined() -> bool:
                for host in self.hosts:
                    if not host.alive():
                        raise AssertionError(f"{host.node} exited: {host.output[-4000:]}")
                return len(self.hosts[0].fleet("nodes").get("nodes", [])) == len(self.hosts)

            poll(joined, timeout_s=90, what="every host joined")
            self._apply_now(self.hosts[0], 2)
            poll(
                lambda: len(_live_engines(self.hosts)) == 2 and self._all_answer(),
                timeout_s=90,
                what="2 replicas serving before the schedule",
            )
            yield

    def _teardown(self) -> None:
        self._heal_everything()
        for host in self.hosts:
            with contextlib.suppress(Exception):
                host.stop()
        for engine in _live_engines(self.hosts):
            with contextlib.suppress(psutil.Error):
                psutil.Process(engine.pid).kill()

    def _heal_everything(self) -> None:
        for relay in (*self.journal.values(), *self.peer.values()):
            relay.heal()
        self._thaw_database()
        for host in self.hosts:
            if host.process is not None and host.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    host.process.send_signal(signal.SIGCONT)

    def _host(self, node: str | None) -> FleetHost:
        return next(h for h in self.hosts if h.node == node)

    def _all_answer(self) -> bool:
        return not self._not_answering()

    def _not_answering(self) -> list[str]:
        """``node: what it answered`` for each gateway that does not answer a chat request
        with 200 (empty: every one does)."""
        failing = []
        for host in self.hosts:
            try:
                answer = host.chat()
            except httpx.HTTPError as exc:
                failing.append(f"{host.node}: {exc!r}")
                continue
            if answer.status_code != 200:
                failing.append(f"{host.node}: {answer.status_code} {answer.text[:160]}")
        return failing

    # -- the schedule ------------------------------------------------------------------

    def _schedule(self) -> None:
        actions: list[tuple[float, int, str, Step]] = []
        for index, step in enumerate(self.report.schedule):
            actions.append((step.at, 2 * index, "start", step))
            if step.duration > 0:
                actions.append((step.end, 2 * index + 1, "end", step))
        actions.sort(key=lambda a: (a[0], a[1]))
        for at, _, phase, step in actions:
            wait = at - self._now()
            if wait > 0:
                time.sleep(wait)
            try:
                if phase == "start":
                    self._start(step)
                else:
                    self._end(step)
            except Exception as exc:  # noqa: BLE001 - a failed step is logged, the run goes on
                self._event(f"{phase} {step.kind} {step.target or ''} raised {exc!r}")
        for thread in self._operations:  # an operation still in flight ends first
            thread.join(timeout=120)
        self._event("schedule over: every fault healed, every operation done")

    def _start(self, step: Step) -> None:
        kind, node = step.kind, step.target
        if kind in FAULTS:
            with self._lock:
                self.report.faults[kind] += 1
        self._event(f"{kind} {node or 'database'} for {step.duration:.2f} s")
        if kind == "kill":
            host = self._host(node)
            with self._lock:
                self._down[host.node] = kind
            host.kill()
        elif kind in ("pause", "pause_long"):
            host = self._host(node)
            assert host.process is not None
            with self._lock:
                # A host paused while it boots is still booting once resumed.
                self._paused_from[host.node] = self._down.get(host.node)
                self._down[host.node] = kind
            host.process.send_signal(signal.SIGSTOP)
        elif kind in ("journal_blackhole", "journal_refuse"):
            relay = self.journal[str(node)]
            if kind == "journal_blackhole":
                relay.blackhole()
            else:
                relay.cut()
            with self._lock:
                self._cut_since[str(node)] = self._last_cut[str(node)] = time.monotonic()
                self._cut_flagged.discard(str(node))
        elif kind == "peer_blackhole":
            self.peer[str(node)].blackhole()
        elif kind in _DATABASE:
            with self._lock:
                self._outage = {e.pid: e.host for e in _live_engines(self.hosts)}
                self._outage_until = None
            assert self.server is not None
            if kind == "db_restart":
                self.server.stop_server("fast")
            else:
                self._freeze_database()
        elif kind == "apply":
            self._operation(self._apply, self._host(node))
        elif kind == "drain":
            self._operation(self._drain, self._host(node))

    def _end(self, step: Step) -> None:
        kind, node = step.kind, step.target
        self._event(f"heal {kind} {node or 'database'}")
        if kind == "kill":
            host = self._host(node)
            host.start()
            with self._lock:
                self._down[host.node] = "starting"
            threading.Thread(target=self._started, args=(host,), daemon=True).start()
        elif kind in ("pause", "pause_long"):
            host = self._host(node)
            assert host.process is not None
            host.process.send_signal(signal.SIGCONT)
            with self._lock:
                self._disturbed[host.node] = time.monotonic()
                if self._paused_from.pop(host.node, None) == "starting":
                    self._down[host.node] = "starting"  # _started clears it once it listens
                else:
                    self._down.pop(host.node, None)
        elif kind in ("journal_blackhole", "journal_refuse"):
            self.journal[str(node)].heal()
            with self._lock:
                self._cut_since.pop(str(node), None)
        elif kind == "peer_blackhole":
            self.peer[str(node)].heal()
        elif kind in _DATABASE:
            assert self.server is not None
            if kind == "db_restart":
                self.server.start_server()
            else:
                self._thaw_database()
            with self._lock:
                # A fence decided in the outage may land just after it: the check goes on
                # for OUTAGE_TAIL_S after the heal.
                self._outage_until = time.monotonic() + OUTAGE_TAIL_S
        elif kind == "drain":
            self._operation(self._uncordon, step)

    def _started(self, host: FleetHost) -> None:
        """Keep ``host`` down (its requests not judged) until its gateway listens again."""
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not self._stop.is_set():
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", host.gateway), timeout=1),
            ):
                break
            time.sleep(0.1)
        with self._lock:
            self._disturbed[host.node] = time.monotonic()
            if self._down.get(host.node) == "starting":  # not a fault begun meanwhile
                del self._down[host.node]

    def _database_processes(self) -> list[psutil.Process]:
        assert self.server is not None
        pid_file = self.server.data_dir / "postmaster.pid"
        try:
            pid = int(pid_file.read_text().split("\n", 1)[0])
            postmaster = psutil.Process(pid)
            return [postmaster, *postmaster.children(recursive=True)]
        except (OSError, ValueError, psutil.Error):
            return []

    def _freeze_database(self) -> None:
        # The postmaster first, so that it forks no backend that would escape the freeze.
        for process in self._database_processes():
            with contextlib.suppress(psutil.Error):
                process.send_signal(signal.SIGSTOP)

    def _thaw_database(self) -> None:
        for process in reversed(self._database_processes()):
            with contextlib.suppress(psutil.Error):
                process.send_signal(signal.SIGCONT)

    # -- operations --------------------------------------------------------------------

    def _operation(self, target: Callable[[Any], None], arg: Any) -> None:
        """Run an operation beside the schedule (a CLI call takes seconds)."""
        thread = threading.Thread(target=target, args=(arg,), daemon=True)
        self._operations.append(thread)
        thread.start()

    def _run_cli(self, host: FleetHost, *args: str) -> subprocess.CompletedProcess[str]:
        """One operation through ``host``'s CLI; one that does not end within
        :data:`OP_BOUND_S` (the request bound plus the CLI's own start) is a violation."""
        began = self._now()
        done = _cli(host, *args, timeout_s=OP_BOUND_S)
        if done.returncode == 124:
            self._violate(
                "operation_unbounded",
                f"`sbproxy {' '.join(args[:3])}` through {host.node} began t={began:.2f}s and"
                f" did not end within {OP_BOUND_S:.0f} s",
            )
        return done

    def _apply_now(self, host: FleetHost, replicas: int) -> bool:
        host.write({DEPLOYMENT: {**TINY, "replicas": replicas}})
        done = self._run_cli(host, "apply", "-f", str(host.config))
        self._last_error = (done.stdout + done.stderr)[-300:]
        return done.returncode == 0

    def _open_change(self, *, new: int | None = None, drained: str | None = None) -> None:
        with self._lock:
            if new is not None and new != self.desired:
                self._desired_alt, self.desired = self.desired, new
                self._desired_known = False
            if drained is not None:
                self._drained = drained
            self._settling_since = time.monotonic()
            self._settled_for = None

    def _apply(self, host: FleetHost) -> None:
        with self._lock:
            new = 1 if self.desired == 2 else 2
        self._open_change(new=new)
        ok = self._apply_now(host, new)
        # A failed apply may still have committed: the journal says which count holds (both
        # stay allowed while it cannot be read).
        known = new if ok else self._desired_from_database()
        with self._lock:
            self.report.operations[f"apply:{'ok' if ok else 'failed'}"] += 1
            self._desired_known = known is not None
            if known is not None:
                self.desired = known
        outcome = "ok" if ok else f"FAILED {self._last_error}"
        self._event(f"apply replicas={new} through {host.node}: {outcome}")

    def _through(self, node: str | None) -> FleetHost:
        """A host other than ``node`` to send an operation through: one that runs and
        reaches the database, as an operator would pick."""
        with self._lock:
            faulty = set(self._down) | set(self._cut_since)
        others = [h for h in self.hosts if h.node != node]
        return next((h for h in others if h.node not in faulty), others[0])

    def _drain(self, host: FleetHost) -> None:
        through = self._through(host.node)
        self._open_change(drained=host.node)
        done = self._run_cli(through, "nodes", "drain", host.node)
        ok = done.returncode == 0
        with self._lock:
            self.report.operations[f"drain:{'ok' if ok else 'failed'}"] += 1
        self._event(f"drain {host.node}: {'ok' if ok else 'FAILED ' + done.stdout[-300:]}")

    def _uncordon(self, step: Step) -> None:
        # Retried as an operator would (a cordon left behind would shrink the fleet for
        # the rest of the run); each try through a host that reaches the database.
        for _ in range(3):
            done = self._run_cli(self._through(step.target), "nodes", "uncordon", str(step.target))
            ok = done.returncode == 0
            if ok:
                break
            time.sleep(2)
        with self._lock:
            self.report.operations[f"uncordon:{'ok' if ok else 'failed'}"] += 1
            self._drained = None
        self._event(f"uncordon {step.target}: {'ok' if ok else 'FAILED ' + done.stdout[-300:]}")

    # -- the request loop --------------------------------------------------------------

    def _requests(self, host: FleetHost) -> None:
        client = httpx.Client(timeout=httpx.Timeout(REQUEST_BOUND_S))
        body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]}
        with client:
            while not self._stop.is_set():
                with self._lock:
                    down = host.node in self._down
                if down:
                    time.sleep(REQUEST_GAP_S)
                    continue
                began = time.monotonic()
                status: int | None = None
                retry_after = False
                error = ""
                code = ""
                try:
                    answer = client.post(
                        f"http://localhost:{host.gateway}/v1/chat/completions", json=body
                    )
                    status, retry_after = answer.status_code, "retry-after" in answer.headers
                    if status != 200:
                        error = answer.text[:200]
                        code = _error_code(answer)
                except httpx.TimeoutException:
                    error = "timeout"
                except httpx.HTTPError as exc:
                    error = repr(exc)
                ended = time.monotonic()
                self._judge(host.node, began, ended, status, retry_after, error, code)
                time.sleep(REQUEST_GAP_S)

    def _judge(
        self,
        node: str,
        began: float,
        ended: float,
        status: int | None,
        retry_after: bool,
        error: str,
        code: str = "",
    ) -> None:
        took = ended - began
        with self._lock:
            disturbed = node in self._down or self._disturbed.get(node, -1.0) >= began
        if disturbed:
            outcome, bad = "host_down", None
        elif status == 200:
            outcome, bad = "ok", None
        elif status in (429, 503) and retry_after:
            outcome, bad = "retry_later", None
        elif (status, code) in _UPSTREAM_LOST:
            # A request that may have reached an engine is never sent again (issue 30, item
            # 25): its documented answer is a 502 or 504, at once.
            outcome, bad = "upstream_lost", None
        elif status is not None:
            outcome, bad = f"status_{status}", "request_bad_answer"
        elif error == "timeout":
            outcome, bad = "timeout", "request_unbounded"
        else:
            outcome, bad = "no_answer", "request_failed"
        if bad is None and not disturbed and took > REQUEST_BOUND_S:
            bad = "request_unbounded"
        with self._lock:
            self.report.requests[outcome] += 1
            if not disturbed:
                self.report.request_max_s = max(self.report.request_max_s, took)
        if bad is not None:
            self._violate(
                bad,
                f"request through {node} began t={began - self._t0:.2f}s, took {took:.2f} s:"
                f" {status} {error[:200]}",
            )

    # -- the checker -------------------------------------------------------------------

    def _checker(self) -> None:
        while not self._stop.is_set():
            tick = time.monotonic()
            with contextlib.suppress(psutil.Error):  # a process that went mid-scan
                self._check(tick)
            self._supervise()
            time.sleep(max(0.0, CHECK_PERIOD_S - (time.monotonic() - tick)))

    def _supervise(self) -> None:
        """Restart a host that exited by itself, as a supervisor (systemd) would. One that
        exits while it serves is ``host_exited``; one that exits while it boots (before its
        gateway listened: a host that cannot reach its journal at start refuses to start)
        is logged and restarted, not judged."""
        for host in self.hosts:
            with self._lock:
                state = self._down.get(host.node)
                if state in ("kill", "pause", "pause_long") or host.process is None:
                    continue
                status = host.process.poll()
                if status is None:
                    continue
                self._down[host.node] = "starting"
            last = host.output.strip().splitlines()[-1:] or [""]
            if state == "starting":
                self._event(
                    f"{host.node} exited while it booted (status {status}): {last[0][:300]}"
                )
            else:
                self._violate(
                    "host_exited",
                    f"{host.node} exited by itself while serving (status {status}); its log"
                    f" ends: {host.output[-1200:]}",
                )
            time.sleep(1.0)  # a supervisor's restart delay
            host.start()
            threading.Thread(target=self._started, args=(host,), daemon=True).start()

    def _check(self, tick: float) -> None:
        engines = _live_engines(self.hosts)
        allowed = self._allowed(tick, engines)
        self._check_count(tick, engines, allowed)
        self._check_cuts(tick, engines)
        self._check_outage(engines)
        holding = {e.host for e in engines}
        for node in sorted(self._unfenced - holding):
            self._event(
                f"{node} holds no engine any more,"
                f" {tick - self._last_cut[node]:.2f} s after its journal link went bad"
            )
        self._unfenced &= holding

    def _allowed(self, tick: float, engines: list[_Engine]) -> int:
        """The engines allowed now: the desired count (the larger of the old and new one
        while a change settles) plus the surge (1 while a change settles)."""
        live = len(engines)
        with self._lock:
            settling = self._settling_since is not None
            if self._settling_since is not None:
                drained_clear = self._drained is None or all(
                    e.host != self._drained for e in engines
                )
                if live == self.desired and drained_clear:
                    self._settled_for = self._settled_for or tick
                else:
                    self._settled_for = None
                settled = self._settled_for is not None and tick - self._settled_for >= SETTLE_S
                if settled or tick - self._settling_since >= SETTLE_MAX_S:
                    self._settling_since = self._settled_for = None
                    if self._desired_known:  # the old count is gone once settled
                        self._desired_alt = None
                    settling = False
            allowed = max(self.desired, self._desired_alt or 0) + (1 if settling else 0)
            self.report.max_allowed = max(self.report.max_allowed, allowed)
            if live > self.report.max_live[0]:
                self.report.max_live = (live, allowed)
        return allowed

    def _check_count(self, tick: float, engines: list[_Engine], allowed: int) -> None:
        """Engines over the allowed count: one violation per episode, when it ends."""
        live = len(engines)
        if live > allowed:
            if self._over_since is None:
                self._over_since = tick
            if live >= self._over_max:
                self._over_max, self._over_allowed = live, allowed
                counts = Counter(e.host for e in engines)
                with self._lock:
                    down = ", ".join(f"{n} {k}" for n, k in sorted(self._down.items()))
                    cut = ", ".join(sorted(self._cut_since))
                self._over_where = [f"{n}: {c}" for n, c in sorted(counts.items())] + [
                    f"down: {down or '-'}",
                    f"journal cut: {cut or '-'}",
                ]
        elif self._over_since is not None:
            self._end_over(tick)

    def _end_over(self, tick: float) -> None:
        assert self._over_since is not None
        self._violate_at(
            self._over_since,
            "engines_over_replicas",
            f"{self._over_max} live engines (allowed {self._over_allowed}) for"
            f" {tick - self._over_since:.2f} s; at the peak {'; '.join(self._over_where)}",
        )
        self._over_since, self._over_max = None, 0

    def _check_cuts(self, tick: float, engines: list[_Engine]) -> None:
        """A host cut off alone from the database runs no engine past the fence bound."""
        with self._lock:
            cuts = dict(self._cut_since)
        deadline = FENCE_AFTER_MS / 1000 + FENCE_SLACK_S
        for node, since in cuts.items():
            if tick - since > deadline and node not in self._cut_flagged:
                running = [e.pid for e in engines if e.host == node]
                if running:
                    self._cut_flagged.add(node)
                    self._unfenced.add(node)
                    self._violate(
                        "engine_after_cut",
                        f"{node} still runs engine(s) {running} {tick - since:.2f} s after its"
                        f" journal link went bad (bound {deadline:.2f} s)",
                    )

    def _check_outage(self, engines: list[_Engine]) -> None:
        """The database down for everyone: every engine that ran at its start runs on."""
        with self._lock:
            if self._outage_until is not None and time.monotonic() > self._outage_until:
                self._outage, self._outage_until = None, None
            outage = dict(self._outage) if self._outage is not None else None
            # A fault begun in the tail after the heal explains its own host's stops; so does
            # an operator's drain of it (a drained node stops its engines: that is the drain).
            excused = set(self._down) | set(self._cut_since)
            if self._drained is not None:
                excused.add(self._drained)
        if outage is None:
            return
        alive = {e.pid for e in engines}
        for pid, node in outage.items():
            if pid not in alive and pid not in self._outage_flagged and node not in excused:
                self._outage_flagged.add(pid)
                if node in self._unfenced:
                    self._event(
                        f"engine {pid} on {node} stopped in the outage: the late fence of its"
                        " earlier cut (engine_after_cut), not counted again"
                    )
                    continue
                self._violate(
                    "engine_lost_in_outage",
                    f"engine {pid} on {node} stopped while the database was down for every host",
                )

    def _violate_at(self, tick: float, kind: str, detail: str) -> None:
        with self._lock:
            self.report.violations.append(Violation(tick - self._t0, kind, detail))
        self.log(f"[nemesis t={tick - self._t0:7.2f}s] VIOLATION {kind}: {detail}")

    # -- after the schedule ------------------------------------------------------------

    def _desired_from_database(self) -> int | None:
        with contextlib.suppress(psycopg.Error, ValueError, KeyError, TypeError):
            with psycopg.connect(self.url, connect_timeout=5) as connection:
                row = connection.execute(
                    "SELECT document FROM desired_revisions ORDER BY revision DESC LIMIT 1"
                ).fetchone()
            if row is not None:
                return int(json.loads(row[0])["deployments"][DEPLOYMENT].get("replicas", 1))
        return None

    def _converge(self) -> None:
        ended = time.monotonic()
        deadline = ended + CONVERGE_S
        desired = self._desired_from_database()
        if desired is not None and desired != self.desired:
            self._event(f"the journal's desired replicas are {desired}, not {self.desired}")
        with self._lock:
            self.desired, self._desired_alt = desired or self.desired, None
            self._desired_known = True
        last = ""
        while time.monotonic() < deadline:
            engines = _live_engines(self.hosts)
            healthy = sum(1 for e in engines if e.port is not None and self._healthy(e.port))
            failing = self._not_answering()
            if len(engines) == self.desired and healthy == self.desired and not failing:
                self.report.convergence_s = time.monotonic() - ended
                self._event(f"converged after {self.report.convergence_s:.2f} s")
                return
            last = (
                f"{len(engines)} live engines ({healthy} healthy) on "
                + ", ".join(sorted(e.host for e in engines))
                + f"; gateways not answering 200: {'; '.join(failing) or '-'}"
            )
            time.sleep(0.5)
        self._violate(
            "not_converged",
            f"not within {CONVERGE_S:.0f} s: {last}; desired {self.desired}",
        )

    @staticmethod
    def _healthy(port: int) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _jobs(self) -> None:
        sql = (
            "SELECT id, kind, status, lease_owner, lease_expires_at_ms, updated_at_ms,"
            " (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::bigint FROM jobs"
            " WHERE status IN ('queued', 'running')"
        )
        try:
            with psycopg.connect(self.url, connect_timeout=5) as connection:
                rows = connection.execute(sql).fetchall()
        except psycopg.Error as exc:
            self._violate("job_not_terminal", f"the jobs table could not be read: {exc}")
            return
        for job, kind, status, owner, lease_ms, updated_ms, now_ms in rows:
            leased = status == "running" and lease_ms is not None and lease_ms > now_ms
            if not leased and now_ms - updated_ms > JOB_BOUND_S * 1000:
                self._violate(
                    "job_not_terminal",
                    f"job {job} ({kind}) is {status} (lease owner {owner}), last updated"
                    f" {(now_ms - updated_ms) / 1000:.1f} s ago",
                )


def seed_from_environment(default: int) -> int:
    """``SBPROXY_NEMESIS_SEED`` as an int, else ``default``."""
    value = os.environ.get("SBPROXY_NEMESIS_SEED", "").strip()
    return int(value) if value else default


_UPSTREAM_LOST = frozenset({(502, "upstream_unavailable"), (504, "engine_timeout")})


def _error_code(answer: httpx.Response) -> str:
    """The OpenAI envelope's ``error.code`` of ``answer`` ('' when there is none)."""
    try:
        body = answer.json()
    except ValueError:
        return ""
    error = body.get("error") if isinstance(body, dict) else None
    return str(error.get("code") or "") if isinstance(error, dict) else ""
