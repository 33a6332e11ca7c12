"""A host probes its devices only once the engines a crashed run of it left behind are gone:
they still hold device memory, and the probe measures what each GPU has free -- the
runtime's budget per device for the host's whole run. A real orphan process with a real
ownership record of a dead owner; the probe itself is replaced to see what it would see."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from sbproxy.api import host as host_module
from sbproxy.catalog import Accelerator, WorkerProfile
from sbproxy.model_host.artifacts import CacheLayout
from sbproxy.model_host.runtime import HostDevices, host_devices
from sbproxy.workflows import process_start_ticks
from tests.model_host.engines.test_process import dead_owner, write_record


def test_an_orphan_engine_is_gone_before_the_device_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = CacheLayout(tmp_path / "cache")
    orphan = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        ticks = process_start_ticks(orphan.pid)
        assert ticks is not None
        write_record(layout.owned_engines, pid=orphan.pid, ticks=ticks, owner=dead_owner())
        seen: list[int | None] = []
        worker = WorkerProfile(accelerator=Accelerator.CPU, memory_bytes=1 << 30)

        def probe(cpu_devices: int = 1) -> tuple[WorkerProfile, HostDevices]:
            seen.append(orphan.poll())  # None while the orphan still runs
            return worker, host_devices(worker, (), cpu_devices)

        monkeypatch.setattr(host_module, "probe_host", probe)
        found, devices = host_module._probe(layout, 2)
        assert seen and seen[0] is not None  # the orphan had exited when the probe ran
        assert found == worker and devices.indexes() == (0, 1)
    finally:
        orphan.kill()
        orphan.wait()
