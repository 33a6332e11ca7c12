"""The worker probe: real CPU probing here, and NVML fakes for GPU hosts this machine lacks."""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import pynvml
import pytest

from sbproxy.catalog import Accelerator
from sbproxy.errors import SbproxyError
from sbproxy.model_host.runtime import (
    cpu_memory_fraction,
    probe_devices,
    probe_host,
    probe_worker,
)


def _no_nvidia(monkeypatch: pytest.MonkeyPatch) -> None:
    def init() -> None:
        raise pynvml.NVMLError_LibraryNotFound()

    monkeypatch.setattr(pynvml, "nvmlInit", init)


def test_cpu_worker_offers_seventy_percent_of_ram_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _no_nvidia(monkeypatch)
    worker = probe_worker(environ={})
    assert worker.accelerator is Accelerator.CPU
    assert worker.compute_capability is None
    assert worker.memory_bytes == int(psutil.virtual_memory().total * 0.7)


def test_cpu_memory_fraction_override(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_nvidia(monkeypatch)
    worker = probe_worker(environ={"SBPROXY_CPU_MEMORY_FRACTION": "0.5"})
    assert worker.memory_bytes == int(psutil.virtual_memory().total * 0.5)


@pytest.mark.parametrize(
    ("raw", "expected"), [("0.95", 0.95), ("0.99", 0.95), ("3", 0.95), ("0.1", 0.1), ("", 0.7)]
)
def test_cpu_memory_fraction_is_capped_at_0_95(raw: str, expected: float) -> None:
    assert cpu_memory_fraction({"SBPROXY_CPU_MEMORY_FRACTION": raw}) == expected


@pytest.mark.parametrize("raw", ["abc", "0", "-0.5", "nan", "inf"])
def test_invalid_cpu_memory_fraction_is_a_clear_error(raw: str) -> None:
    with pytest.raises(SbproxyError) as info:
        cpu_memory_fraction({"SBPROXY_CPU_MEMORY_FRACTION": raw})
    assert info.value.code == "invalid_environment"
    assert "SBPROXY_CPU_MEMORY_FRACTION" in str(info.value)


def test_probe_on_this_machine_does_not_fail() -> None:
    # Whatever this host has (no NVIDIA library here), the probe answers with a profile.
    worker = probe_worker()
    assert worker.memory_bytes > 0


@dataclass
class _Memory:
    free: int
    total: int


@dataclass
class _Utilization:
    gpu: int


class _FakeNvml:
    """Stands in for NVML on a multi-GPU host, which this test machine is not."""

    def __init__(
        self,
        devices: list[tuple[int, tuple[int, int] | None]],
        *,
        utilization: dict[int, int] | None = None,
    ) -> None:
        self.devices = devices
        self.utilization = utilization or {}
        self.shutdowns = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
        monkeypatch.setattr(pynvml, "nvmlShutdown", self.shutdown)
        monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: len(self.devices))
        monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: index)
        monkeypatch.setattr(
            pynvml, "nvmlDeviceGetMemoryInfo", lambda h: _Memory(self.devices[h][0], 80 * 2**30)
        )
        monkeypatch.setattr(pynvml, "nvmlDeviceGetCudaComputeCapability", self.capability)
        monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda h: f"Fake GPU {h}")
        monkeypatch.setattr(pynvml, "nvmlDeviceGetUtilizationRates", self.rates)

    def rates(self, handle: int) -> _Utilization:
        if handle not in self.utilization:
            raise pynvml.NVMLError_NotSupported()
        return _Utilization(self.utilization[handle])

    def shutdown(self) -> None:
        self.shutdowns += 1

    def capability(self, handle: int) -> tuple[int, int]:
        found = self.devices[handle][1]
        if found is None:
            raise pynvml.NVMLError_NotSupported()
        return found


def test_cuda_worker_is_the_device_with_most_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeNvml([(10 * 2**30, (8, 0)), (70 * 2**30, (9, 0)), (40 * 2**30, (8, 6))])
    fake.install(monkeypatch)
    worker = probe_worker(environ={})
    assert worker.accelerator is Accelerator.CUDA
    assert worker.memory_bytes == 70 * 2**30
    assert worker.compute_capability == (9, 0)
    assert fake.shutdowns == 1


def test_a_gpu_host_probed_once_offers_every_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeNvml([(10 * 2**30, (8, 0)), (70 * 2**30, (9, 0))])
    fake.install(monkeypatch)
    worker, devices = probe_host(cpu_devices=4, environ={})
    assert (worker.accelerator, worker.memory_bytes) == (Accelerator.CUDA, 70 * 2**30)
    assert devices.accelerator is Accelerator.CUDA
    assert devices.capacities() == {0: 10 * 2**30, 1: 70 * 2**30}  # cpu_devices ignored
    assert [d.total_bytes for d in devices.devices] == [80 * 2**30] * 2
    assert fake.shutdowns == 1  # one probe


def test_a_cpu_host_splits_its_budget_in_cpu_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_nvidia(monkeypatch)
    worker, devices = probe_host(cpu_devices=3, environ={})
    assert worker.accelerator is Accelerator.CPU
    assert devices.capacities() == dict.fromkeys(range(3), worker.memory_bytes // 3)


def test_unknown_compute_capability_is_reported_as_none(monkeypatch: pytest.MonkeyPatch) -> None:
    _FakeNvml([(8 * 2**30, None)]).install(monkeypatch)
    assert probe_worker(environ={}).compute_capability is None


def test_zero_nvidia_devices_falls_back_to_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _FakeNvml([]).install(monkeypatch)
    assert probe_worker(environ={}).accelerator is Accelerator.CPU


def test_unexpected_nvml_failure_is_reported_not_guessed(monkeypatch: pytest.MonkeyPatch) -> None:
    def init() -> None:
        raise pynvml.NVMLError_NoPermission()

    monkeypatch.setattr(pynvml, "nvmlInit", init)
    with pytest.raises(SbproxyError) as info:
        probe_worker(environ={})
    assert info.value.code == "device_probe_failed"


def test_device_list_keeps_unknown_utilization_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeNvml([(10 * 2**30, (8, 0)), (60 * 2**30, (9, 0))], utilization={1: 37})
    fake.install(monkeypatch)
    first, second = probe_devices()
    assert (first.index, first.name, first.utilization_percent) == (0, "Fake GPU 0", None)
    assert second.utilization_percent == 37
    assert second.total_bytes == 80 * 2**30
    assert second.memory_occupancy == pytest.approx(0.25)


def test_no_nvidia_means_no_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_nvidia(monkeypatch)
    assert probe_devices() == []
