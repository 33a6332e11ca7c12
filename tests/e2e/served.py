"""A served ``sb.yml`` for the end-to-end gateway tests: one warm deployment of a real
catalog model on the real llama-server, routed as its own name on origin ``localhost``."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import yaml

from tests.model_host.engines.support import free_port

PASSWORD = "e2e-admin-password-0123456789"


def write_config(
    root: Path,
    *,
    llama_server: Path,
    cache: Path,
    deployment: str,
    model: str,
    variant: str,
    max_concurrency: int,
) -> tuple[Path, int, int]:
    """``root/sb.yml`` serving ``deployment`` (``model``/``variant``, 2048 context); the
    file, the gateway port and the admin port."""
    gateway, admin = free_port(), free_port()
    document = {
        "proxy": {
            "http_bind_port": gateway,
            "admin": {"enabled": True, "port": admin, "password": PASSWORD},
            "model_host": {
                "shutdown_deadline_ms": 5000,
                "cache": {"directory": str(cache)},
                "engines": {"llama_cpp": {"path": str(llama_server)}},
                "deployments": {
                    deployment: {
                        "model": model,
                        "variant": variant,
                        "warm": True,
                        "max_context": 2048,
                        "max_concurrency": max_concurrency,
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
                            "deployment": deployment,
                            "models": [deployment],
                            "default_model": deployment,
                        }
                    ],
                }
            }
        },
    }
    config = root / "sb.yml"
    config.write_text(yaml.safe_dump(document))
    return config, gateway, admin


def poll(predicate: Callable[[], bool], *, timeout_s: float, what: str) -> float:
    """Seconds until ``predicate`` held (checked every 20 ms)."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.02)
    return time.monotonic() - started
