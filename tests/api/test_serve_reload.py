"""Reloading a real ``sbproxy serve`` process: SIGHUP, the file watcher, ``sbproxy apply``
and ``POST /admin/reload`` all run the reload transaction; a bad file changes nothing."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.api.test_serve import PASSWORD, write_config
from tests.model_host.engines.support import free_port

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


@contextmanager
def serving(config: Path, *options: str) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "sbproxy.cli", "serve", "-f", str(config), *options],
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        assert process.stderr is not None
        for _ in range(2):
            assert "listening on" in process.stderr.readline()
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        if process.stderr is not None:
            process.stderr.close()


def status(admin_port: int) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(
        f"http://127.0.0.1:{admin_port}/admin/model-host/status", auth=("admin", PASSWORD)
    ).json()
    return body


def deployments(admin_port: int) -> dict[str, dict[str, Any]]:
    return {row["deployment"]: row for row in status(admin_port)["deployments"]}


def wait_for(predicate: Any, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def edit(config: Path, change: Any) -> None:
    document = yaml.safe_load(config.read_text())
    change(document)
    config.write_text(yaml.safe_dump(document))


def add_second(document: dict[str, Any]) -> None:
    document["proxy"]["model_host"]["deployments"]["second"] = {
        "model": "tiny",
        "variant": "q4_k_m",
    }
    document["origins"]["localhost"]["action"]["providers"].append(
        {
            "name": "second",
            "provider_type": "managed_model",
            "deployment": "second",
            "models": ["second-chat"],
        }
    )


def remove_second(document: dict[str, Any]) -> None:
    del document["proxy"]["model_host"]["deployments"]["second"]
    providers = document["origins"]["localhost"]["action"]["providers"]
    document["origins"]["localhost"]["action"]["providers"] = [
        p for p in providers if p["name"] != "second"
    ]


def admin_cli(
    admin_port: int, *args: str, password: str = PASSWORD
) -> subprocess.CompletedProcess[str]:
    """Run ``sbproxy ARGS`` against the admin API on ``admin_port``."""
    return subprocess.run(
        [sys.executable, "-m", "sbproxy.cli", *args],
        capture_output=True,
        text=True,
        env={
            **ENV,
            "SB_ADMIN_URL": f"http://127.0.0.1:{admin_port}",
            "SB_ADMIN_PASSWORD": password,
        },
        timeout=120,
        check=False,
    )


def apply(config: Path, admin_port: int, *options: str) -> subprocess.CompletedProcess[str]:
    return admin_cli(admin_port, "apply", "-f", str(config), *options)


def chat(gateway_port: int, model: str) -> httpx.Response:
    return httpx.post(
        f"http://localhost:{gateway_port}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )


def test_sighup_apply_and_admin_reload(tmp_path: Path) -> None:
    gateway_port, admin_port = free_port(), free_port()
    config = write_config(tmp_path, gateway_port, admin_port)
    with serving(config, "--no-watch") as process:
        assert chat(gateway_port, "tiny-chat").status_code == 200
        tiny = deployments(admin_port)["tiny"]
        revision = status(admin_port)["runtime_revision"]
        assert chat(gateway_port, "second-chat").status_code == 404

        # SIGHUP: the edited file is applied, routes included.
        edit(config, add_second)
        process.send_signal(signal.SIGHUP)
        wait_for(lambda: "second" in deployments(admin_port))
        answer = chat(gateway_port, "second-chat")
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "second-chat"
        assert status(admin_port)["runtime_revision"] == revision + 1

        # A file that does not validate: apply refuses before sending anything, and the
        # server's own reload refuses with the dotted path; nothing changes.
        good = config.read_text()
        edit(
            config,
            lambda d: d["proxy"]["model_host"]["deployments"]["tiny"].update(max_concurrency=0),
        )
        refused = apply(config, admin_port)
        assert refused.returncode == 2
        assert refused.stderr.count("proxy.model_host.deployments.tiny.max_concurrency") == 1
        as_json = apply(config, admin_port, "--format", "json")
        assert as_json.returncode == 2
        assert json.loads(as_json.stdout)["errors"][0]["path"] == (
            "proxy.model_host.deployments.tiny.max_concurrency"
        )
        reloaded = httpx.post(
            f"http://127.0.0.1:{admin_port}/admin/reload", auth=("admin", PASSWORD)
        )
        assert reloaded.status_code == 400
        assert reloaded.json()["code"] == "invalid_config"
        assert "proxy.model_host.deployments.tiny.max_concurrency" in reloaded.json()["error"]
        assert reloaded.json()["errors"][0]["path"] == (
            "proxy.model_host.deployments.tiny.max_concurrency"
        )
        assert set(deployments(admin_port)) == {"tiny", "second"}
        config.write_text(good)

        # A listener change needs a restart: refused, nothing changes.
        edit(config, lambda d: d["proxy"].update(http_bind_port=free_port()))
        restart = apply(config, admin_port, "--format", "json")
        assert restart.returncode == 2
        assert json.loads(restart.stdout)["error"]["code"] == "restart_required"
        config.write_text(good)

        # Another file than the one the server runs is refused.
        other = tmp_path / "other.yml"
        shutil.copy(config, other)
        mismatch = apply(other, admin_port, "--format", "json")
        assert mismatch.returncode == 2
        assert json.loads(mismatch.stdout)["error"]["code"] == "source_mismatch"

        # apply: second removed, tiny preserved with its engine.
        edit(config, remove_second)
        applied = apply(config, admin_port, "--format", "json")
        assert applied.returncode == 0, applied.stderr
        body = json.loads(applied.stdout)
        assert body["command"] == "apply"
        assert body["plan"] == {
            "added": [],
            "changed": [],
            "removed": ["second"],
            "preserved": ["tiny"],
        }
        assert body["job_id"]
        after = deployments(admin_port)
        assert set(after) == {"tiny"}
        assert (after["tiny"]["generation"], after["tiny"]["port"]) == (
            tiny["generation"],
            tiny["port"],
        )
        assert chat(gateway_port, "second-chat").status_code == 404


def test_the_file_watcher_reloads_an_edited_file(tmp_path: Path) -> None:
    gateway_port, admin_port = free_port(), free_port()
    config = write_config(tmp_path, gateway_port, admin_port)
    with serving(config):
        assert set(deployments(admin_port)) == {"tiny"}
        edit(config, add_second)
        wait_for(lambda: "second" in deployments(admin_port))
        assert chat(gateway_port, "second-chat").status_code == 200


def test_serve_refuses_a_candidate_that_does_not_resolve(tmp_path: Path) -> None:
    config = write_config(tmp_path, free_port(), free_port())
    edit(config, lambda d: d["proxy"]["model_host"]["deployments"]["tiny"].update(model="nope"))
    refused = subprocess.run(
        [sys.executable, "-m", "sbproxy.cli", "serve", "-f", str(config)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
        check=False,
    )
    assert refused.returncode == 2
    assert "proxy.model_host.deployments.tiny.model" in refused.stderr
    assert "unknown_catalog_model" in refused.stderr
    assert "Traceback" not in refused.stderr
