"""Two ``sbproxy serve`` processes (separate caches, node ids) on one PostgreSQL journal:
both start (the schema migrated once), both load and serve, every job they ran is recorded
under its own node and ran once, and each stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psycopg

from tests.api.test_serve import PASSWORD, write_config
from tests.model_host.engines.support import free_port
from tests.support.postgres import PostgresServer


def test_two_hosts_serve_on_one_postgres_journal(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    url = postgres_server.create_database()
    hosts = []
    for name in ("node-a", "node-b"):
        root = tmp_path / name
        ports = (free_port(), free_port())
        config = write_config(root, *ports, host={"journal": {"url": url}})
        process = subprocess.Popen(
            [sys.executable, "-m", "sbproxy.cli", "serve", "-f", str(config)],
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore", "SBPROXY_NODE_ID": name},
        )
        hosts.append((name, ports, process))
    try:
        for name, (gateway_port, admin_port), process in hosts:
            assert process.stderr is not None
            lines = [process.stderr.readline(), process.stderr.readline()]
            assert f"gateway listening on http://127.0.0.1:{gateway_port}" in lines[0], (
                name,
                lines,
            )
            answer = httpx.post(
                f"http://localhost:{gateway_port}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}]},
                timeout=30,
            ).json()
            assert answer["model"] == "tiny-chat", (name, answer)
            status = httpx.get(
                f"http://127.0.0.1:{admin_port}/admin/model-host/status",
                auth=("admin", PASSWORD),
                timeout=30,
            ).json()
            assert status["deployments"][0]["state"] == "ready", (name, status)
        for _, _, process in hosts:
            process.send_signal(signal.SIGTERM)
        for name, _, process in hosts:
            assert process.wait(timeout=30) == 0, name
    finally:
        for _, _, process in hosts:
            if process.poll() is None:
                process.kill()
                process.wait()
            if process.stderr is not None:
                process.stderr.close()

    with psycopg.connect(url) as connection:
        jobs = connection.execute("SELECT node, kind, status, attempt FROM jobs").fetchall()
        migrations = connection.execute("SELECT COUNT(*) FROM schema_migrations").fetchone()
        steps = connection.execute(
            "SELECT COUNT(*), COUNT(DISTINCT (job_id, seq)) FROM steps"
        ).fetchone()
    assert {node for node, *_ in jobs} == {"node-a", "node-b"}  # each host ran its own
    assert all(attempt == 1 for *_, attempt in jobs), jobs  # no job claimed twice
    assert not [job for job in jobs if job[2] in ("queued", "running", "failed")], jobs
    assert migrations is not None and steps is not None
    assert steps[0] == steps[1]  # one row per step: no step written twice
