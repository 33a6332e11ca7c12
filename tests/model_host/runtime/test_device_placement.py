"""Device selection and launch placement: a generation runs on the devices it reserved.

The runtime picks each generation's devices (the deployment's ``devices``, else the ones
with the most free memory), reserves the per-device estimate on each, and hands them to the
engine: ``CUDA_VISIBLE_DEVICES`` and ``--n-gpu-layers 999`` on a CUDA host, a share of the
cores (``--threads``) on a CPU host split into several devices. Real cache, journal and
llama.cpp launch plans; the launcher records specs instead of starting processes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from sbproxy.catalog import Accelerator, WorkerProfile
from sbproxy.config import PriorityClass
from sbproxy.model_host.engines import plan_llama_launch
from sbproxy.model_host.engines.driver import LaunchRequest
from sbproxy.model_host.runtime.admission import AdmissionRejected
from sbproxy.model_host.runtime.devices import DeviceInfo, HostDevice, HostDevices, host_devices
from sbproxy.model_host.runtime.residency import ResidencyKey, select_devices
from sbproxy.model_host.runtime.state import DeploymentState
from tests.model_host.runtime.fake_launcher import FakeLauncher
from tests.model_host.runtime.host import Host, runtime_host

pytestmark = pytest.mark.anyio

MIB = 1024**2
GIB = 1024**3
STANDARD = PriorityClass.STANDARD
# One generation of ``tiny`` reserves about 10.1 MiB on one device (5.1 MiB on each of two).
TINY: dict[str, Any] = {"model": "tiny", "variant": "q4_k_m", "engine": "llama_cpp"}


def gpus(*free_mib: int) -> list[DeviceInfo]:
    """NVML-shaped GPUs with ``free_mib`` MiB free each (80 GiB total)."""
    return [
        DeviceInfo(
            index=index,
            name="H100",
            total_bytes=80 * GIB,
            free_bytes=free * MIB,
            compute_capability=(9, 0),
            utilization_percent=None,
        )
        for index, free in enumerate(free_mib)
    ]


def cuda(*free_mib: int) -> HostDevices:
    worker = WorkerProfile(accelerator=Accelerator.CUDA, memory_bytes=max(free_mib) * MIB)
    return host_devices(worker, gpus(*free_mib))


async def load(host: Host, deployment: str) -> LaunchRequest:
    """Serve one request of ``deployment``; the launch request of its engine."""
    (await host.manager.acquire(deployment, priority=STANDARD)).release()
    launcher = host.manager.launcher
    assert isinstance(launcher, FakeLauncher)
    return launcher.specs[-1].request


def plan(host: Host, request: LaunchRequest) -> tuple[list[str], dict[str, str]]:
    launched = plan_llama_launch(request, executable=host.root / "bin" / "llama-server")
    return list(launched.argv), launched.env


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# -- the device table ----------------------------------------------------------------------


def test_a_cuda_host_offers_each_gpu_with_its_free_memory() -> None:
    table = cuda(10_000, 30_000)
    assert table.accelerator is Accelerator.CUDA
    assert table.capacities() == {0: 10_000 * MIB, 1: 30_000 * MIB}
    assert [d.total_bytes for d in table.devices] == [80 * GIB, 80 * GIB]
    assert table.devices[1].compute_capability == (9, 0)


def test_a_cpu_host_splits_its_budget_into_equal_devices() -> None:
    worker = WorkerProfile(accelerator=Accelerator.CPU, memory_bytes=10 * GIB + 1)
    assert host_devices(worker, []).capacities() == {0: 10 * GIB + 1}
    split = host_devices(worker, [], cpu_devices=4)
    assert split.accelerator is Accelerator.CPU
    assert split.capacities() == dict.fromkeys(range(4), (10 * GIB + 1) // 4)
    # A CUDA worker whose GPUs were not probed keeps one device of its budget.
    fallback = WorkerProfile(accelerator=Accelerator.CUDA, memory_bytes=GIB)
    assert host_devices(fallback, [], cpu_devices=4).capacities() == {0: GIB}


@pytest.mark.parametrize(
    ("free", "count", "pinned", "chosen"),
    [
        ({0: 5, 1: 9}, 1, None, (1,)),  # the most free memory
        ({0: 9, 1: 9}, 1, None, (0,)),  # a tie goes to the lower index
        ({0: 1, 1: 7, 2: 7, 3: 2}, 2, None, (1, 2)),  # tensor parallel: the two freest
        ({0: 9, 1: 0}, 1, [1], (1,)),  # pinned wins, full or not (residency decides)
        ({0: 9, 1: 9, 2: 9}, 1, [2, 0], (2, 0)),  # pinned order is kept
    ],
)
def test_selection_picks_the_pinned_or_the_freest_devices(
    free: dict[int, int], count: int, pinned: list[int] | None, chosen: tuple[int, ...]
) -> None:
    assert select_devices(free, deployment="d", count=count, pinned=pinned) == chosen


@pytest.mark.parametrize(
    ("count", "pinned", "phrase"),
    [
        (1, [4], "pinned to device 4, which this host does not have (its devices: 0, 1)"),
        (1, [0, 7], "pinned to device 7"),
        (3, None, "needs 3 devices (tensor_parallel) but this host has 2 (devices: 0, 1)"),
    ],
)
def test_selection_refuses_devices_the_host_lacks(
    count: int, pinned: list[int] | None, phrase: str
) -> None:
    with pytest.raises(AdmissionRejected) as caught:
        select_devices({0: 9, 1: 9}, deployment="d", count=count, pinned=pinned)
    assert caught.value.code == "insufficient_capacity"
    assert phrase in caught.value.message
    assert "proxy.model_host.deployments.d." in caught.value.message


# -- launches on a CUDA host ---------------------------------------------------------------


async def test_a_pinned_deployment_launches_on_its_gpu(tmp_path: Path) -> None:
    async with runtime_host(
        tmp_path,
        deployments={"tiny": {**TINY, "devices": [1]}},
        launcher=FakeLauncher(),
        devices=cuda(16, 16),
    ) as host:
        request = await load(host, "tiny")
        assert (request.accelerator, request.devices) == ("cuda", (1,))
        status = host.manager.snapshot("tiny")
        assert status.selected_devices == (1,)
        assert status.memory is not None
        assert request.gpu_memory_bytes == status.memory["total_bytes"]
        assert request.device_memory_bytes == 80 * GIB
        assert host.manager.residency.free_bytes(0) == 16 * MIB
        assert host.manager.residency.free_bytes(1) == 16 * MIB - request.gpu_memory_bytes
        argv, env = plan(host, request)
        assert env["CUDA_VISIBLE_DEVICES"] == "1"
        assert flag(argv, "--n-gpu-layers") == "999"
        assert "--split-mode" not in argv and "--threads" not in argv


async def test_an_unpinned_generation_takes_the_gpu_with_the_most_free_memory(
    tmp_path: Path,
) -> None:
    async with runtime_host(
        tmp_path,
        deployments={"a": TINY, "b": TINY},
        launcher=FakeLauncher(),
        devices=cuda(14, 20),
    ) as host:
        assert (await load(host, "a")).devices == (1,)
        # Device 1 has about 9.9 MiB left now, device 0 still 14 MiB.
        assert (await load(host, "b")).devices == (0,)
        assert [s.selected_devices for s in host.manager.status()] == [(1,), (0,)]
        assert host.manager.snapshot("a").state == DeploymentState.READY


async def test_tensor_parallel_splits_one_generation_across_two_gpus(tmp_path: Path) -> None:
    async with runtime_host(
        tmp_path,
        deployments={"tiny": {**TINY, "tensor_parallel": 2}},
        launcher=FakeLauncher(),
        devices=cuda(8, 8),  # a whole tiny (about 10.1 MiB) fits on neither alone
    ) as host:
        request = await load(host, "tiny")
        assert request.devices == (0, 1)
        found = host.manager.deployment("tiny")
        metadata = host.manager.cache.read_metadata(request.metadata.artifact_digest)
        assert metadata is not None
        whole = host.manager.estimate(found, metadata)
        assert found.estimate is not None
        assert found.estimate.weight_bytes == whole.weight_bytes // 2
        assert found.estimate.total_bytes < whole.total_bytes
        for device in (0, 1):
            assert host.manager.residency.free_bytes(device) == 8 * MIB - (
                found.estimate.total_bytes
            )
        assert host.manager.snapshot("tiny").selected_devices == (0, 1)
        argv, env = plan(host, request)
        assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
        assert (flag(argv, "--split-mode"), flag(argv, "--tensor-split")) == ("row", "1,1")


@pytest.mark.parametrize(
    ("fields", "phrase"),
    [
        ({"tensor_parallel": 3}, "needs 3 devices (tensor_parallel) but this host has 2"),
        ({"devices": [5]}, "pinned to device 5, which this host does not have (its devices: 0, 1)"),
    ],
)
async def test_a_generation_the_host_has_no_devices_for_is_refused_before_launch(
    tmp_path: Path, fields: dict[str, Any], phrase: str
) -> None:
    launcher = FakeLauncher()
    async with runtime_host(
        tmp_path,
        deployments={"tiny": {**TINY, **fields}},
        launcher=launcher,
        devices=cuda(64, 64),
    ) as host:
        with pytest.raises(AdmissionRejected) as refused:
            await host.manager.acquire("tiny", priority=STANDARD)
        assert refused.value.code == "insufficient_capacity"
        assert phrase in refused.value.message
        assert launcher.specs == []
        status = host.manager.snapshot("tiny")
        assert (status.reason_code, status.selected_devices) == ("insufficient_capacity", ())


async def test_deployments_pinned_to_two_gpus_are_resident_together(tmp_path: Path) -> None:
    # 16 MiB a device holds one tiny, not two: on one device the second would evict the first.
    launcher = FakeLauncher()
    async with runtime_host(
        tmp_path,
        deployments={"a": {**TINY, "devices": [0]}, "b": {**TINY, "devices": [1]}},
        launcher=launcher,
        devices=cuda(16, 16),
    ) as host:
        assert (await load(host, "a")).devices == (0,)
        assert (await load(host, "b")).devices == (1,)
        assert launcher.stopped == []
        states = {s.deployment: (s.state, s.selected_devices) for s in host.manager.status()}
        assert states == {"a": (DeploymentState.READY, (0,)), "b": (DeploymentState.READY, (1,))}


async def test_a_generation_restarted_under_its_number_keeps_its_devices(
    tmp_path: Path,
) -> None:
    # What a failed recreate rollout does: restart the stopped generation, same number.
    async with runtime_host(
        tmp_path, deployments={"a": TINY, "b": TINY}, launcher=FakeLauncher(), devices=cuda(16, 24)
    ) as host:
        manager = host.manager
        assert (await load(host, "a")).devices == (1,)
        found = manager.deployment("a")
        generation = found.generation
        stop = await manager.stop("a")
        await host.engine.join(stop.id)
        assert found.state == DeploymentState.STOPPED
        # b takes device 1 now; device 0 has the most free memory (16 MiB against ~13.9).
        assert (await load(host, "b")).devices == (1,)
        assert manager.residency.free_bytes(0) > manager.residency.free_bytes(1)
        executable = host.root / "bin" / "llama-server"
        await manager.launch_generation(
            found, executable=executable, job_id=stop.id, generation=generation
        )
        assert found.generation == generation
        assert manager.snapshot("a").selected_devices == (1,)
        launcher = manager.launcher
        assert isinstance(launcher, FakeLauncher)
        assert launcher.specs[-1].request.devices == (1,)
        # A new generation chooses afresh: the freest device.
        stop = await manager.stop("a")
        await host.engine.join(stop.id)
        assert (await load(host, "a")).devices == (0,)


# -- launches on a CPU host ----------------------------------------------------------------


async def test_a_cpu_host_split_in_two_runs_two_engines_each_on_its_share(
    tmp_path: Path,
) -> None:
    worker = WorkerProfile(accelerator=Accelerator.CPU, memory_bytes=32 * MIB)
    launcher = FakeLauncher()
    async with runtime_host(
        tmp_path,
        deployments={"a": TINY, "b": TINY},
        launcher=launcher,
        devices=host_devices(worker, [], cpu_devices=2),
    ) as host:
        first, second = await load(host, "a"), await load(host, "b")
        residency = host.manager.residency
        assert residency.capacities == {0: 16 * MIB, 1: 16 * MIB}
        assert residency.get(ResidencyKey("a", host.manager.deployment("a").generation))
        assert [s.selected_devices for s in host.manager.status()] == [(0,), (1,)]
        assert launcher.stopped == []
        threads = max(1, (os.cpu_count() or 1) // 2)
        for request in (first, second):
            assert (request.accelerator, request.devices) == ("cpu", ())
            assert request.threads == threads
            assert request.gpu_memory_bytes is None
            argv, env = plan(host, request)
            assert flag(argv, "--threads") == str(threads)
            assert flag(argv, "--n-gpu-layers") == "0"
            assert "CUDA_VISIBLE_DEVICES" not in env


async def test_a_deployment_on_two_cpu_shares_gets_the_threads_of_both(tmp_path: Path) -> None:
    worker = WorkerProfile(accelerator=Accelerator.CPU, memory_bytes=32 * MIB)
    async with runtime_host(
        tmp_path,
        deployments={"a": {**TINY, "tensor_parallel": 2}},
        launcher=FakeLauncher(),
        devices=host_devices(worker, [], cpu_devices=2),
    ) as host:
        request = await load(host, "a")
        assert host.manager.snapshot("a").selected_devices == (0, 1)
        assert request.threads == 2 * max(1, (os.cpu_count() or 1) // 2)


async def test_the_operators_thread_count_wins_over_the_share(tmp_path: Path) -> None:
    worker = WorkerProfile(accelerator=Accelerator.CPU, memory_bytes=32 * MIB)
    async with runtime_host(
        tmp_path,
        deployments={"a": {**TINY, "extra_args": ["--threads", "3"]}},
        launcher=FakeLauncher(),
        devices=host_devices(worker, [], cpu_devices=2),
    ) as host:
        request = await load(host, "a")
        assert request.threads is None
        argv, _ = plan(host, request)
        assert argv.count("--threads") == 1 and flag(argv, "--threads") == "3"


async def test_one_cpu_device_leaves_the_engines_thread_count_alone(tmp_path: Path) -> None:
    async with runtime_host(
        tmp_path, deployments={"a": TINY}, launcher=FakeLauncher(), memory_bytes=32 * MIB
    ) as host:
        request = await load(host, "a")
        assert (request.accelerator, request.devices, request.threads) == ("cpu", (), None)
        assert host.manager.snapshot("a").selected_devices == (0,)


def test_host_device_lookup() -> None:
    table = HostDevices(
        accelerator=Accelerator.CUDA,
        devices=(HostDevice(index=2, capacity_bytes=1, total_bytes=4),),
    )
    assert table.indexes() == (2,)
    assert table.get(2) == table.devices[0]
    assert table.get(0) is None
