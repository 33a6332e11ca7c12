"""What a fleet node reports of itself, and what the planner makes of it: the GGUF header
facts of the artifacts verified in its real cache (each read once), every probed device with
its own budget, and a two-GPU node's report placing a ``tensor_parallel: 2`` replica, or two
replicas, on its two devices."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from sbproxy.catalog import Accelerator, WorkerProfile
from sbproxy.fleet.cluster import PULLING_WITHIN_S, CachedFacts, CacheInventory
from sbproxy.fleet.control import device_capacities, observe
from sbproxy.fleet.membership import FleetTiming
from sbproxy.fleet.placement import (
    DeploymentSpec,
    PlacementPolicy,
    StartReplica,
    UnplacedReplica,
    plan,
)
from sbproxy.model_host.flows import PullInput, pull_workflow
from sbproxy.model_host.runtime.devices import DeviceInfo, host_devices
from sbproxy.model_host.runtime.memory import MemoryEstimate, read_gguf_header
from sbproxy.store.fleet import NodeRow
from tests.model_host.artifacts.support import make_artifact, pull_engine
from tests.model_host.runtime.support import write_gguf

GIB = 2**30
TIMING = FleetTiming(heartbeat_ms=1_000, fence_after_ms=5_000, lost_after_ms=10_000)
NOW = 1_000_000


def gpu(
    index: int, total_gib: int, free_gib: int, capability: tuple[int, int] | None = (9, 0)
) -> DeviceInfo:
    return DeviceInfo(
        index=index,
        name=f"gpu{index}",
        total_bytes=total_gib * GIB,
        free_bytes=free_gib * GIB,
        compute_capability=capability,
        utilization_percent=None,
    )


CPU = WorkerProfile(accelerator=Accelerator.CPU, memory_bytes=11 * GIB)


CUDA = WorkerProfile(accelerator=Accelerator.CUDA, memory_bytes=80 * GIB)


def test_every_gpu_is_its_own_device_with_what_it_had_free_at_the_probe() -> None:
    # The probe lists GPUs in any order; each keeps its index. It offers what was free at
    # the probe (what the runtime reserves against; memory held by others is not offered),
    # its kind and compute capability.
    probed = [gpu(1, 40, 39, None), gpu(0, 80, 10)]
    assert device_capacities(host_devices(CUDA, probed)) == [
        {
            "index": 0,
            "capacity_bytes": 10 * GIB,
            "accelerator": "cuda",
            "compute_capability": (9, 0),
        },
        {
            "index": 1,
            "capacity_bytes": 39 * GIB,
            "accelerator": "cuda",
            "compute_capability": None,
        },
    ]


def test_a_host_without_gpus_is_one_cpu_device_with_the_worker_budget() -> None:
    assert device_capacities(host_devices(CPU, [])) == [
        {"index": 0, "capacity_bytes": 11 * GIB, "accelerator": "cpu"}
    ]


def test_a_cpu_host_split_in_devices_reports_each_share() -> None:
    # The same devices its runtime reserves against (host_devices with cpu_devices).
    split = host_devices(CPU, [], cpu_devices=2)
    assert device_capacities(split) == [
        {"index": 0, "capacity_bytes": 11 * GIB // 2, "accelerator": "cpu"},
        {"index": 1, "capacity_bytes": 11 * GIB // 2, "accelerator": "cpu"},
    ]
    assert split.capacities() == {0: 11 * GIB // 2, 1: 11 * GIB // 2}
    # GPUs are the devices of a GPU host, whatever cpu_devices says.
    (only,) = device_capacities(host_devices(CUDA, [gpu(0, 24, 20)], cpu_devices=4))
    assert (only["index"], only["capacity_bytes"]) == (0, 20 * GIB)


def two_gpu_node() -> NodeRow:
    return NodeRow(
        id="big",
        advertise_url=None,
        labels={},
        engines=["llama_cpp"],
        devices=device_capacities(host_devices(CUDA, [gpu(0, 24, 24), gpu(1, 24, 24)])),
        artifacts=[],
        replicas={},
        state="ready",
        cordoned=False,
        draining=False,
        left=False,
        joined_at_ms=NOW,
        renewed_at_ms=NOW,
    )


def spec(*, replicas: int = 1, tensor_parallel: int = 1) -> DeploymentSpec:
    return DeploymentSpec(
        id="chat",
        revision=1,
        replicas=replicas,
        engines=("llama_cpp",),
        estimate=MemoryEstimate.from_total(16 * GIB),
        tensor_parallel=tensor_parallel,
    )


def starts(
    replicas: int, tensor_parallel: int, policy: PlacementPolicy
) -> list[tuple[object, ...]]:
    """The plan for the two-GPU node's report: (node, devices) per start, then
    (``unplaced``, reason) per refusal."""
    views = observe([two_gpu_node()], now_ms=NOW, timing=TIMING)
    wanted = spec(replicas=replicas, tensor_parallel=tensor_parallel)
    out: list[tuple[object, ...]] = []
    for d in plan(views, [wanted], [], policy=policy).decisions:
        if isinstance(d, StartReplica):
            out.append((d.node, d.devices))
        elif isinstance(d, UnplacedReplica):
            out.append((d.kind, d.reason.value))
    return out


def test_a_two_gpu_node_report_takes_a_tensor_parallel_replica_across_both() -> None:
    assert starts(1, 2, PlacementPolicy()) == [("big", (0, 1))]


def test_a_two_gpu_node_report_takes_two_replicas_one_per_device_unless_capped() -> None:
    assert starts(2, 1, PlacementPolicy()) == [("big", (0,)), ("big", (1,))]
    # The cap, when a policy sets one.
    assert starts(2, 1, PlacementPolicy(max_replicas_per_node=1)) == [
        ("big", (0,)),
        ("unplaced", "insufficient_capacity"),
    ]


@pytest.mark.parametrize(
    ("minimum", "expected"),
    [
        ((8, 0), [("big", (0,))]),
        ((9, 0), [("big", (0,))]),
        ((10, 0), [("unplaced", "engine_unavailable")]),
    ],
)
def test_a_gpu_node_report_carries_what_a_variant_needs_through_the_journal(
    minimum: tuple[int, int], expected: list[tuple[object, ...]]
) -> None:
    row = two_gpu_node()
    stored = NodeRow(**{**asdict(row), "devices": json.loads(json.dumps(row.devices))})
    views = observe([stored], now_ms=NOW, timing=TIMING)
    assert {(d.accelerator, d.compute_capability) for d in views[0].devices} == {("cuda", (9, 0))}
    wanted = spec().model_copy(
        update={"accelerators": frozenset({"cuda"}), "min_compute_capability": minimum}
    )
    decisions = plan(views, [wanted], []).decisions
    got = [
        (d.node, d.devices) if isinstance(d, StartReplica) else (d.kind, d.reason.value)
        for d in decisions
        if isinstance(d, StartReplica | UnplacedReplica)
    ]
    assert got == expected


def test_a_one_gpu_node_report_never_takes_two_replicas() -> None:
    row = two_gpu_node()
    one = NodeRow(
        **{**asdict(row), "devices": device_capacities(host_devices(CUDA, [gpu(0, 80, 80)]))}
    )
    views = observe([one], now_ms=NOW, timing=TIMING)
    result = plan(views, [spec(replicas=2)], [])
    assert [d.kind for d in result.decisions] == ["start", "unplaced"]


@pytest.mark.anyio
async def test_cached_facts_read_each_verified_gguf_header_once(tmp_path: Path) -> None:
    model = write_gguf(tmp_path / "model.gguf", block_count=6, head_count_kv=4, vocab=50)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf header at all")
    sources = {"good": model, "bad": broken}
    artifacts = {}
    for name, path in sources.items():
        folder = tmp_path / "sources" / name
        folder.mkdir(parents=True)
        (folder / path.name).write_bytes(path.read_bytes())
        artifacts[name] = make_artifact(
            {path.name: path.read_bytes()}, source=f"file:{folder}", model=name
        )
    weights = tmp_path / "sources" / "st"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"\0" * 64)
    artifacts["st"] = make_artifact(
        {"model.safetensors": b"\0" * 64}, source=f"file:{weights}", model="st"
    )
    async with pull_engine(tmp_path / "cache") as (engine, cache):
        for artifact in artifacts.values():
            submitted = await engine.submit(
                pull_workflow,
                PullInput(artifact=artifact),
                idempotency_key=artifact.digest,
            )
            await engine.join(submitted.job.id)
        assert len(cache.published()) == 3
        facts = CachedFacts(cache)
        reported = facts()
        # The GGUF with a readable header reports its shape; the broken one and the
        # safetensors artifact report nothing (they are sized from their files).
        assert reported == {artifacts["good"].digest: asdict(read_gguf_header(model))}
        assert reported[artifacts["good"].digest]["block_count"] == 6
        # Read once: a header changed behind the cache's back is not read again.
        snapshot = cache.snapshot(artifacts["good"].digest) / "model.gguf"
        snapshot.chmod(0o644)
        snapshot.write_bytes(b"gone")
        assert facts() == reported


@pytest.mark.anyio
async def test_the_inventory_reports_verified_artifacts_and_pulls_under_way(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "sources" / "one"
    folder.mkdir(parents=True)
    (folder / "model.gguf").write_bytes(b"w" * 100)
    artifact = make_artifact({"model.gguf": b"w" * 100}, source=f"file:{folder}", model="one")
    async with pull_engine(tmp_path / "cache") as (engine, cache):
        submitted = await engine.submit(
            pull_workflow, PullInput(artifact=artifact), idempotency_key=artifact.digest
        )
        await engine.join(submitted.job.id)
        inventory = CacheInventory(cache)
        assert inventory() == {artifact.digest: {"bytes": 100, "verified": True}}
        # A pull under way: its partial bytes so far, unverified.
        fresh = cache.layout.partials / ("f" * 64)
        fresh.mkdir(parents=True)
        (fresh / "model.gguf.part").write_bytes(b"x" * 40)
        # A failed pull's leftovers, untouched for longer than PULLING_WITHIN_S: not a pull.
        stale = cache.layout.partials / ("0" * 64)
        stale.mkdir(parents=True)
        (stale / "model.gguf.part").write_bytes(b"x" * 10)
        old = time.time() - PULLING_WITHIN_S - 5
        os.utime(stale / "model.gguf.part", (old, old))
        assert inventory() == {
            artifact.digest: {"bytes": 100, "verified": True},
            "f" * 64: {"bytes": 40, "verified": False},
        }
