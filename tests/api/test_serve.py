"""``sbproxy serve`` as a real process: both listeners, a routed request, SIGTERM shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.model_host.engines.support import fake_llama_server, free_port
from tests.model_host.runtime.host import config_text, write_catalog

PASSWORD = "serve-test-password"


def write_config(
    root: Path,
    gateway_port: int,
    admin_port: int,
    *,
    mode: str | None = None,
    host: dict[str, Any] | None = None,
) -> Path:
    """A served ``sb.yml``: deployment ``tiny`` (stand-in engine in ``mode``) as model
    ``tiny-chat`` on origin ``localhost``, admin enabled; ``host`` adds
    ``proxy.model_host`` fields."""
    write_catalog(root)
    executable = fake_llama_server(root / "bin", mode=mode)
    document = yaml.safe_load(
        config_text(
            root,
            executable=executable,
            deployments={"tiny": {"model": "tiny", "variant": "q4_k_m"}},
            host=host,
        )
    )
    document["proxy"].update(
        {
            "http_bind_port": gateway_port,
            "admin": {"enabled": True, "port": admin_port, "password": PASSWORD},
        }
    )
    document["origins"] = {
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
    }
    path = root / "sb.yml"
    path.write_text(yaml.safe_dump(document))
    return path


def test_serve_answers_and_stops_on_sigterm(tmp_path: Path) -> None:
    gateway_port, admin_port = free_port(), free_port()
    config = write_config(tmp_path, gateway_port, admin_port)
    process = subprocess.Popen(
        [sys.executable, "-m", "sbproxy.cli", "serve", "-f", str(config)],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    try:
        assert process.stderr is not None
        lines = [process.stderr.readline(), process.stderr.readline()]
        assert f"gateway listening on http://127.0.0.1:{gateway_port}" in lines[0], lines
        assert f"admin listening on http://127.0.0.1:{admin_port}" in lines[1], lines
        gateway = f"http://localhost:{gateway_port}"
        answer = httpx.post(
            f"{gateway}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        ).json()
        assert answer["model"] == "tiny-chat"
        status = httpx.get(
            f"http://127.0.0.1:{admin_port}/admin/model-host/status", auth=("admin", PASSWORD)
        ).json()
        assert status["deployments"][0]["state"] == "ready"
        engine_port = status["deployments"][0]["port"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        with pytest.raises(httpx.ConnectError):  # the engine was stopped too
            httpx.get(f"http://127.0.0.1:{engine_port}/health", timeout=2)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stderr is not None:
            process.stderr.close()


def test_the_server_loop_is_uvloop_where_installed() -> None:
    """uvicorn[standard] brings uvloop on Linux; `serve` and `run` own their loop and ask for it."""
    import asyncio

    from sbproxy.api.server import loop_options, run_served

    assert loop_options() == {"use_uvloop": True}  # installed with uvicorn[standard] here
    seen: list[str] = []

    async def main() -> None:
        seen.append(type(asyncio.get_running_loop()).__module__)

    run_served(main)
    assert seen and seen[0].startswith("uvloop")
