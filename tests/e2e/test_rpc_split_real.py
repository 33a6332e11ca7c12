"""One model split over two hosts' RPC workers, for real: two ``ggml-rpc-server`` workers
built from the pinned source (``engines/rpc.py``), each behind its gate on loopback, and a
leader ``llama-server --rpc`` through its tunnels, serving the real SmolLM2 GGUF. Then one
worker is killed: the leader cannot compute without it and ends, and nothing of the split is
left running once it is stopped."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import psutil
import pytest

from sbproxy.model_host.artifacts import ArtifactCache, CacheLayout
from sbproxy.model_host.engines import LaunchRequest, launch, plan_llama_launch
from sbproxy.model_host.engines.llama_build import RPC_SERVER
from sbproxy.model_host.engines.process import EngineProcess, spawn_engine
from sbproxy.model_host.engines.rpc import RpcGate, RpcTunnel, plan_rpc_worker, wait_listening
from sbproxy.workflows import WorkerIdentity
from tests.e2e.conftest import E2E_TIMEOUT_S
from tests.model_host.engines.support import free_port

pytestmark = [pytest.mark.anyio, pytest.mark.e2e, pytest.mark.timeout(E2E_TIMEOUT_S)]

CREDENTIAL = "e2e-fleet-credential"


def _credentials(node: str) -> str | None:
    return CREDENTIAL if node == "leader" else None


async def _ask(port: int) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
        return await client.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Name a colour."}],
                "max_tokens": 8,
                "temperature": 0,
            },
        )


async def test_a_model_split_over_two_rpc_workers_answers_and_ends_with_a_dead_worker(
    llama_server: Path, smol_cache: Path, tmp_path: Path
) -> None:
    rpc_server = llama_server.parent / RPC_SERVER
    cache = ArtifactCache(CacheLayout(root=smol_cache))
    (metadata,) = cache.published()
    snapshot = cache.snapshot(metadata.artifact_digest)
    weights = sum(item.size_bytes for item in metadata.files)
    identity = WorkerIdentity.current()
    owned = tmp_path / "owned"
    workers: list[EngineProcess] = []
    worker_ports: list[int] = []
    leader: EngineProcess | None = None
    try:
        for index in range(2):
            port = free_port()
            plan = plan_rpc_worker(rpc_server, port=port, threads=1)
            worker = await spawn_engine(
                plan.argv, env=plan.env, log_path=tmp_path / f"worker-{index}.log",
                owned_dir=owned, label=f"rpc/{index}", identity=identity,
            )  # fmt: skip
            workers.append(worker)
            await wait_listening(worker, port, timeout_s=60)
            worker_ports.append(port)
        async with anyio.create_task_group() as group:
            gates = []
            for worker_port in worker_ports:
                gate = RpcGate(target_port=worker_port, credentials=_credentials)
                await group.start(gate.serve)
                gates.append(gate)
            tunnels = []
            for gate in gates:
                tunnel = RpcTunnel(
                    gate=("127.0.0.1", gate.port), node="leader", credential=CREDENTIAL
                )
                await group.start(tunnel.serve)
                tunnels.append(tunnel)
            port = free_port()
            request = LaunchRequest(
                deployment="split",
                generation=1,
                metadata=metadata,
                snapshot=snapshot,
                port=port,
                ctx_size=1024,
                max_concurrency=1,
                threads=1,
                rpc_servers=tuple(tunnel.endpoint for tunnel in tunnels),
            )
            plan = plan_llama_launch(request, executable=llama_server)
            leader = await launch(
                plan, log_path=tmp_path / "leader.log", owned_dir=owned, label="split/1",
                identity=identity, ready_timeout_s=180,
            )  # fmt: skip
            response = await _ask(port)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"]["content"].strip()
            # The weights went over the gates: each worker holds a share of the layers.
            for gate in gates:
                assert gate.accepted >= 1
                assert gate.bytes_in[0] > weights // 4, (gate.bytes_in, weights)
            assert sum(gate.bytes_in[0] for gate in gates) > weights // 2
            for index in range(2):
                log = (tmp_path / f"worker-{index}.log").read_text(errors="replace")
                assert "Accepted client connection" in log, log[-2000:]

            # A worker dies: the leader cannot run its layers, and ends at the next request.
            workers[0].kill()
            await workers[0].wait_exit()
            try:
                failed = await _ask(port)
            except httpx.HTTPError:
                failed = None
            assert failed is None or failed.status_code >= 500
            with anyio.fail_after(60):
                status = await leader.wait_exit()
            assert status != 0
            group.cancel_scope.cancel()
    finally:
        for process in [*workers, *([leader] if leader is not None else [])]:
            await process.shutdown(grace_s=2.0)
    pids = [process.pid for process in workers] + ([leader.pid] if leader else [])
    assert not [pid for pid in pids if psutil.pid_exists(pid) and _not_zombie(pid)]
    assert not list(owned.glob("*.json"))


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
