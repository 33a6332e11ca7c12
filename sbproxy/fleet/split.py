"""This node's part in replicas split over several nodes (llama.cpp RPC): the workers it
runs, and the tunnels of the splits it leads.

A split placement (:class:`~sbproxy.fleet.placement.SplitWorker`) names its workers, the
leader's node first. On every node it names, :class:`SplitNode` runs one
``ggml-rpc-server`` for it -- a supervised child with an ownership record like every engine
(``engines/process.py``), on loopback only -- and an :class:`~sbproxy.model_host.engines.
rpc.RpcGate` in front of it on the node's peer address, which lets the split's leader
through and no other member. The node reports the worker in its renewals under
``rpc:<placement>``: ``starting``, ``ready`` with the gate's port, or ``failed`` with a
reason code. A worker runs while its placement is not ``stopping`` and its leader's node is
a live member; it is stopped (and its gate closed) the moment either ends, and killed when
this node fences itself. A worker whose ``ggml-rpc-server`` exits is not restarted: it
reports ``failed``, the controller moves the whole split (``worker_failed``), and the
leader stops its generation meanwhile.

On the leader's node, a split is loaded only once every worker's node is serving (not
leaving, lost or left) and reports it ``ready``: one
:class:`~sbproxy.model_host.engines.rpc.RpcTunnel` per worker on loopback, and the runtime
launches ``llama-server --rpc`` over them with the placement's share as its reservation
(:class:`~sbproxy.model_host.runtime.context.SplitLaunch`). While any worker is not ready
the leader runs nothing for it (a running generation drains and stops).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.abc

from sbproxy.errors import SbproxyError
from sbproxy.fleet.control import local_placements, rpc_report_key
from sbproxy.model_host.artifacts import CacheLayout
from sbproxy.model_host.engines.llama_build import RPC_SERVER
from sbproxy.model_host.engines.process import EngineProcess, spawn_engine
from sbproxy.model_host.engines.rpc import RpcGate, RpcTunnel, plan_rpc_worker, wait_listening
from sbproxy.model_host.runtime.context import SplitLaunch
from sbproxy.model_host.runtime.upstream import free_port
from sbproxy.store.admission import secret_hash
from sbproxy.workflows import WorkerIdentity

__all__ = ["SplitNode", "WorkerState", "gate_host"]

logger = logging.getLogger(__name__)

# How long a new ggml-rpc-server may take to listen.
LISTEN_TIMEOUT_S = 60.0
# How long a stopping one gets after SIGTERM.
STOP_GRACE_S = 2.0


class WorkerState:
    """What a node reports of one split worker (``rpc:<placement>``)."""

    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"


def gate_host(advertise_url: str) -> str:
    """The address a node's RPC gates listen on, and peers reach them at: its advertised
    peer address's host."""
    return urlsplit(advertise_url).hostname or "127.0.0.1"


@dataclass
class _Worker:
    placement: str
    deployment: str
    state: str = WorkerState.STARTING
    error: str | None = None
    process: EngineProcess | None = None
    gate: RpcGate | None = None
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)


@dataclass
class _Led:
    """The tunnels of one split this node leads, and the gates they reach."""

    gates: tuple[tuple[str, int], ...]
    tunnels: list[RpcTunnel]
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)


