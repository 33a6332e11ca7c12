"""Prometheus metrics of the model host, read from the runtime manager at scrape time.

Names and labels follow reference section 9:

* ``sbproxy_model_host_active_requests{deployment}`` and ``_queued_requests{deployment}``
  (gauges, from the admission gates);
* ``sbproxy_model_host_deployment_state{deployment,engine,state}`` (one-hot gauge: 1 for
  the current state, 0 for every other state);
* ``sbproxy_model_host_admission_rejections_total{deployment,priority,reason}`` (counter,
  counted by the gateway where it meets a refusal);
* ``sbproxy_model_host_resident_models`` (gauge: deployments with a ready engine);
* GPU gauges ``sbproxy_model_host_gpu_vram_bytes{device,kind}`` (``total``/``free``),
  ``_gpu_memory_occupancy{device}`` (used/total) and ``_gpu_utilization{device}`` (compute
  activity, 0..1) -- only for devices NVML reports; utilization is absent when the driver
  does not report it, never zero, and is never derived from memory occupancy.

Each app gets its own :class:`~prometheus_client.CollectorRegistry`, so several apps (tests)
never collide in the process-global registry.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sbproxy.errors import SbproxyError
from sbproxy.model_host.runtime import DeviceInfo, probe_devices
from sbproxy.model_host.runtime.manager import RuntimeManager
from sbproxy.model_host.runtime.state import DeploymentState

__all__ = ["Rejections", "build_registry"]

logger = logging.getLogger(__name__)

PREFIX = "sbproxy_model_host"


class Rejections:
    """Admission refusals seen by the gateway, by (deployment, priority, reason)."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str, str]] = Counter()

    def record(self, *, deployment: str, priority: str, reason: str) -> None:
        """Count one refusal."""
        self.counts[(deployment, priority, reason)] += 1


class _HostCollector(Collector):
    def __init__(
        self,
        manager: RuntimeManager,
        rejections: Rejections,
        devices: Callable[[], Sequence[DeviceInfo]],
    ) -> None:
        self.manager = manager
        self.rejections = rejections
        self.devices = devices

    def collect(self) -> Iterator[Metric]:
        active = GaugeMetricFamily(
            f"{PREFIX}_active_requests",
            "Requests holding an admission permit.",
            labels=["deployment"],
        )
        queued = GaugeMetricFamily(
            f"{PREFIX}_queued_requests", "Requests waiting for admission.", labels=["deployment"]
        )
        state = GaugeMetricFamily(
            f"{PREFIX}_deployment_state",
            "Lifecycle state of each deployment (one-hot).",
            labels=["deployment", "engine", "state"],
        )
        resident = 0
        for status in self.manager.status():
            active.add_metric([status.deployment], status.active_requests)
            queued.add_metric([status.deployment], status.queued_requests)
            engine = status.engine or str(self.manager.slot(status.deployment).config.engine)
            for candidate in DeploymentState:
                state.add_metric(
                    [status.deployment, engine, candidate.value],
                    1.0 if candidate == status.state else 0.0,
                )
            resident += status.state == DeploymentState.READY
        yield active
        yield queued
        yield state
        yield GaugeMetricFamily(
            f"{PREFIX}_resident_models", "Deployments with a ready engine.", value=resident
        )
        rejected = CounterMetricFamily(
            f"{PREFIX}_admission_rejections",
            "Requests refused admission, by reason.",
            labels=["deployment", "priority", "reason"],
        )
        for (deployment, priority, reason), count in sorted(self.rejections.counts.items()):
            rejected.add_metric([deployment, priority, reason], count)
        yield rejected
        yield from self._gpus()

    def _gpus(self) -> Iterator[Metric]:
        try:
            devices = list(self.devices())
        except SbproxyError as exc:
            logger.warning("GPU probe failed: %s", exc)
            return
        if not devices:
            return
        vram = GaugeMetricFamily(
            f"{PREFIX}_gpu_vram_bytes", "GPU memory in bytes.", labels=["device", "kind"]
        )
        occupancy = GaugeMetricFamily(
            f"{PREFIX}_gpu_memory_occupancy",
            "Used GPU memory as a fraction of total (not compute activity).",
            labels=["device"],
        )
        utilization = GaugeMetricFamily(
            f"{PREFIX}_gpu_utilization",
            "GPU compute utilization, 0..1, as the driver reports it.",
            labels=["device"],
        )
        reported = False
        for device in devices:
            index = str(device.index)
            vram.add_metric([index, "total"], device.total_bytes)
            vram.add_metric([index, "free"], device.free_bytes)
            occupancy.add_metric([index], device.memory_occupancy)
            if device.utilization_percent is not None:
                utilization.add_metric([index], device.utilization_percent / 100)
                reported = True
        yield vram
        yield occupancy
        if reported:
            yield utilization


def build_registry(
    manager: RuntimeManager,
    rejections: Rejections,
    *,
    devices: Callable[[], Sequence[DeviceInfo]] = probe_devices,
) -> CollectorRegistry:
    """A registry whose only collector reads ``manager`` (and NVML) at each scrape."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_HostCollector(manager, rejections, devices))
    return registry
