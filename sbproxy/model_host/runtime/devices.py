"""Device probe: describe the worker this host would run a model on.

The worker is the NVIDIA GPU with the most free memory, found through NVML (``pynvml``,
from the ``nvidia-ml-py`` package). Without NVIDIA devices -- no driver, no library, no GPU
-- the worker is the CPU, budgeted at a fraction of total RAM (0.7 by default; the
environment variable ``SBPROXY_CPU_MEMORY_FRACTION`` overrides it, capped at 0.95). The
defaults follow the reference probes (``MH/src/probe_nvidia.rs``, ``MH/src/probe_cpu.rs``).
Apple Metal and AMD devices are not probed yet; such hosts are described as CPU workers.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import psutil
import pynvml

from sbproxy.catalog import Accelerator, WorkerProfile
from sbproxy.errors import SbproxyError

__all__ = [
    "CPU_MEMORY_FRACTION_ENV",
    "DEFAULT_CPU_MEMORY_FRACTION",
    "MAX_CPU_MEMORY_FRACTION",
    "PROBED_ACCELERATORS",
    "DeviceInfo",
    "HostDevice",
    "HostDevices",
    "cpu_memory_fraction",
    "host_devices",
    "probe_devices",
    "probe_host",
    "probe_worker",
]

T = TypeVar("T")

logger = logging.getLogger(__name__)

CPU_MEMORY_FRACTION_ENV = "SBPROXY_CPU_MEMORY_FRACTION"
"""Environment variable overriding the share of RAM a CPU worker offers to models."""
DEFAULT_CPU_MEMORY_FRACTION = 0.7
"""Share of total RAM a CPU worker offers to models unless overridden."""
MAX_CPU_MEMORY_FRACTION = 0.95
"""Larger overrides are capped here, leaving room for the OS and the host itself."""
PROBED_ACCELERATORS: tuple[Accelerator, ...] = (Accelerator.CPU, Accelerator.CUDA)
"""The accelerators this probe can describe a worker as (NVML finds CUDA, else CPU); Apple
Metal and AMD hosts are described as CPU workers (module doc). The capability matrix
(``sbproxy capabilities``) has one column per entry."""

# NVML errors that only mean "this machine has no usable NVIDIA stack".
_NO_NVIDIA_ERRORS: tuple[type[Exception], ...] = (
    pynvml.NVMLError_LibraryNotFound,
    pynvml.NVMLError_DriverNotLoaded,
    pynvml.NVMLError_NotSupported,
)


def probe_worker(environ: Mapping[str, str] | None = None) -> WorkerProfile:
    """Describe this host as a worker for artifact resolution.

    Args:
        environ: Environment to read ``SBPROXY_CPU_MEMORY_FRACTION`` from; defaults to
            ``os.environ``.

    Returns:
        A ``cuda`` profile (free memory in bytes of the GPU with the most free memory, and
        its compute capability) when NVML reports a device; otherwise a ``cpu`` profile whose
        ``memory_bytes`` is total RAM times :func:`cpu_memory_fraction`.

    Raises:
        SbproxyError: code ``invalid_environment`` if ``SBPROXY_CPU_MEMORY_FRACTION`` is not a
            number above 0; code ``device_probe_failed`` if NVML is present but fails in a
            way other than "no driver/library", since guessing CPU there could pick the wrong
            artifact.
    """
    return _worker_of(probe_devices(), environ)


def probe_host(
    cpu_devices: int = 1, environ: Mapping[str, str] | None = None
) -> tuple[WorkerProfile, HostDevices]:
    """Probe the GPUs once: this host's worker profile (:func:`probe_worker`) and device
    table (:func:`host_devices`, with ``cpu_devices`` shares on a CPU host).

    Raises:
        SbproxyError: as :func:`probe_worker`.
    """
    gpus = probe_devices()
    worker = _worker_of(gpus, environ)
    return worker, host_devices(worker, gpus, cpu_devices)


def _worker_of(gpus: Sequence[DeviceInfo], environ: Mapping[str, str] | None) -> WorkerProfile:
    """The worker: the GPU with the most free memory, else the CPU budget."""
    if gpus:
        best = max(gpus, key=lambda d: (d.free_bytes, -d.index))
        return WorkerProfile(
            accelerator=Accelerator.CUDA,
            memory_bytes=best.free_bytes,
            compute_capability=best.compute_capability,
        )
    fraction = cpu_memory_fraction(os.environ if environ is None else environ)
    total = psutil.virtual_memory().total
    return WorkerProfile(accelerator=Accelerator.CPU, memory_bytes=int(total * fraction))


def cpu_memory_fraction(environ: Mapping[str, str]) -> float:
    """Share of RAM a CPU worker offers: the env override capped at 0.95, else 0.7.

    Raises:
        SbproxyError: code ``invalid_environment`` if the override is not a finite number
            greater than 0.
    """
    raw = environ.get(CPU_MEMORY_FRACTION_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_CPU_MEMORY_FRACTION
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise SbproxyError(
            f"{CPU_MEMORY_FRACTION_ENV}={raw!r} is not a valid memory fraction; use a number "
            f"above 0 and at most {MAX_CPU_MEMORY_FRACTION} (e.g. 0.5), or unset it for "
            f"the default {DEFAULT_CPU_MEMORY_FRACTION}.",
            code="invalid_environment",
            details={"variable": CPU_MEMORY_FRACTION_ENV},
        )
    if value > MAX_CPU_MEMORY_FRACTION:
        logger.warning(
            "%s=%s is above %s; using %s",
            CPU_MEMORY_FRACTION_ENV,
            raw,
            MAX_CPU_MEMORY_FRACTION,
            MAX_CPU_MEMORY_FRACTION,
        )
        return MAX_CPU_MEMORY_FRACTION
    return value


@dataclass(frozen=True)
class DeviceInfo:
    """One accelerator as NVML reports it.

    ``utilization_percent`` (compute activity) is ``None`` when the driver does not report
    it -- unknown stays absent, never 0 -- and is a different measure from
    ``memory_occupancy`` (used / total memory).
    """

    index: int
    name: str | None
    total_bytes: int
    free_bytes: int
    compute_capability: tuple[int, int] | None
    utilization_percent: int | None

    @property
    def memory_occupancy(self) -> float:
        """Used memory as a fraction of total, in [0, 1]."""
        return 0.0 if self.total_bytes <= 0 else 1 - self.free_bytes / self.total_bytes


def probe_devices() -> list[DeviceInfo]:
    """Every NVIDIA device (empty without an NVIDIA driver or library).

    Raises:
        SbproxyError: ``device_probe_failed`` when NVML is present but fails otherwise.
    """
    try:
        pynvml.nvmlInit()
    except _NO_NVIDIA_ERRORS as exc:
        logger.debug("no NVIDIA devices: %s", exc)
        return []
    except pynvml.NVMLError as exc:
        raise _probe_failed(exc) from exc
    try:
        devices = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            devices.append(
                DeviceInfo(
                    index=index,
                    name=_optional(_name, handle),
                    total_bytes=int(memory.total),
                    free_bytes=int(memory.free),
                    compute_capability=_compute_capability(handle),
                    utilization_percent=_optional(_utilization, handle),
                )
            )
        return devices
    except pynvml.NVMLError as exc:
        raise _probe_failed(exc) from exc
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            logger.debug("nvmlShutdown failed: %s", exc)


def _name(handle: object) -> str:
    return str(pynvml.nvmlDeviceGetName(handle))


def _utilization(handle: object) -> int:
    return int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)


def _optional(read: Callable[[object], T], handle: object) -> T | None:
    """A reading the driver may not support: ``None`` instead of a made-up value."""
    try:
        return read(handle)
    except pynvml.NVMLError as exc:
        logger.debug("NVML reading unavailable: %s", exc)
        return None


def _compute_capability(handle: object) -> tuple[int, int] | None:
    # Unknown is a valid answer: resolution then refuses variants that set a minimum.
    try:
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
    except pynvml.NVMLError as exc:
        logger.debug("compute capability unavailable: %s", exc)
        return None
    return (int(major), int(minor))


def _probe_failed(exc: Exception) -> SbproxyError:
    return SbproxyError(
        f"the NVIDIA device probe failed: {exc}",
        code="device_probe_failed",
        remediation="Check the NVIDIA driver (nvidia-smi) or unload it to run on CPU.",
    )


@dataclass(frozen=True)
class HostDevice:
    """One device engines of this host run on.

    Attributes:
        index: Device index (the CUDA ordinal on a GPU host; 0..n-1 on a CPU host).
        capacity_bytes: Bytes the runtime reserves generations against (a GPU's free
            memory at the probe; a CPU host's share of the CPU memory budget).
        total_bytes: The device's whole memory (a GPU's total; the share on a CPU host).
        compute_capability: CUDA compute capability (major, minor); ``None`` on CPU or when
            unknown.
    """

    index: int
    capacity_bytes: int
    total_bytes: int
    compute_capability: tuple[int, int] | None = None


@dataclass(frozen=True)
class HostDevices:
    """The devices of one host, as the runtime admits and launches engines on them.

    Attributes:
        accelerator: ``cuda``, ``metal`` or ``cpu`` -- what every engine launch asks for.
        devices: One entry per device, by ascending index (never empty).
    """

    accelerator: Accelerator
    devices: tuple[HostDevice, ...]

    def capacities(self) -> dict[int, int]:
        """Bytes each device offers, by index (what residency reserves against)."""
        return {device.index: device.capacity_bytes for device in self.devices}

    def get(self, index: int) -> HostDevice | None:
        """The device ``index``, or ``None`` when this host has none by that index."""
        return next((device for device in self.devices if device.index == index), None)

    def indexes(self) -> tuple[int, ...]:
        """Every device index, ascending."""
        return tuple(device.index for device in self.devices)


def host_devices(
    worker: WorkerProfile, gpus: Sequence[DeviceInfo], cpu_devices: int = 1
) -> HostDevices:
    """The device table of a host from its worker profile and probed GPUs (pure).

    A CUDA worker gets one device per probed GPU: capacity its free bytes at the probe,
    total its total bytes. A CPU worker gets ``cpu_devices`` devices indexed
    ``0..n-1``, each with ``worker.memory_bytes // n`` -- the budget split evenly, so that
    ``n`` engines run side by side. A Metal worker, or a CUDA worker without probed GPUs,
    gets one device 0 of ``worker.memory_bytes``.

    Raises:
        ValueError: ``cpu_devices`` is below 1.
    """
    if cpu_devices < 1:
        raise ValueError(f"cpu_devices must be >= 1, got {cpu_devices}")
    if worker.accelerator is Accelerator.CUDA and gpus:
        table = tuple(
            HostDevice(
                index=gpu.index,
                capacity_bytes=gpu.free_bytes,
                total_bytes=gpu.total_bytes,
                compute_capability=gpu.compute_capability,
            )
            for gpu in sorted(gpus, key=lambda gpu: gpu.index)
        )
        return HostDevices(accelerator=Accelerator.CUDA, devices=table)
    count = cpu_devices if worker.accelerator is Accelerator.CPU else 1
    share = worker.memory_bytes // count
    table = tuple(
        HostDevice(
            index=index,
            capacity_bytes=share,
            total_bytes=share,
            compute_capability=worker.compute_capability,
        )
        for index in range(count)
    )
    return HostDevices(accelerator=worker.accelerator, devices=table)