class SplitNode:
    """This node's split workers and the tunnels of the splits it leads (module docstring).

    Args:
        node_id: This node.
        advertise_url: Its peer address (gates listen on its host).
        layout: Its cache layout (worker logs, ownership records).
        executable: The ``llama-server`` this node runs (``ggml-rpc-server`` is beside it).
        credentials: ``{node: credential}`` lookup a gate checks a caller against (the
            member's credential hash; ``None``: refused).
        own_credential: What this node proves to other nodes' gates (``None`` before it
            joined with one).
        threads: CPU threads per worker (``None``: the server's default).
        accelerator: This node's device kind (``cpu``, ``cuda``): a CUDA worker sees only
            the device its placement names (``CUDA_VISIBLE_DEVICES``).
    """

    def __init__(
        self,
        *,
        node_id: str,
        advertise_url: str,
        layout: CacheLayout,
        executable: Callable[[], Awaitable[Path]],
        credentials: Callable[[str], str | None],
        own_credential: Callable[[], str | None],
        threads: int | None = None,
        accelerator: str = "cpu",
    ) -> None:
        self.node_id = node_id
        self.accelerator = accelerator
        self.host = gate_host(advertise_url)
        self.layout = layout
        self.executable = executable
        self.credentials = credentials
        self.own_credential = own_credential
        self.threads = threads
        self.identity = WorkerIdentity.current()
        self.workers: dict[str, _Worker] = {}
        self.led: dict[str, _Led] = {}

    # -- what the renewal reports -----------------------------------------------------------

    def report(self) -> dict[str, dict[str, Any]]:
        """``{rpc:<placement>: {"state", "gate_port", "error"}}`` of this node's workers."""
        out: dict[str, dict[str, Any]] = {}
        for worker in self.workers.values():
            entry: dict[str, Any] = {"state": worker.state, "placement": worker.placement}
            if worker.gate is not None and worker.state == WorkerState.READY:
                entry["gate_port"] = worker.gate.port
            if worker.error is not None:
                entry["error"] = worker.error
            out[rpc_report_key(worker.placement)] = entry
        return out

    # -- workers ------------------------------------------------------------------------------

    async def sync(
        self, placements: Sequence[Any], live: frozenset[str], group: anyio.abc.TaskGroup
    ) -> None:
        """Run a worker for every split placement naming this node that is not stopping and
        whose leader is a live member (``live``); stop the others; mark the ones whose
        ``ggml-rpc-server`` exited as failed."""
        wanted = {
            p.id: p
            for p in placements
            if p.workers
            and p.state != "stopping"
            and p.node in live
            and any(w["node"] == self.node_id for w in p.workers)
        }
        for placement in [pid for pid in self.workers if pid not in wanted]:
            await self._stop(self.workers.pop(placement))
        for placement, row in wanted.items():
            if placement not in self.workers:
                worker = _Worker(placement=placement, deployment=row.deployment)
                self.workers[placement] = worker
                group.start_soon(self._start, worker, row)
        for worker in self.workers.values():
            process = worker.process
            if worker.state == WorkerState.READY and process is not None and not process.alive():
                self._fail(worker, "rpc_worker_exited", f"exited with status {process.returncode}")
                worker.scope.cancel()

    async def _start(self, worker: _Worker, row: Any) -> None:
        with worker.scope:
            try:
                executable = (await self.executable()).parent / RPC_SERVER
                port = free_port()
                plan = plan_rpc_worker(executable, port=port, threads=self.threads)
                env = dict(plan.env)
                if self.accelerator == "cuda":
                    devices = [w["devices"] for w in row.workers if w["node"] == self.node_id]
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices[0])
                worker.process = await spawn_engine(
                    plan.argv,
                    env=env,
                    log_path=self.layout.logs / f"rpc-{worker.deployment}-{worker.placement}.log",
                    owned_dir=self.layout.owned_engines,
                    label=f"rpc/{worker.deployment}/{worker.placement}",
                    identity=self.identity,
                )
                await wait_listening(worker.process, port, timeout_s=LISTEN_TIMEOUT_S)
                leader = str(row.node)
                gate = RpcGate(
                    target_port=port,
                    # Only the split's own leader passes (any other member is refused).
                    credentials=lambda node: self.credentials(node) if node == leader else None,
                    host=self.host,
                )
                async with anyio.create_task_group() as gates:
                    await gates.start(gate.serve)
                    worker.gate = gate
                    worker.state = WorkerState.READY
                    logger.info(
                        "split %s (placement %s): RPC worker ready on 127.0.0.1:%d, gate %s:%d",
                        row.deployment,
                        worker.placement,
                        port,
                        self.host,
                        gate.port,
                    )
            except SbproxyError as exc:
                self._fail(worker, exc.code, str(exc))
            except OSError as exc:
                self._fail(worker, "rpc_worker_unavailable", f"gate on {self.host}: {exc}")
            except Exception as exc:
                # Never the host's end: the worker fails, and its split moves.
                logger.exception("split %s: RPC worker broke", worker.deployment)
                self._fail(worker, "rpc_worker_unavailable", f"{type(exc).__name__}: {exc}")
        if worker.process is not None and worker.state != WorkerState.READY:
            await worker.process.shutdown(grace_s=STOP_GRACE_S)

    def _fail(self, worker: _Worker, code: str, message: str) -> None:
        if worker.state == WorkerState.FAILED:
            return
        worker.state = WorkerState.FAILED
        worker.error = code
        logger.warning(
            "split %s (placement %s): RPC worker failed [%s] %s; the split is placed again",
            worker.deployment,
            worker.placement,
            code,
            message,
        )

    async def _stop(self, worker: _Worker) -> None:
        worker.scope.cancel()
        if worker.process is not None:
            with anyio.CancelScope(shield=True):
                await worker.process.shutdown(grace_s=STOP_GRACE_S)
        logger.info(
            "split %s (placement %s): RPC worker stopped", worker.deployment, worker.placement
        )

    def kill_all(self) -> list[int]:
        """Kill every worker and close every gate and tunnel now (a fence); the pids. The
        workers stay listed as failed until their placements end."""
        killed = []
        for worker in self.workers.values():
            worker.scope.cancel()
            if worker.process is not None and worker.process.alive():
                worker.process.kill()
                killed.append(worker.process.pid)
            # Not started again in place: reported failed once this node renews, so the
            # whole split moves (its leader lost what this worker held).
            self._fail(worker, "rpc_worker_exited", "killed by this node's fence")
        for led in self.led.values():
            led.scope.cancel()
        self.led.clear()
        return killed

    async def aclose(self) -> None:
        """Stop every worker (gracefully) and close every tunnel: the host is stopping."""
        for placement in list(self.workers):
            await self._stop(self.workers.pop(placement))
        for led in self.led.values():
            led.scope.cancel()
        self.led.clear()

    # -- splits this node leads ---------------------------------------------------------

    async def lead(
        self,
        placements: Sequence[Any],
        nodes: Mapping[str, Any],
        live: frozenset[str],
        group: anyio.abc.TaskGroup,
    ) -> tuple[dict[str, SplitLaunch], frozenset[str]]:
        """The splits this node leads: ``({local id: launch}, {local ids waiting})`` --
        a split is launchable once every worker's node is a serving member (``ready``,
        ``suspect``, ``cordoned``, ``draining``: not leaving, lost or left) that reports it
        ``ready`` (its tunnels are opened then), and waits otherwise (its local deployment
        is not run meanwhile: a running generation drains and stops).

        Args:
            placements: Every placement (``PlacementRow``-shaped).
            nodes: ``{node id: NodeRow}`` of the members (their reports and addresses).
            live: The serving members (:data:`~sbproxy.fleet.membership.LIVE_STATES`).
            group: Where the tunnels serve.
        """
        ready: dict[str, SplitLaunch] = {}
        waiting: set[str] = set()
        mine = local_placements(placements, self.node_id)
        for local, row in mine.items():
            if not row.workers:
                continue
            gates = self._gates(row, {n: nodes[n] for n in nodes if n in live})
            if gates is None:
                waiting.add(local)
                continue
            led = self.led.get(row.id)
            if led is not None and led.gates != gates:
                led.scope.cancel()
                led = None
            if led is None:
                led = await self._open(row.id, gates, group)
                if led is None:
                    waiting.add(local)
                    continue
                if len(led.tunnels) != len(gates):  # some could not listen: never a part
                    led.scope.cancel()
                    waiting.add(local)
                    continue
                self.led[row.id] = led
            ready[local] = SplitLaunch(
                endpoints=tuple(t.endpoint for t in led.tunnels),
                reserved_bytes=int(row.reserved_bytes),
                probe=partial(_probe, tuple(led.tunnels)),
                placement=row.id,
            )
        leading = {row.id for row in mine.values() if row.workers}
        for placement in [p for p in self.led if p not in leading]:
            self.led.pop(placement).scope.cancel()
        return ready, frozenset(waiting)

    def _gates(self, row: Any, nodes: Mapping[str, Any]) -> tuple[tuple[str, int], ...] | None:
        found = []
        for worker in row.workers:
            node = nodes.get(worker["node"])
            if node is None:
                return None
            report = node.replicas.get(rpc_report_key(row.id))
            if (
                not report
                or report.get("state") != WorkerState.READY
                or not report.get("gate_port")
            ):
                return None
            found.append((gate_host(node.advertise_url or ""), int(report["gate_port"])))
        return tuple(found)

    async def _open(
        self, placement: str, gates: tuple[tuple[str, int], ...], group: anyio.abc.TaskGroup
    ) -> _Led | None:
        secret = self.own_credential()
        if secret is None:
            return None
        credential = secret_hash(secret)
        led = _Led(gates=gates, tunnels=[])

        async def serve(*, task_status: anyio.abc.TaskStatus[None]) -> None:
            started = False
            try:
                with led.scope:
                    async with anyio.create_task_group() as tunnels:
                        for gate in gates:
                            tunnel = RpcTunnel(gate=gate, node=self.node_id, credential=credential)
                            await tunnels.start(tunnel.serve)
                            led.tunnels.append(tunnel)
                        task_status.started()
                        started = True
            except Exception:
                # Never the host's end: the split's launch then fails its probe.
                logger.exception("split placement %s: its tunnels broke", placement)
            if not started:
                task_status.started()

        await group.start(serve)
        return led


async def _probe(tunnels: Sequence[RpcTunnel]) -> None:
    """Pass every worker's gate handshake once (then hang up), before the leader launches.

    Raises:
        EngineError: ``rpc_worker_unavailable``, ``peer_unauthorized``,
            ``rpc_handshake_invalid`` (:meth:`RpcTunnel.open`).
    """
    for tunnel in tunnels:
        stream, _ = await tunnel.open()
        await stream.aclose()


def worker_threads(devices: int) -> int | None:
    """CPU threads for one worker on a host whose CPU is split into ``devices`` devices:
    its share of the cores (``None`` on a host of one device: the server's default)."""
    if devices <= 1:
        return None
    return max(1, (os.cpu_count() or 1) // devices)
