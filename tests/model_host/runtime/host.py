"""A runtime host for tests: a cache, a catalog with one tiny GGUF artifact served from a
``file:`` source, a configuration, and a manager whose engine is the stand-in llama-server."""

from __future__ import annotations

import hashlib
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import yaml

from sbproxy.catalog import Accelerator, WorkerProfile, load_catalog
from sbproxy.config import CompiledConfig, load_config, load_config_text
from sbproxy.model_host.artifacts import ArtifactCache, CacheLayout
from sbproxy.model_host.flows import registry
from sbproxy.model_host.runtime.clock import Clock
from sbproxy.model_host.runtime.devices import HostDevices
from sbproxy.model_host.runtime.launcher import Launcher
from sbproxy.model_host.runtime.manager import RUNTIME_JOB_KINDS, RuntimeManager
from sbproxy.model_host.runtime.reload import admin_desired  # also registers "reload"
from sbproxy.model_host.runtime.state import LaunchBackoff
from sbproxy.store import RuntimeStore, journal_location, open_journal
from sbproxy.workflows import LeaseSettings, WorkflowEngine
from tests.model_host.engines.support import fake_llama_server
from tests.model_host.runtime.support import write_gguf

GIB = 1024**3


def write_catalog(root: Path) -> Path:
    """A catalog whose ``tiny`` model is a synthetic GGUF in a ``file:`` source directory,
    and ``tiny-base`` the same bytes as a completion-only model (``chat_template: none``)."""
    source = root / "source"
    source.mkdir(parents=True, exist_ok=True)
    gguf = write_gguf(source / "tiny.gguf", vocab=50)
    data = gguf.read_bytes()
    document = {
        "schema_version": 2,
        "catalog_revision": "runtime-test-1",
        "models": {
            "tiny": {
                "params": "1M",
                "license": "apache-2.0",
                "family": "test",
                "context_length": 4096,
                "variants": [
                    {
                        "id": "q4_k_m",
                        "format": "gguf",
                        "quant": "Q4_K_M",
                        "engines": ["llama_cpp"],
                        "source": f"file:{source}",
                        "revision": "main",
                        "files": [
                            {
                                "path": "tiny.gguf",
                                "sha256": hashlib.sha256(data).hexdigest(),
                                "size_bytes": len(data),
                            }
                        ],
                        "requirements": {
                            "accelerators": ["cpu", "cuda"],
                            "min_memory_bytes": 1,
                        },
                        "stability": "preview",
                        "certification": "test",
                    }
                ],
            }
        },
    }
    # The same bytes as a completion-only (base) model: chat requests are refused.
    base = {**document["models"]["tiny"], "modality": "completion"}  # type: ignore[index]
    base["variants"] = [{**base["variants"][0], "chat_template": "none"}]
    document["models"]["tiny-base"] = base  # type: ignore[index]
    path = root / "catalog.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def config_text(
    root: Path,
    *,
    executable: Path,
    deployments: dict[str, dict[str, Any]],
    host: dict[str, Any] | None = None,
    proxy: dict[str, Any] | None = None,
) -> str:
    document = {
        "proxy": {
            **(proxy or {}),
            "model_host": {
                "catalog_file": str(root / "catalog.yaml"),
                "shutdown_deadline_ms": 2000,
                "cache": {"directory": str(root / "cache")},
                "engines": {"llama_cpp": {"path": str(executable)}},
                **(host or {}),
                "deployments": deployments,
            },
        }
    }
    return yaml.safe_dump(document)


def candidate(
    root: Path, *, deployments: dict[str, dict[str, Any]], host: dict[str, Any] | None = None
) -> CompiledConfig:
    """A compiled configuration like the one :func:`runtime_host` started with, with other
    deployments (for reloads)."""
    executable = root / "bin" / "llama-server"
    return load_config_text(
        config_text(root, executable=executable, deployments=deployments, host=host)
    )


@dataclass
class Host:
    manager: RuntimeManager
    engine: WorkflowEngine
    layout: CacheLayout
    root: Path


@asynccontextmanager
async def runtime_host(
    root: Path,
    *,
    deployments: dict[str, dict[str, Any]],
    mode: str | None = None,
    backoff: LaunchBackoff | None = None,
    memory_bytes: int = 16 * GIB,
    start: bool = True,
    host: dict[str, Any] | None = None,
    config_file: bool = False,
    worker: bool = False,
    clock: Clock | None = None,
    health_interval_s: float = 0.1,
    jitter: Callable[[], float] | None = None,
    launcher: Launcher | None = None,
    devices: HostDevices | None = None,
) -> AsyncIterator[Host]:
    """A started manager (maintenance every 0.1 s) inside a task group.

    ``host`` adds ``proxy.model_host`` fields (``authority``, ``store_path``, ...);
    ``config_file`` writes the configuration to ``root/sb.yml`` and loads it from there (a
    reloadable source); ``worker`` runs the job worker loop (it resumes interrupted jobs);
    ``devices`` is the host's device table (its accelerator becomes the worker's; default:
    one CPU device of ``memory_bytes``).
    """
    if not (root / "catalog.yaml").exists():
        write_catalog(root)
    executable = fake_llama_server(root / "bin", mode=mode)
    text = config_text(root, executable=executable, deployments=deployments, host=host)
    if config_file:
        (root / "sb.yml").write_text(text)
        compiled: CompiledConfig = load_config(root / "sb.yml")
    else:
        compiled = load_config_text(text)
    compiled, _ = await admin_desired(compiled)
    layout = CacheLayout(root=root / "cache")
    cache = ArtifactCache(layout)
    cache.ensure_dirs()
    # proxy.model_host.journal (a PostgreSQL journal) as `serve` reads it; else SQLite.
    journal = await open_journal(journal_location(layout.journal, compiled.model_host))
    engine = WorkflowEngine(
        journal, registry, resources=[cache], lease=LeaseSettings(lease_s=5, heartbeat_s=0.5)
    )
    manager = RuntimeManager(
        compiled=compiled,
        layout=layout,
        catalog=load_catalog(root / "catalog.yaml"),
        engine=engine,
        runtime_store=RuntimeStore(journal.database),
        worker=WorkerProfile(
            accelerator=devices.accelerator if devices else Accelerator.CPU,
            memory_bytes=memory_bytes,
        ),
        backoff=backoff or LaunchBackoff(base_s=0.05, max_s=0.2, max_attempts=3),
        ready_timeout_s=20,
        health_interval_s=health_interval_s,
        clock=clock,
        jitter=jitter if jitter is not None else random.random,
        launcher=launcher,
        devices=devices,
    )
    engine.add_resource(manager)
    engine.add_resource(manager.port)
    try:
        async with anyio.create_task_group() as group:
            if start:
                await manager.start(group)
            if worker:
                group.start_soon(partial(engine.run_worker, exclude=RUNTIME_JOB_KINDS))
            try:
                yield Host(manager=manager, engine=engine, layout=layout, root=root)
            finally:
                await manager.shutdown()
                group.cancel_scope.cancel()
    finally:
        await engine.close()
