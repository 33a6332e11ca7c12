"""Real ``sbproxy serve`` hosts on one PostgreSQL journal, for the several-hosts tests.

Each :class:`PgHost` is its own node (``SBPROXY_NODE_ID``), cache, ports and ``sb.yml``; its
deployment ``tiny`` pulls on boot from an HF-shaped mirror (:class:`HfMirror`) and loads warm
on the stand-in llama-server. :func:`journal_rows` reads what the journal recorded.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
import yaml

from tests.model_host.engines.support import fake_llama_server, free_port
from tests.model_host.runtime.support import write_gguf
from tests.support.cli import stop_process

PASSWORD = "pg-hosts-admin-password"
REPO = "mirror/tiny-GGUF"
REVISION = "0123456789abcdef0123456789abcdef01234567"
IMP_REPO = "mirror/imp-GGUF"
FILE = "tiny.gguf"
TERMINAL = ("succeeded", "failed", "cancelled")


def tiny_gguf(root: Path, *, vocab: int) -> bytes:
    """A small valid GGUF's bytes (written under ``root``)."""
    root.mkdir(parents=True, exist_ok=True)
    return write_gguf(root / f"tiny-{vocab}.gguf", vocab=vocab).read_bytes()


def catalog(path: Path, pulled: bytes, imported: bytes) -> None:
    """``tiny`` (``hf:`` REPO) and ``tiny-imp`` (``hf:`` IMP_REPO, or ``models import``)."""

    def variant(data: bytes, source: str) -> dict[str, Any]:
        return {
            "id": "q4_k_m",
            "format": "gguf",
            "quant": "Q4_K_M",
            "engines": ["llama_cpp"],
            "source": source,
            "revision": REVISION,
            "files": [
                {"path": FILE, "sha256": hashlib.sha256(data).hexdigest(), "size_bytes": len(data)}
            ],
            "requirements": {"accelerators": ["cpu"], "min_memory_bytes": 1},
            "stability": "preview",
            "certification": "test",
        }

    model = {"params": "1M", "license": "apache-2.0", "family": "test", "context_length": 4096}
    document = {
        "schema_version": 2,
        "catalog_revision": "pg-hosts-1",
        "models": {
            "tiny": {**model, "variants": [variant(pulled, f"hf:{REPO}")]},
            "tiny-imp": {**model, "variants": [variant(imported, f"hf:{IMP_REPO}")]},
        },
    }
    path.write_text(yaml.safe_dump(document))


