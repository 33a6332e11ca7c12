"""The vLLM driver: launch plans for a pinned ``uv`` environment or a digest-pinned container.

vLLM needs a CUDA worker (compute capability 7.0 or newer) and consumes a read-only verified
snapshot. Plans are data, built and validated here and unit-tested; running them needs a
CUDA machine.

* **uv**: ``uv tool run --from vllm==<version> vllm serve <snapshot> ...``; the environment
  lives under ``<cache>/engines/vllm/<version>/`` (``UV_TOOL_DIR``/``UV_CACHE_DIR``). Before a
  launch, :func:`compat_probe_argv` runs a short Python program in that environment that
  prints ``{python, torch, cuda, vllm}``; :func:`judge_compat` turns it into a verdict with a
  remediation. A failed check never falls back to another Python environment.
* **container**: only ``<repository>@sha256:<64 hex>`` images; a private ``--internal``
  network; the snapshot mounted read-only at ``/models/model``; the port published on
  ``127.0.0.1`` only; only the selected GPUs (Docker ``--gpus "device=..."``, Podman CDI
  ``--device nvidia.com/gpu=...``); a typed ``--shm-size``. Never ``--privileged``,
  ``--network host`` or all GPUs.

Common flags: ``--host``, ``--port``, ``--served-model-name <deployment>``, ``--max-model-len``,
``--max-num-seqs`` = the deployment's concurrency, and ``--gpu-memory-utilization`` derived
from the admitted memory estimate: clamp((estimate + 2 GiB) / device total, 0.2, 0.95), as
the reference does (section 7.4), so the engine's KV cache stays inside what admission
reserved.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sbproxy.config import EngineConfig, check_engine_args
from sbproxy.model_host.engines.driver import (
    Availability,
    Detection,
    LaunchPlan,
    LaunchRequest,
    check_snapshot,
)
from sbproxy.model_host.engines.errors import EngineError
from sbproxy.model_host.engines.process import minimal_env

__all__ = [
    "CONTAINER_NETWORK",
    "DEFAULT_VERSION",
    "CompatVerdict",
    "compat_probe_argv",
    "detect_vllm",
    "gpu_memory_utilization",
    "judge_compat",
    "network_create_argv",
    "plan_vllm_container",
    "plan_vllm_uv",
    "worker_verdict",
]

KIND = "vllm"
DEFAULT_VERSION = "0.10.0"
CONTAINER_NETWORK = "sbproxy-model-host"
CONTAINER_MODEL_DIR = "/models/model"
_IMAGE_RE = re.compile(r"^[a-z0-9][a-z0-9._/:-]*@sha256:[0-9a-f]{64}$")
_GIB = 1024**3
_MIN_COMPUTE_CAPABILITY = (7, 0)

# Printed by the probe inside the pinned environment; it never imports the model.
PROBE_SCRIPT = (
    "import json, sys\n"
    "out = {'python': sys.version.split()[0], 'torch': None, 'cuda': None, 'vllm': None}\n"
    "try:\n"
    "    import torch\n"
    "    out['torch'] = torch.__version__\n"
    "    out['cuda'] = torch.version.cuda\n"
    "    out['cuda_available'] = bool(torch.cuda.is_available())\n"
    "except Exception as exc:\n"
    "    out['torch_error'] = str(exc)[:200]\n"
    "try:\n"
    "    import vllm\n"
    "    out['vllm'] = vllm.__version__\n"
    "except Exception as exc:\n"
    "    out['vllm_error'] = str(exc)[:200]\n"
    "print(json.dumps(out))\n"
)


def gpu_memory_utilization(estimate_bytes: int | None, device_bytes: int | None) -> float:
    """Share of the device vLLM may use: (estimate + 2 GiB) / total, within [0.2, 0.95];
    0.90 when either figure is unknown (reference section 7.4)."""
    if not estimate_bytes or not device_bytes:
        return 0.90
    return min(max((estimate_bytes + 2 * _GIB) / device_bytes, 0.2), 0.95)


def _serve_flags(request: LaunchRequest, *, host: str, port: int, model: str) -> list[str]:
    problems = check_engine_args("vllm", request.extra_args)
    if problems:
        raise EngineError(
            "; ".join(message for _, message in problems),
            code="unsafe_argument",
            remediation="Remove the flag from extra_args; the runtime sets it itself.",
        )
    flags = [
        model,
        "--host", host,
        "--port", str(port),
        "--served-model-name", request.deployment,
        "--max-model-len", str(request.ctx_size),
        "--max-num-seqs", str(request.max_concurrency),
        "--gpu-memory-utilization",
        f"{gpu_memory_utilization(request.gpu_memory_bytes, request.device_memory_bytes):.4f}",
    ]  # fmt: skip
    if len(request.devices) > 1:
        flags += ["--tensor-parallel-size", str(len(request.devices))]
    if request.kv_quant in ("fp8", "int8", "int4"):
        flags += ["--kv-cache-dtype", "fp8"]
    return flags + list(request.extra_args)


def _check_vllm_request(request: LaunchRequest) -> None:
    check_snapshot(request)
    if request.metadata.format not in ("safetensors", "pickle"):
        raise EngineError(
            f"vLLM serves safetensors checkpoints, not {request.metadata.format}",
            code="engine_incompatible",
        )
    if request.accelerator != "cuda":
        raise EngineError("vLLM needs a CUDA worker", code="engine_incompatible")


def plan_vllm_uv(request: LaunchRequest, *, uv: Path, version: str, env_root: Path) -> LaunchPlan:
    """The ``uv tool run`` plan of one vLLM generation.

    Raises:
        EngineError: ``engine_incompatible``, ``artifact_not_ready`` or ``unsafe_argument``.
    """
    _check_vllm_request(request)
    argv = [
        str(uv), "tool", "run", "--from", f"vllm=={version}", "vllm", "serve",
        *_serve_flags(request, host="127.0.0.1", port=request.port, model=str(request.snapshot)),
    ]  # fmt: skip
    env = minimal_env(
        {
            "UV_TOOL_DIR": str(env_root / "tools"),
            "UV_CACHE_DIR": str(env_root / "cache"),
            "CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in request.devices),
            "HF_HUB_OFFLINE": "1",
        }
    )
    return LaunchPlan(argv=tuple(argv), env=env, health_path="/health", port=request.port)


def plan_vllm_container(
    request: LaunchRequest,
    *,
    runtime: Path,
    image: str,
    shm_size_gib: int = 4,
    podman: bool = False,
) -> LaunchPlan:
    """The container plan of one vLLM generation (Docker, or Podman with ``podman``).

    Raises:
        EngineError: ``engine_blocked`` for an image without an immutable digest or a bad
            shm size; ``engine_incompatible`` and ``artifact_not_ready`` as for every launch.
    """
    if not _IMAGE_RE.match(image):
        raise EngineError(
            f"container image {image!r} is not pinned by digest (<repository>@sha256:<64 hex>)",
            code="engine_blocked",
            remediation="Use the image's immutable digest; tags such as :latest can change.",
        )
    if not 1 <= shm_size_gib <= 1024:
        raise EngineError("shm_size_gib must be between 1 and 1024", code="engine_blocked")
    _check_vllm_request(request)
    snapshot = str(request.snapshot)
    if "," in snapshot:
        raise EngineError("the snapshot path must not contain ','", code="artifact_not_ready")
    devices = ",".join(str(d) for d in request.devices)
    argv = [
        str(runtime), "run", "--rm",
        "--name", f"sbproxy-{request.deployment}-g{request.generation}",
        "--network", CONTAINER_NETWORK,
    ]  # fmt: skip
    if podman:
        for device in request.devices:
            argv += ["--device", f"nvidia.com/gpu={device}"]
    else:
        argv += ["--gpus", f'"device={devices}"']
    argv += [
        "--shm-size", f"{shm_size_gib}g",
        "--mount", f"type=bind,src={snapshot},dst={CONTAINER_MODEL_DIR},readonly",
        "-p", f"127.0.0.1:{request.port}:8000",
        image,
        *_serve_flags(request, host="0.0.0.0", port=8000, model=CONTAINER_MODEL_DIR),  # noqa: S104 - inside the container's private network; published on loopback only
    ]  # fmt: skip
    return LaunchPlan(argv=tuple(argv), env=minimal_env(), health_path="/health", port=request.port)


def network_create_argv(runtime: Path) -> tuple[str, ...]:
    """Creates the private network containers run on (no route out)."""
    return (
        str(runtime),
        "network",
        "create",
        "--driver",
        "bridge",
        "--internal",
        CONTAINER_NETWORK,
    )


def compat_probe_argv(uv: Path, *, version: str) -> tuple[str, ...]:
    """Runs :data:`PROBE_SCRIPT` in an isolated environment with ``vllm==<version>``."""
    return (
        str(uv), "run", "--isolated", "--no-project", "--with", f"vllm=={version}",
        "python", "-c", PROBE_SCRIPT,
    )  # fmt: skip


@dataclass(frozen=True)
class CompatVerdict:
    """Whether the pinned environment can run vLLM on this worker."""

    compatible: bool
    reason: str
    remediation: str | None = None
    versions: Mapping[str, str | None] | None = None


def worker_verdict(
    accelerator: str, compute_capability: tuple[int, int] | None
) -> CompatVerdict | None:
    """Why this worker cannot run vLLM at all, or ``None`` when it can."""
    if accelerator != "cuda":
        return CompatVerdict(False, "vLLM needs a CUDA worker", "Use llama_cpp on this worker.")
    if compute_capability is None or compute_capability < _MIN_COMPUTE_CAPABILITY:
        return CompatVerdict(
            False,
            f"vLLM needs compute capability 7.0 or newer (worker: {compute_capability})",
            "Use llama_cpp, or a newer GPU.",
        )
    return None


def detect_vllm(
    config: EngineConfig | None,
    *,
    accelerator: str,
    compute_capability: tuple[int, int] | None,
    environ: Mapping[str, str] | None = None,
) -> Detection:
    """Whether vLLM can run here (``incompatible`` on a non-CUDA worker)."""
    config = config or EngineConfig(launch="uv")
    worker = worker_verdict(accelerator, compute_capability)
    if worker is not None:
        return Detection(KIND, Availability.INCOMPATIBLE, worker.reason, worker.remediation)
    search = environ.get("PATH") if environ is not None else None
    version = config.version or DEFAULT_VERSION
    if config.launch == "container":
        runtime = shutil.which("docker", path=search) or shutil.which("podman", path=search)
        if runtime is None:
            return Detection(
                KIND,
                Availability.BLOCKED,
                "no docker or podman found",
                "Install a container runtime, or use launch: uv.",
                source="container",
            )
        return Detection(
            KIND,
            Availability.ACQUIRABLE,
            f"image {config.image} via {runtime}",
            source="container",
            executable=runtime,
        )
    if config.launch == "uv":
        uv = shutil.which("uv", path=search)
        return Detection(
            KIND,
            Availability.ACQUIRABLE,
            f"vllm=={version} in a pinned uv environment",
            None if uv else "Install uv (pip install uv) to provision vLLM.",
            source="uv",
            executable=uv,
            version=version,
        )
    executable = shutil.which("vllm", path=search)
    if executable is None:
        return Detection(
            KIND, Availability.BLOCKED, "vllm is not on PATH", "Use launch: uv.", source="PATH"
        )
    return Detection(
        KIND, Availability.AVAILABLE, "vllm found on PATH", source="PATH", executable=executable
    )


def judge_compat(
    output: str,
    *,
    version: str,
    accelerator: str,
    compute_capability: tuple[int, int] | None,
) -> CompatVerdict:
    """Read the probe's JSON and decide (bounded remediation, never a fallback)."""
    worker = worker_verdict(accelerator, compute_capability)
    if worker is not None:
        return worker
    try:
        found = json.loads(output.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return CompatVerdict(
            False, "the compatibility probe printed no result", "Inspect `uv` and its cache."
        )
    versions = {k: found.get(k) for k in ("python", "torch", "cuda", "vllm")}
    if found.get("vllm") != version:
        return CompatVerdict(
            False,
            f"the environment has vllm {found.get('vllm')}, not the pinned {version}",
            f"Recreate the environment: uv tool install vllm=={version}.",
            versions,
        )
    if not found.get("torch") or not found.get("cuda"):
        return CompatVerdict(
            False,
            "torch with CUDA support is missing from the environment",
            "Reinstall the pinned vLLM, whose wheel pulls a CUDA build of torch.",
            versions,
        )
    if found.get("cuda_available") is False:
        return CompatVerdict(
            False,
            f"torch {found['torch']} (CUDA {found['cuda']}) sees no GPU",
            "Check the NVIDIA driver version against torch's CUDA build.",
            versions,
        )
    return CompatVerdict(True, "compatible", None, versions)
