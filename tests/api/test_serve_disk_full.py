"""``sbproxy serve`` when a pull inside it fills the disk: it stays up, and loads once freed.

A real ``sbproxy serve`` process whose cache (and so journal) is a real 24 MiB tmpfs loads a
deployment whose 12 MiB GGUF comes from a real local HF mirror; while it downloads, the
test takes every free byte. The load fails with ``disk_full``, the server keeps answering,
and after the space is freed a second load resumes the partial (a ``Range`` request from its
length) and serves. :mod:`tests.api.test_host_worker` injects the same journal failure into
the job worker loop, without a mount.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.api.test_serve import PASSWORD, write_config
from tests.model_host.engines.support import free_port
from tests.model_host.runtime.support import write_gguf
from tests.support.hf_server import HfMirror
from tests.support.small_fs import fill, small_filesystem

MIB = 1024 * 1024
REPO = "acme/served-GGUF"
REVISION = "0123456789abcdef0123456789abcdef01234567"
FILE = "tiny.gguf"
WAIT_S = 60


def padded_gguf(root: Path, size: int) -> bytes:
    """A valid GGUF header padded with bytes to ``size`` (readers stop after the header)."""
    path = write_gguf(root / "header.gguf", vocab=50)
    header = path.read_bytes()
    return header + hashlib.shake_256(b"weights").digest(size - len(header))


def hf_catalog(root: Path, data: bytes) -> None:
    """Replace the served catalog's ``tiny`` with ``data`` from ``hf:`` (the mirror)."""
    path = root / "catalog.yaml"
    document: dict[str, Any] = yaml.safe_load(path.read_text())
    (variant,) = document["models"]["tiny"]["variants"]
    variant.update(
        source=f"hf:{REPO}",
        revision=REVISION,
        files=[{"path": FILE, "sha256": hashlib.sha256(data).hexdigest(), "size_bytes": len(data)}],
    )
    path.write_text(yaml.safe_dump(document))


class Served:
    """A running ``sbproxy serve`` and its two listeners; stderr is collected as it comes."""

    def __init__(self, config: Path, *, gateway: int, admin: int, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sbproxy.cli", "serve", "-f", str(config)],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        assert self.process.stderr is not None
        for _ in range(2):
            self.lines.append(self.process.stderr.readline())
        assert "admin listening" in "".join(self.lines), self.lines
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.gateway = f"http://localhost:{gateway}"
        self.admin = f"http://127.0.0.1:{admin}/admin/model-host"

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)

    def status(self) -> dict[str, Any]:
        answer = httpx.get(f"{self.admin}/status", auth=("admin", PASSWORD), timeout=10)
        assert answer.status_code == 200, answer.text
        (deployment,) = answer.json()["deployments"]
        return dict(deployment)

    def load(self) -> None:
        answer = httpx.post(
            f"{self.admin}/load", json={"deployment": "tiny"}, auth=("admin", PASSWORD), timeout=10
        )
        assert answer.status_code == 202, answer.text

    def wait_state(self, *states: str) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT_S
        while True:
            assert self.process.poll() is None, "".join(self.lines)
            status = self.status()
            if status["state"] in states:
                return status
            assert time.monotonic() < deadline, status
            time.sleep(0.1)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=30)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            self._reader.join(timeout=5)
            if self.process.stderr is not None:
                self.process.stderr.close()


def test_serve_stays_up_when_a_pull_fills_the_disk_and_loads_once_space_is_freed(
    tmp_path: Path,
) -> None:
    gateway, admin = free_port(), free_port()
    config = write_config(tmp_path, gateway, admin)
    data = padded_gguf(tmp_path, 12 * MIB)
    hf_catalog(tmp_path, data)
    cache = tmp_path / "cache"
    with (
        HfMirror() as mirror,
        small_filesystem(cache, size_bytes=24 * MIB),
    ):
        mirror.add_file(REPO, REVISION, FILE, data, throttle_bps=4 * MIB)
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "HF_ENDPOINT": mirror.url}
        env = {k: v for k, v in env.items() if k not in ("HF_TOKEN", "SBPROXY_FAULT_POINTS")}
        served = Served(config, gateway=gateway, admin=admin, env=env)
        try:
            served.load()
            deadline = time.monotonic() + WAIT_S
            while not any(p.stat().st_size > 3 * MIB for p in cache.glob("partials/*/*.part")):
                assert time.monotonic() < deadline and served.process.poll() is None
                time.sleep(0.02)
            filler = fill(cache)

            failed = served.wait_state("failed")
            assert failed["reason_code"] == "disk_full", failed
            assert "not enough space on the file system of" in failed["last_error"]
            assert served.process.poll() is None  # still serving
            refused = httpx.post(
                f"{served.gateway}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}]},
                timeout=30,
            )
            assert refused.status_code == 503  # answered, not dropped
            (part,) = cache.glob("partials/*/*.part")
            kept = part.stat().st_size
            assert kept > 2 * MIB

            filler.unlink()
            mirror.clear()
            served.load()
            ready = served.wait_state("ready")
            assert ready["artifact_digest"] == failed["artifact_digest"]
            answer = httpx.post(
                f"{served.gateway}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}]},
                timeout=30,
            )
            assert answer.status_code == 200, answer.text
            gets = [(r.status, r.range_start) for r in mirror.requests if r.method == "GET"]
            assert gets == [(206, kept)]
        finally:
            code = served.stop()
        assert code == 0, "".join(served.lines)
        assert "Traceback" not in "".join(served.lines)
