"""``sbproxy doctor``: what this host has, and what stands between each deployment and a run."""

from __future__ import annotations

import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Any

import click
import psutil

from sbproxy.catalog import ArtifactRequest, load_catalog, resolve_artifact
from sbproxy.cli._options import (
    cache_dir_option,
    config_option,
    load_cli_config,
    resolve_layout,
    select_journal,
)
from sbproxy.cli._output import EXIT_RUNTIME, emit_json, format_option
from sbproxy.config import CompiledConfig
from sbproxy.errors import SbproxyError
from sbproxy.model_host.artifacts import ArtifactCache, CacheLayout
from sbproxy.model_host.engines import detect_llama_cpp
from sbproxy.model_host.engines.vllm import detect_vllm
from sbproxy.model_host.runtime import probe_devices, probe_worker
from sbproxy.store.probe import probe_journal

__all__ = ["doctor_command"]


def _free_bytes(path: Path) -> int | None:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return None


def _deployments(
    config: CompiledConfig, layout: CacheLayout, engines: dict[str, Any]
) -> list[dict[str, Any]]:
    host = config.model_host
    if host is None:
        return []
    catalog = load_catalog(Path(host.catalog_file) if host.catalog_file else None)
    cache = ArtifactCache(layout)
    worker = probe_worker()
    rows = []
    for deployment_id, deployment in sorted(config.deployments.items()):
        row: dict[str, Any] = {"deployment": deployment_id, "model": deployment.model}
        blockers: list[dict[str, str | None]] = []
        try:
            request = ArtifactRequest.model_validate(
                {
                    "model": deployment.model,
                    "variant": deployment.variant,
                    "engine": str(deployment.engine),
                }
            )
            artifact = resolve_artifact(catalog, request, worker).artifact
        except SbproxyError as exc:
            blockers.append(
                {"code": exc.code, "detail": exc.message, "remediation": exc.remediation}
            )
            row.update({"runnable": False, "blockers": blockers})
            rows.append(row)
            continue
        state = cache.lookup(artifact).kind
        row.update(
            {
                "variant": artifact.variant_id,
                "engine": str(artifact.engine),
                "artifact_digest": artifact.digest,
                "cached": state == "ready",
            }
        )
        if state != "ready" and str(deployment.pull) == "manual":
            blockers.append(
                {
                    "code": "manual_artifact_missing",
                    "detail": "not cached and the pull policy is manual",
                    "remediation": f"sbproxy models pull {deployment.model} --variant "
                    f"{artifact.variant_id}",
                }
            )
        engine = engines.get(str(artifact.engine))
        if engine is None or engine["availability"] in ("blocked", "incompatible"):
            blockers.append(
                {
                    "code": f"engine_{engine['availability'] if engine else 'missing'}",
                    "detail": engine["reason"] if engine else f"{artifact.engine} is not supported",
                    "remediation": engine["remediation"] if engine else None,
                }
            )
        row.update({"runnable": not blockers, "blockers": blockers})
        rows.append(row)
    return rows


def _journal_state(journal: dict[str, Any]) -> str:
    """``reachable, schema N`` / ``reachable, not created yet``; an unreachable journal says
    so with its reason code: whether it exists there is not known."""
    if not journal["reachable"]:
        return f"UNREACHABLE: {journal['code'] or 'journal_unavailable'}, schema unknown"
    version = journal["schema_version"]
    return "reachable, " + ("not created yet" if version is None else f"schema {version}")


@click.command("doctor")
@config_option
@cache_dir_option
@format_option
def doctor_command(config_path: Path | None, cache_dir: Path | None, output_format: str) -> None:
    """Report the host (CPU, memory, devices), engines, cache and each configured deployment.

    The journal: SQLite file or PostgreSQL ``host:port/db`` (never a password), its schema
    version and whether it is reachable.

    Exit status: 0 when everything configured can run, 1 when a deployment has a blocker or
    the journal is unreachable or newer than this sbproxy, 2 for an invalid configuration.
    """
    command = "doctor"
    config = load_cli_config(command, config_path, output_format=output_format)
    layout = resolve_layout(command, cache_dir, config, output_format=output_format)
    worker = probe_worker()
    host_config = config.model_host if config else None
    detections = [
        detect_llama_cpp(host_config.engines.llama_cpp if host_config else None, layout=layout),
        detect_vllm(
            host_config.engines.vllm if host_config else None,
            accelerator=worker.accelerator.value,
            compute_capability=worker.compute_capability,
        ),
    ]
    engines = {d.kind: d.to_dict() for d in detections}
    devices = [
        {
            "index": d.index,
            "name": d.name,
            "total_bytes": d.total_bytes,
            "free_bytes": d.free_bytes,
            "compute_capability": list(d.compute_capability) if d.compute_capability else None,
            "utilization_percent": d.utilization_percent,
        }
        for d in probe_devices()
    ]
    deployments = _deployments(config, layout, engines) if config else []
    journal = probe_journal(
        select_journal(command, layout, config, output_format=output_format).location
    )
    report: dict[str, Any] = {
        "host": {
            "os": platform.system(),
            "arch": platform.machine(),
            "cpu_count": os.cpu_count(),
            "total_ram_bytes": psutil.virtual_memory().total,
            "python": platform.python_version(),
        },
        "worker": worker.describe(),
        "devices": devices,
        "engines": list(engines.values()),
        "cache": {
            "root": str(layout.root),
            "exists": layout.root.exists(),
            "free_bytes": _free_bytes(layout.root),
        },
        "journal": journal,
        "deployments": deployments,
    }
    blocked = [d for d in deployments if not d["runnable"]]
    # A journal that cannot be reached, or that is newer than this sbproxy, stops the host.
    journal_blocked = not journal["reachable"] or (
        journal["schema_version"] is not None
        and journal["schema_version"] > journal["supported_schema"]
    )
    if output_format == "json":
        emit_json("doctor", report)
    else:
        click.echo(f"host: {report['host']['os']} {report['host']['arch']}, {worker.describe()}")
        click.echo(f"devices: {len(devices) or 'none (CPU worker)'}")
        for engine in engines.values():
            click.echo(f"engine {engine['engine']}: {engine['availability']} - {engine['reason']}")
        cache = report["cache"]
        free = cache["free_bytes"]
        free_text = f"{free / 2**30:.1f} GiB free" if free is not None else "free space unknown"
        exists = "exists" if cache["exists"] else "not created yet"
        click.echo(f"cache: {cache['root']} ({exists}, {free_text})")
        click.echo(
            f"journal: {journal['backend']} {journal['location']} ({_journal_state(journal)})"
        )
        if journal["error"]:
            click.echo(f"  {journal['error']}")
        if journal["remediation"]:
            click.echo(f"  to do: {journal['remediation']}")
        for row in deployments:
            mark = "ok" if row["runnable"] else "BLOCKED"
            click.echo(f"deployment {row['deployment']} ({row['model']}): {mark}")
            for blocker in row["blockers"]:
                click.echo(f"  {blocker['code']}: {blocker['detail']}")
                if blocker.get("remediation"):
                    click.echo(f"  to do: {blocker['remediation']}")
    if blocked or journal_blocked:
        sys.exit(EXIT_RUNTIME)
