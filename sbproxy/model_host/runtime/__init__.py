"""Runtime of the model host: live engine state, admission and the device probe."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sbproxy._lazy_exports import lazy_exports

# Each part loads when first used: probing the worker (`sbproxy models list`) needs psutil and
# NVML, not the admission gate, the residency planner or the GGUF reader.
_LAZY = {
    "sbproxy.model_host.runtime.admission": (
        "AdmissionGate",
        "AdmissionReason",
        "AdmissionRejected",
        "DrainReport",
        "Permit",
        "keep_alive_expired",
        "reject",
    ),
    "sbproxy.model_host.runtime.devices": (
        "DeviceInfo",
        "HostDevice",
        "HostDevices",
        "cpu_memory_fraction",
        "host_devices",
        "probe_devices",
        "probe_host",
        "probe_worker",
    ),
    "sbproxy.model_host.runtime.memory": (
        "GgufError",
        "GgufFacts",
        "MemoryEstimate",
        "estimate_memory",
        "read_gguf_header",
    ),
    "sbproxy.model_host.runtime.residency": (
        "EvictionPlan",
        "EvictionPolicy",
        "Reservation",
        "ReservationRequest",
        "Residency",
        "ResidencyKey",
    ),
}
if TYPE_CHECKING:
    from sbproxy.model_host.runtime.admission import (
        AdmissionGate,
        AdmissionReason,
        AdmissionRejected,
        DrainReport,
        Permit,
        keep_alive_expired,
        reject,
    )
    from sbproxy.model_host.runtime.devices import (
        DeviceInfo,
        HostDevice,
        HostDevices,
        cpu_memory_fraction,
        host_devices,
        probe_devices,
        probe_host,
        probe_worker,
    )
    from sbproxy.model_host.runtime.memory import (
        GgufError,
        GgufFacts,
        MemoryEstimate,
        estimate_memory,
        read_gguf_header,
    )
    from sbproxy.model_host.runtime.residency import (
        EvictionPlan,
        EvictionPolicy,
        Reservation,
        ReservationRequest,
        Residency,
        ResidencyKey,
    )
else:
    __getattr__ = lazy_exports(__name__, _LAZY)

__all__ = [
    "AdmissionGate",
    "AdmissionReason",
    "AdmissionRejected",
    "DeviceInfo",
    "DrainReport",
    "EvictionPlan",
    "EvictionPolicy",
    "GgufError",
    "GgufFacts",
    "HostDevice",
    "HostDevices",
    "MemoryEstimate",
    "Permit",
    "Reservation",
    "ReservationRequest",
    "Residency",
    "ResidencyKey",
    "cpu_memory_fraction",
    "estimate_memory",
    "host_devices",
    "keep_alive_expired",
    "probe_devices",
    "probe_host",
    "probe_worker",
    "read_gguf_header",
    "reject",
]
