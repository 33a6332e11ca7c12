"""Live checks of what this machine can run, recorded as certification ledger entries.

:func:`certify` runs, for each engine x accelerator this machine has (CPU llama.cpp always;
CUDA llama.cpp when the device probe finds NVIDIA GPUs; vLLM when it is installed and the
worker is CUDA), the checks **load** (the driver's launch plan spawned as a supervised child
until ``/health`` answers), **chat** (one completion with content), **multi_device** (on
CUDA with several GPUs: that chat, answered by an engine split across all of them),
**stream** (a streamed
completion ending in ``[DONE]``) and **stop** (a clean shutdown; the process is gone). Each
entry carries its evidence: UTC time, git commit, hardware from the probe, the engine build
and version, the model's artifact digest and each check's seconds. A combination this
machine cannot run is an entry with outcome ``skipped`` and the reason.

The engine and model come from the cache (``sbproxy engines build``, ``sbproxy models
import``; ``scripts/main.sh`` puts both in the default cache); without them
:func:`plan_checks` raises ``certify_inputs_missing``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import anyio
import httpx

from sbproxy.config import EngineConfig
from sbproxy.errors import SbproxyError
from sbproxy.model_host.artifacts import ArtifactCache, CachedMetadata, CacheLayout
from sbproxy.model_host.capabilities import LEDGER_SCHEMA_VERSION
from sbproxy.model_host.engines import (
    Availability,
    LaunchRequest,
    detect_llama_cpp,
    launch,
    plan_llama_launch,
)
from sbproxy.model_host.engines.vllm import detect_vllm
from sbproxy.model_host.runtime.devices import DeviceInfo, probe_worker
from sbproxy.model_host.runtime.upstream import free_port
from sbproxy.workflows import WorkerIdentity, process_start_ticks

__all__ = ["CertifyInputsMissing", "Target", "certify", "hardware", "plan_checks"]

_PROMPT = "Say hello in one word."
# Generous: the machine may be shared; a small model answers within seconds when idle.
_READY_TIMEOUT_S = 300.0
_REQUEST_TIMEOUT_S = 300.0


class CertifyInputsMissing(SbproxyError):
    """No built engine or no cached model to certify with (code ``certify_inputs_missing``)."""

    default_code = "certify_inputs_missing"
    default_retryable = False


@dataclass(frozen=True)
class Target:
    """One engine x accelerator to certify, or to record as skipped.

    Attributes:
        engine: ``llama_cpp`` or ``vllm``.
        accelerator: ``cpu`` or ``cuda``.
        executable: The engine executable (``None`` when skipped).
        build: ``{"source", "executable", "version"}`` of the engine found.
        model: The cached artifact to load (``None`` when skipped).
        snapshot: Its verified snapshot directory (``None`` when skipped).
        devices: Device indexes for the launch (empty on CPU).
        skip_reason: Why this target is not run here, or ``None``.
    """

    engine: str
    accelerator: str
    executable: Path | None = None
    build: Mapping[str, object] | None = None
    model: CachedMetadata | None = None
    snapshot: Path | None = None
    devices: tuple[int, ...] = ()
    skip_reason: str | None = None

    def to_dict(self) -> dict[str, object]:
        """JSON view (``sbproxy certify --dry-run``)."""
        return {
            "engine": self.engine,
            "accelerator": self.accelerator,
            "run": self.skip_reason is None,
            "skip_reason": self.skip_reason,
            "engine_build": dict(self.build) if self.build else None,
            "model": _model_view(self.model),
            "devices": list(self.devices),
        }


def _model_view(model: CachedMetadata | None) -> dict[str, object] | None:
    if model is None:
        return None
    return {
        "id": model.logical_model,
        "variant": model.variant_id,
        "digest": model.artifact_digest,
        "size_bytes": model.total_size_bytes,
    }


def hardware(gpus: Sequence[DeviceInfo]) -> dict[str, object]:
    """This host as the device probe sees it (the ledger's ``hardware``)."""
    return {
        "worker": probe_worker().describe(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "system": platform.system(),
        "gpus": [
            {"index": gpu.index, "name": gpu.name, "total_bytes": gpu.total_bytes} for gpu in gpus
        ],
    }


def _smallest_gguf(layout: CacheLayout) -> CachedMetadata | None:
    found = [m for m in ArtifactCache(layout).published() if m.format == "gguf"]
    return min(found, key=lambda m: m.total_size_bytes) if found else None


def plan_checks(
    layout: CacheLayout, *, config: EngineConfig | None, gpus: Sequence[DeviceInfo]
) -> list[Target]:
    """The targets this machine runs, and those it records as skipped.

    Raises:
        CertifyInputsMissing: ``certify_inputs_missing`` when no llama.cpp build or no
            cached GGUF model is there for the CPU check, naming what to run first.
    """
    cpu = detect_llama_cpp(config, layout=layout)
    if cpu.availability is not Availability.AVAILABLE or cpu.executable is None:
        raise CertifyInputsMissing(
            f"no llama.cpp engine to certify in {layout.root} ({cpu.reason})",
            remediation="Run scripts/main.sh (it builds the engine and imports a small model "
            "into the default cache), or `sbproxy engines build llama_cpp ...`.",
        )
    model = _smallest_gguf(layout)
    if model is None:
        raise CertifyInputsMissing(
            f"no cached GGUF model to certify with in {layout.root}",
            remediation="Run scripts/main.sh, or `sbproxy models import <file.gguf> --model "
            "<id> --variant <variant>`.",
        )
    build = _build(cpu.source, cpu.executable, cpu.version)
    snapshot = ArtifactCache(layout).snapshot(model.artifact_digest)
    targets = [Target("llama_cpp", "cpu", Path(cpu.executable), build, model, snapshot)]
    targets.append(_cuda_target(layout, config=config, gpus=gpus, model=model))
    targets.append(_vllm_target(gpus))
    return targets


def _build(source: str | None, executable: str, version: str | None) -> dict[str, object]:
    # A cached build's directory is its build identity (``src-cpu-<digest>``, llama_build).
    return {
        "build_id": Path(executable).parent.name,
        "source": source,
        "executable": executable,
        "version": version,
    }


def _cuda_target(
    layout: CacheLayout,
    *,
    config: EngineConfig | None,
    gpus: Sequence[DeviceInfo],
    model: CachedMetadata,
) -> Target:
    if not gpus:
        return Target("llama_cpp", "cuda", skip_reason="the device probe found no NVIDIA GPU")
    wanted = (config or EngineConfig()).model_copy(update={"acceleration": "cuda"})
    found = detect_llama_cpp(wanted, layout=layout)
    if found.availability is not Availability.AVAILABLE or found.executable is None:
        return Target(
            "llama_cpp",
            "cuda",
            skip_reason=f"no CUDA llama.cpp build ({found.reason}); build one with "
            "`sbproxy engines build llama_cpp --acceleration cuda ...`",
        )
    build = _build(found.source, found.executable, found.version)
    devices = tuple(gpu.index for gpu in gpus)
    snapshot = ArtifactCache(layout).snapshot(model.artifact_digest)
    return Target("llama_cpp", "cuda", Path(found.executable), build, model, snapshot, devices)


def _vllm_target(gpus: Sequence[DeviceInfo]) -> Target:
    best = max(gpus, key=lambda g: g.free_bytes) if gpus else None
    found = detect_vllm(
        None,
        accelerator="cuda" if gpus else "cpu",
        compute_capability=best.compute_capability if best else None,
    )
    if found.availability is not Availability.AVAILABLE:
        return Target("vllm", "cuda", skip_reason=f"vLLM is not available here: {found.reason}")
    # A vLLM live check needs a safetensors checkpoint this command does not fetch yet.
    return Target("vllm", "cuda", skip_reason="the vLLM live check is not implemented yet")


def _commit() -> str | None:
    checkout = Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run(  # noqa: S603 - fixed argv, no shell
            ["git", "-C", str(checkout), "rev-parse", "HEAD"],  # noqa: S607 - git from PATH
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def certify(
    targets: Sequence[Target], *, scratch: Path, gpus: Sequence[DeviceInfo]
) -> list[dict[str, object]]:
    """Run each target's checks; one ledger entry per target (skipped ones included).

    Args:
        targets: From :func:`plan_checks`.
        scratch: A directory for engine logs and ownership records.
        gpus: The probe's devices (the entries' ``hardware``).

    Returns:
        The entries, each ``{"schema_version", "recorded_at", "commit", "hardware",
        "engine", "accelerator", "engine_build", "model", "outcome": passed|failed|skipped,
        "reason", "checks": [{"name", "ok", "seconds", "evidence"}]}``.
    """
    described = hardware(gpus)
    commit = _commit()
    entries: list[dict[str, object]] = []
    for index, target in enumerate(targets):
        entry: dict[str, object] = {
            "schema_version": LEDGER_SCHEMA_VERSION,
            "recorded_at": _now(),
            "commit": commit,
            "hardware": described,
            "engine": target.engine,
            "accelerator": target.accelerator,
            "engine_build": dict(target.build) if target.build else None,
            "model": _model_view(target.model),
            "reason": target.skip_reason,
            "checks": [],
        }
        if target.skip_reason is not None:
            entry["outcome"] = "skipped"
        else:
            checks = await _run_checks(target, scratch=scratch / str(index))
            entry["checks"] = checks
            failed = [c for c in checks if not c["ok"]]
            entry["outcome"] = "failed" if failed else "passed"
            if failed:
                entry["reason"] = f"{failed[0]['name']} failed: {failed[0]['evidence']}"
        entries.append(entry)
    return entries


def _check(name: str, started: float, ok: bool, evidence: str) -> dict[str, object]:
    return {
        "name": name,
        "ok": ok,
        "seconds": round(time.monotonic() - started, 3),
        "evidence": evidence,
    }


async def _run_checks(target: Target, *, scratch: Path) -> list[dict[str, object]]:
    """load, chat, stream, stop against a real engine on a free loopback port."""
    # Only targets plan_checks filled in get here (skip_reason is None).
    assert target.model and target.executable and target.snapshot  # noqa: S101
    port = free_port()
    request = LaunchRequest(
        deployment="certify",
        generation=1,
        metadata=target.model,
        snapshot=target.snapshot,
        port=port,
        ctx_size=2048,
        max_concurrency=1,
        accelerator=target.accelerator,
        devices=target.devices,
    )
    checks: list[dict[str, object]] = []
    started = time.monotonic()
    try:
        plan = plan_llama_launch(request, executable=target.executable)
        process = await launch(
            plan,
            log_path=scratch / "engine.log",
            owned_dir=scratch / "owned",
            label="certify/1",
            identity=WorkerIdentity.current(),
            ready_timeout_s=_READY_TIMEOUT_S,
        )
    except SbproxyError as exc:
        checks.append(_check("load", started, False, f"{exc.code}: {exc.message}"))
        return checks
    checks.append(_check("load", started, True, f"/health 200 on 127.0.0.1:{port}"))
    base = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        async with httpx.AsyncClient(timeout=_REQUEST_TIMEOUT_S) as client:
            chat = await _chat(client, base)
            checks.append(chat)
            if len(target.devices) > 1:
                # The plan split the model across every device (--split-mode row): a chat
                # answered by that engine is the multi-device check.
                split = f"split across devices {list(target.devices)}; chat {chat['evidence']}"
                checks.append({**chat, "name": "multi_device", "evidence": split})
            checks.append(await _stream(client, base))
    finally:
        started = time.monotonic()
        with anyio.CancelScope(shield=True):
            await process.shutdown(grace_s=10)
        gone = process_start_ticks(process.pid) is None
        evidence = f"pid {process.pid} exited" if gone else f"pid {process.pid} still running"
        checks.append(_check("stop", started, gone, evidence))
    return checks


async def _chat(client: httpx.AsyncClient, url: str) -> dict[str, object]:
    started = time.monotonic()
    body = {
        "messages": [{"role": "user", "content": _PROMPT}],
        "max_tokens": 16,
        "temperature": 0,
    }
    try:
        response = await client.post(url, json=body)
        answer = response.json()
        content = answer["choices"][0]["message"]["content"]
        tokens = answer["usage"]["completion_tokens"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        return _check("chat", started, False, f"no completion: {type(exc).__name__}: {exc}")
    ok = response.status_code == 200 and isinstance(content, str) and bool(content.strip())
    return _check("chat", started, ok, f"HTTP {response.status_code}, {tokens} tokens")


async def _stream(client: httpx.AsyncClient, url: str) -> dict[str, object]:
    started = time.monotonic()
    body = {
        "messages": [{"role": "user", "content": _PROMPT}],
        "max_tokens": 16,
        "temperature": 0,
        "stream": True,
    }
    events = 0
    done = False
    status = 0
    try:
        async with client.stream("POST", url, json=body) as response:
            status = response.status_code
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    done = True
                    break
                json.loads(data)
                events += 1
    except (httpx.HTTPError, ValueError) as exc:
        return _check("stream", started, False, f"stream broke: {type(exc).__name__}: {exc}")
    ok = status == 200 and done and events > 0
    ending = "ended with [DONE]" if done else "no [DONE]"
    return _check("stream", started, ok, f"HTTP {status}, {events} events, {ending}")
