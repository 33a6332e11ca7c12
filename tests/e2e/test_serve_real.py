"""`sbproxy serve` end to end on real input: the real Gemma GGUF pulled through a local
HF-compatible mirror (HF_ENDPOINT, Range support), the real llama-server, chat completions;
then SIGKILL of the server mid-pull, mid-warm and mid-stream, and a restart that finishes
the jobs under their original ids with nothing half-published and no orphan engine."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from sbproxy.workflows import process_start_ticks
from tests.e2e.conftest import E2E_TIMEOUT_S
from tests.model_host.engines.support import free_port
from tests.support.hf_server import HfMirror
from tests.support.real_inputs import GGUF_NAME, GGUF_SHA256, GGUF_SIZE, RealInputs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(E2E_TIMEOUT_S)]

REPO = "mirror/gemma-3-270m-GGUF"
REVISION = "0123456789abcdef0123456789abcdef01234567"
PASSWORD = "e2e-admin-password-0123456789"


@dataclass
class Site:
    root: Path
    config: Path
    gateway: int
    admin: int
    env: dict[str, str]

    @property
    def journal(self) -> Path:
        return self.root / "cache" / "jobs" / "journal.db"

    def status(self) -> dict[str, Any]:
        response = httpx.get(
            f"http://127.0.0.1:{self.admin}/admin/model-host/status",
            auth=("admin", PASSWORD),
            timeout=5,
        )
        response.raise_for_status()
        body: dict[str, Any] = response.json()["deployments"][0]
        return body

    def jobs(self) -> dict[str, tuple[str, str]]:
        """The pull and load jobs by kind: ``(id, status)`` ({} while the journal is created)."""
        query = "SELECT id, kind, status FROM jobs WHERE kind IN ('pull', 'load') ORDER BY id"
        if not self.journal.exists():  # connecting would create the file
            return {}
        try:
            with sqlite3.connect(self.journal) as raw:
                return {kind: (job_id, status) for job_id, kind, status in raw.execute(query)}
        except sqlite3.OperationalError:
            return {}


def write_site(root: Path, llama_server: Path, endpoint: str) -> Site:
    catalog = {
        "schema_version": 2,
        "catalog_revision": "e2e-mirror-1",
        "models": {
            "gemma-3-270m": {
                "params": "270M",
                "license": "gemma",
                "family": "gemma3",
                "context_length": 32768,
                "variants": [
                    {
                        "id": "q4_k_m",
                        "format": "gguf",
                        "quant": "Q4_K_M",
                        "engines": ["llama_cpp"],
                        "source": f"hf:{REPO}",
                        "revision": REVISION,
                        "files": [
                            {"path": GGUF_NAME, "sha256": GGUF_SHA256, "size_bytes": GGUF_SIZE}
                        ],
                        "requirements": {
                            "accelerators": ["cpu", "metal", "cuda"],
                            "min_memory_bytes": 1,
                        },
                        "stability": "preview",
                        "certification": "e2e",
                    }
                ],
            }
        },
    }
    (root / "catalog.yaml").write_text(yaml.safe_dump(catalog))
    gateway, admin = free_port(), free_port()
    document = {
        "proxy": {
            "http_bind_port": gateway,
            "admin": {"enabled": True, "port": admin, "password": PASSWORD},
            "model_host": {
                "catalog_file": str(root / "catalog.yaml"),
                "shutdown_deadline_ms": 5000,
                "cache": {"directory": str(root / "cache")},
                "engines": {"llama_cpp": {"path": str(llama_server)}},
                "deployments": {
                    "gemma": {
                        "model": "gemma-3-270m",
                        "variant": "q4_k_m",
                        "pull": "on_boot",
                        "warm": True,
                        "max_context": 2048,
                        "max_concurrency": 2,
                    }
                },
            },
        },
        "origins": {
            "localhost": {
                "action": {
                    "type": "ai_proxy",
                    "providers": [
                        {
                            "name": "local",
                            "provider_type": "managed_model",
                            "deployment": "gemma",
                            "models": ["gemma"],
                            "default_model": "gemma",
                        }
                    ],
                }
            }
        },
    }
    config = root / "sb.yml"
    config.write_text(yaml.safe_dump(document))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBPROXY_FAULT", "HF_"))}
    env["HF_ENDPOINT"] = endpoint
    return Site(root=root, config=config, gateway=gateway, admin=admin, env=env)


@pytest.fixture
def mirror(real_inputs: RealInputs) -> Iterator[HfMirror]:
    with HfMirror() as server:
        server.add_file(REPO, REVISION, GGUF_NAME, real_inputs.gguf)
        yield server


def serve(site: Site, *, fault: str | None = None) -> subprocess.Popen[str]:
    env = dict(site.env)
    if fault:
        env["SBPROXY_FAULT_POINTS"] = fault
    return subprocess.Popen(
        [sys.executable, "-m", "sbproxy.cli", "serve", "-f", str(site.config)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_ready(
    site: Site, process: subprocess.Popen[str], timeout_s: float = 180
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        try:
            status = site.status()
            if status["state"] == "ready":
                return status
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the deployment never became ready")


def chat(site: Site) -> str:
    """One completion (Gemma 3 270M is a base model: it completes text, it does not chat)."""
    client = openai.OpenAI(base_url=f"http://localhost:{site.gateway}/v1", api_key="unused")
    reply = client.completions.create(
        model="gemma", prompt="The capital of France is", max_tokens=12
    )
    assert reply.model == "gemma"
    content = reply.choices[0].text or ""
    assert content.strip()
    return content


def stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    process.communicate(timeout=60)


def assert_clean(site: Site) -> None:
    snapshots = site.root / "cache" / "snapshots"
    assert not [p for p in snapshots.iterdir() if p.name.startswith(".")]
    for snapshot in snapshots.iterdir():
        assert (site.root / "cache" / "metadata" / f"{snapshot.name}.json").exists()


def test_pull_through_a_mirror_then_serve_chat_and_watch(
    tmp_path: Path, llama_server: Path, mirror: HfMirror
) -> None:
    mirror.entry(REPO, REVISION, GGUF_NAME).throttle_bps = 96 * 1024 * 1024
    site = write_site(tmp_path, llama_server, mirror.url)
    process = serve(site)
    try:
        deadline = time.monotonic() + 60
        while "pull" not in site.jobs():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        pull_id = site.jobs()["pull"][0]
        watch = subprocess.run(
            [sys.executable, "-m", "sbproxy.cli", "jobs", "watch", pull_id, "--cache-dir",
             str(site.root / "cache"), "--format", "json"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert watch.returncode == 0, watch.stderr
        assert json.loads(watch.stdout)["job"]["status"] == "succeeded"
        assert "MiB" in watch.stderr
        wait_ready(site, process)
        assert chat(site)
        gets = [r for r in mirror.requests if r.method == "GET"]
        assert gets and gets[0].status == 200
        assert mirror.bytes_served() == GGUF_SIZE
    finally:
        stop(process)
    assert process.returncode == 0
    assert_clean(site)


def kill_when(process: subprocess.Popen[str], predicate: Any, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        assert time.monotonic() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=30)


def engine_pids(site: Site) -> list[int]:
    owned = site.root / "cache" / "engines" / "owned"
    return [int(p.name.split("-")[0]) for p in owned.glob("*.json")] if owned.is_dir() else []


@pytest.mark.parametrize("moment", ["mid-pull", "mid-warm", "mid-stream"])
def test_killed_server_finishes_its_jobs_after_restart(
    tmp_path: Path, llama_server: Path, mirror: HfMirror, moment: str
) -> None:
    site = write_site(tmp_path, llama_server, mirror.url)
    if moment == "mid-pull":
        mirror.entry(REPO, REVISION, GGUF_NAME).throttle_bps = 32 * 1024 * 1024
        process = serve(site)

        def pulling() -> bool:
            if not site.journal.exists():
                return False
            try:
                with sqlite3.connect(site.journal) as raw:
                    row = raw.execute(
                        "SELECT progress_json FROM jobs WHERE kind = 'pull' AND status = 'running'"
                    ).fetchone()
            except sqlite3.OperationalError:  # the journal is still being created
                return False
            return bool(row and row[0] and json.loads(row[0]).get("done", 0) > 0)

        kill_when(process, pulling)
    elif moment == "mid-warm":
        process = serve(site, fault="engine.spawned")
        process.communicate(timeout=180)
        assert process.returncode == -signal.SIGKILL
    else:
        process = serve(site)
        wait_ready(site, process)
        with httpx.stream(
            "POST",
            f"http://localhost:{site.gateway}/v1/completions",
            json={"model": "gemma", "stream": True, "max_tokens": 200,
                  "prompt": "One, two, three, four,"},
            timeout=60,
        ) as response:  # fmt: skip
            chunks = response.iter_lines()
            assert any(line.startswith("data:") for line in [next(chunks), next(chunks)])
            process.send_signal(signal.SIGKILL)
            process.communicate(timeout=30)
    before = site.jobs()
    orphans = engine_pids(site)

    restarted = serve(site)
    try:
        status = wait_ready(site, restarted)
        assert chat(site)
        after = site.jobs()
        if moment != "mid-stream":
            assert after["load"] == (before["load"][0], "succeeded")  # the original job id
            assert after["pull"] == (before["pull"][0], "succeeded")
        assert status["job_id"] == after["load"][0]
        for pid in orphans:
            assert process_start_ticks(pid) is None or pid == status.get("pid")
    finally:
        stop(restarted)
    assert_clean(site)
    assert mirror.bytes_served() < 2 * GGUF_SIZE
    if moment == "mid-pull":
        ranges = [r.range_start for r in mirror.requests if r.method == "GET" and r.range_start]
        assert ranges and ranges[-1] > 0  # the restart resumed the partial