@dataclass
class PgHost:
    """One ``sbproxy serve`` process of node ``node`` (not started until :meth:`start`)."""

    node: str
    root: Path
    url: str
    mirror_url: str
    gateway: int = field(default_factory=free_port)
    admin: int = field(default_factory=free_port)
    process: subprocess.Popen[str] | None = None
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.executable = fake_llama_server(self.root / "bin")
        self.write({"tiny": self.deployment("tiny")})

    @property
    def config(self) -> Path:
        return self.root / "sb.yml"

    @property
    def log(self) -> Path:
        """Where its stderr goes (every run of it, appended)."""
        return self.root / "serve.log"

    @property
    def output(self) -> str:
        """Its stderr so far (read while it runs, too)."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    @staticmethod
    def deployment(model: str, *, warm: bool = True) -> dict[str, Any]:
        pull = "on_boot" if warm else "on_demand"
        return {"model": model, "variant": "q4_k_m", "pull": pull, "warm": warm}

    def write(self, deployments: dict[str, dict[str, Any]]) -> None:
        """(Re)write ``sb.yml`` serving ``deployments``; the gateway routes ``tiny``."""
        self.config.write_text(yaml.safe_dump(self.document(deployments)))

    def document(self, deployments: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """The ``sb.yml`` of :meth:`write` (a subclass adds its own keys)."""
        return {
            "proxy": {
                "http_bind_port": self.gateway,
                "admin": {"enabled": True, "port": self.admin, "password": PASSWORD},
                "model_host": {
                    "catalog_file": str(self.root.parent / "catalog.yaml"),
                    "shutdown_deadline_ms": 2000,
                    "cache": {"directory": str(self.cache)},
                    "engines": {"llama_cpp": {"path": str(self.executable)}},
                    "journal": {"url": self.url},
                    "deployments": deployments,
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
                                "deployment": "tiny",
                                "models": ["tiny-chat"],
                                "default_model": "tiny-chat",
                            }
                        ],
                    }
                }
            },
        }

    @property
    def env(self) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("SBPROXY_FAULT", "HF_"))}
        return {
            **base,
            "PYTHONWARNINGS": "ignore",
            "SBPROXY_NODE_ID": self.node,
            "HF_ENDPOINT": self.mirror_url,
            **self.extra_env,
        }

    def start(self, *, fault: str | None = None) -> subprocess.Popen[str]:
        env = self.env
        if fault:
            env["SBPROXY_FAULT_POINTS"] = fault
        with self.log.open("a") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "sbproxy.cli", "serve", "-f", str(self.config)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log,
                text=True,
            )
        return self.process

    def admin_call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.request(
            method,
            f"http://127.0.0.1:{self.admin}{path}",
            auth=("admin", PASSWORD),
            timeout=30,
            **kwargs,
        )

    def states(self) -> dict[str, str]:
        """Deployment states from the live status route ({} while it does not answer)."""
        try:
            response = self.admin_call("GET", "/admin/model-host/status")
        except httpx.HTTPError:
            return {}
        if response.status_code != 200:
            return {}
        return {row["deployment"]: row["state"] for row in response.json()["deployments"]}

    def chat(self) -> httpx.Response:
        return httpx.post(
            f"http://localhost:{self.gateway}/v1/chat/completions",
            json={"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_ready(self, deployment: str, *, timeout_s: float = 90, fail_fast: bool = True) -> None:
        """Poll the status route until ``deployment`` is ready; fail at once, with the status
        row and the host's stderr, when it fails or the host exits."""
        deadline = time.monotonic() + timeout_s
        while (state := self.states().get(deployment)) != "ready":
            failed = fail_fast and state == "failed"
            if failed or not self.alive() or time.monotonic() > deadline:
                try:
                    row = self.admin_call("GET", "/admin/model-host/status").text
                except httpx.HTTPError as exc:
                    row = repr(exc)
                self.stop()
                raise AssertionError(
                    f"{self.node}: {deployment} is {state}, not ready\n{row}\n{self.output}"
                )
            time.sleep(0.05)

    def stop(self) -> int | None:
        """SIGTERM and wait (SIGKILL if it does not stop); its exit status."""
        return None if self.process is None else stop_process(self.process)


def poll(predicate: Callable[[], bool], *, timeout_s: float, what: str) -> None:
    """Return once ``predicate()`` holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.05)


def query(url: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as connection:
        return list(connection.execute(sql, params or None).fetchall())


def journal_rows(url: str) -> dict[str, Any]:
    """Jobs, running-claims per job, and duplicate step rows/results, as the journal has them."""
    jobs = query(url, "SELECT id, node, kind, status, attempt FROM jobs ORDER BY created_at_ms")
    claims = dict(
        query(
            url,
            "SELECT job_id, COUNT(*) FROM job_events WHERE type = 'status'"
            " AND data_json::jsonb ->> 'status' = 'running' GROUP BY job_id",
        )
    )
    steps = query(url, "SELECT COUNT(*), COUNT(DISTINCT (job_id, seq)) FROM steps")[0]
    results = query(
        url,
        "SELECT job_id, data_json::jsonb ->> 'name', COUNT(*) FROM job_events"
        " WHERE type = 'step' AND data_json::jsonb ->> 'status' = 'succeeded'"
        " GROUP BY job_id, data_json::jsonb ->> 'seq', 2 HAVING COUNT(*) > 1",
    )
    return {"jobs": jobs, "claims": claims, "steps": steps, "duplicate_results": results}
