"""Requests for models being swapped out under load (issue 30, item 15).

A host with ``max_resident_models: 1`` and three deployments, each with its own clients
sending requests all the time: every request for a model not resident swaps it in and
evicts another while that one's clients keep sending. A request that arrives while its
model is being evicted must wait for the model's relaunch within its queue timeout, not be
refused ``draining`` (that answer belongs to an operator's stop or drain). The stand-in
engine ignores SIGTERM, so each eviction drains for the whole stop grace (1 s): the window
in which a request used to meet ``draining``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import anyio
import httpx
import pytest

from sbproxy.config import PriorityClass, Route
from tests.api.support import served

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

NAMES = ("a", "b", "c")
SWAP = {"model": "tiny", "variant": "q4_k_m", "max_concurrency": 2, "queue_timeout_ms": 120_000}
ROUTES = tuple(
    Route(origin="localhost", provider="local", public_model=name, deployment=name)
    for name in NAMES
)
CLIENTS = 3  # per deployment, each sending one request after another
REQUESTS = 4  # per client


def outcome(answer: httpx.Response) -> str:
    """``200``, or ``<status> <error code>``."""
    if answer.status_code == 200:
        return "200"
    try:
        code = answer.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = answer.text[:80]
    return f"{answer.status_code} {code}"


async def test_requests_for_a_model_being_evicted_wait_for_its_relaunch(tmp_path: Path) -> None:
    limit = {
        "cache": {"directory": str(tmp_path / "cache"), "max_resident_models": 1},
        "shutdown_deadline_ms": 1000,  # the stop grace of an engine that ignores SIGTERM
    }
    deployments = {name: dict(SWAP) for name in NAMES}
    counts: Counter[str] = Counter()
    async with (
        served(
            tmp_path,
            deployments=deployments,
            model_host=limit,
            routes=ROUTES,
            mode="ignore_sigterm,reply_delay_s=0.1",
        ) as server,
        httpx.AsyncClient(base_url=server.gateway_url, timeout=300) as client,
    ):

        async def send(model: str) -> None:
            for _ in range(REQUESTS):
                answer = await client.post(
                    "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4}
                )
                counts[outcome(answer)] += 1

        async with anyio.create_task_group() as group:
            for _ in range(CLIENTS):
                for name in NAMES:
                    group.start_soon(send, name)

        transitions = server.host.manager.tallies_snapshot().transitions
        evictions = sum(n for (_, before, after), n in transitions.items() if after == "draining")

    assert sum(counts.values()) == len(NAMES) * CLIENTS * REQUESTS
    assert evictions >= 2, transitions  # the models were swapped, under load
    assert counts["503 draining"] == 0, counts
    # Every request is answered, or at worst times out in the queue (queue_timeout).
    assert set(counts) <= {"200", "503 queue_timeout"}, counts
    assert counts["200"] >= len(NAMES), counts


async def test_an_operator_stop_still_refuses_draining(tmp_path: Path) -> None:
    limit = {"cache": {"directory": str(tmp_path / "cache")}, "shutdown_deadline_ms": 1000}
    async with served(
        tmp_path,
        deployments={"a": dict(SWAP)},
        model_host=limit,
        routes=ROUTES[:1],
        mode="ignore_sigterm",
    ) as server:
        manager = server.host.manager
        permit = await manager.acquire("a", priority=PriorityClass.STANDARD)
        permit.release()
        async with anyio.create_task_group() as group:
            group.start_soon(manager.stop, "a")
            while manager.snapshot("a").state.value != "draining":
                await anyio.sleep(0.01)
            async with httpx.AsyncClient(base_url=server.gateway_url, timeout=30) as client:
                answer = await client.post(
                    "/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 4}
                )
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "draining"
