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
from collections.abc import Callable, Mapping
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
    "DeviceInfo",
    "cpu_memory_fraction",
    "probe_devices",
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
    gpu = _probe_nvidia()
    if gpu is not None:
        return gpu
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


def _probe_nvidia() -> WorkerProfile | None:
    """The NVIDIA device with the most free memory, or ``None`` when there is none."""
    devices = probe_devices()
    if not devices:
        return None
    best = max(devices, key=lambda d: (d.free_bytes, -d.index))
    return WorkerProfile(
        accelerator=Accelerator.CUDA,
        memory_bytes=best.free_bytes,
        compute_capability=best.compute_capability,
    )


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
