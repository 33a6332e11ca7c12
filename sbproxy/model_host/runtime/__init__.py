"""Runtime of the model host: live engine state, admission and the device probe."""

from __future__ import annotations

from sbproxy.model_host.runtime.devices import cpu_memory_fraction, probe_worker

__all__ = ["cpu_memory_fraction", "probe_worker"]
