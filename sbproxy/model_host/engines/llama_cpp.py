"""The llama.cpp driver: find or acquire ``llama-server``, and plan its launch.

Acquisition order (reference 4.4 and 8.1):

1. an explicit ``engines.llama_cpp.path`` -- the operator's allowlist; with ``sha256`` the
   executable must match it;
2. a ``llama-server`` on ``PATH`` (its ``--version`` is read);
3. a build published earlier in ``<cache>/engines/llama.cpp/<identity>/``;
4. pinned acquisition: a source build of ``engines.llama_cpp.source`` (an archive with a
   SHA-256 pin), else a release archive with a per-platform SHA-256 pin (b9905). A custom
   version without a digest is refused: nothing unpinned is ever fetched or built.

Launch argv: ``--model <the one .gguf of the verified snapshot> --host 127.0.0.1 --port P
--ctx-size N --parallel C --n-gpu-layers 0|999`` plus ``--split-mode row --tensor-split 1,..``
across several CUDA devices (``CUDA_VISIBLE_DEVICES`` lists them), ``--cache-type-k/-v
q8_0|q4_0`` for a quantised KV cache, ``--threads T`` when the runtime splits the CPU, and
the allowlisted ``extra_args``. Never ``--hf-repo``/``--hf-file``.
"""

from __future__ import annotations

import os
import platform
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sbproxy.config import EngineConfig, check_engine_args
from sbproxy.model_host.artifacts import CacheLayout
from sbproxy.model_host.artifacts.download import hash_file
from sbproxy.model_host.engines.driver import (
    Availability,
    Detection,
    LaunchPlan,
    LaunchRequest,
    check_snapshot,
)
from sbproxy.model_host.engines.errors import EngineError
from sbproxy.model_host.engines.llama_build import BuildOutput, published_build, read_version
from sbproxy.model_host.engines.process import minimal_env
from sbproxy.model_host.engines.rpc import rpc_argv

__all__ = [
    "DEFAULT_TAG",
    "RELEASE_PINS",
    "ReleasePin",
    "detect_llama_cpp",
    "plan_llama_launch",
    "read_version",
    "release_pin_for",
]

KIND = "llama_cpp"
DEFAULT_TAG = "b9905"
ALL_GPU_LAYERS = 999
_KV_TYPES = {"int8": "q8_0", "fp8": "q8_0", "int4": "q4_0"}


@dataclass(frozen=True)
class ReleasePin:
    """One pinned llama.cpp release archive."""

    tag: str
    infix: str
    sha256: str

    @property
    def url(self) -> str:
        """Where the archive is published."""
        return (
            "https://github.com/ggml-org/llama.cpp/releases/download/"
            f"{self.tag}/llama-{self.tag}-bin-{self.infix}.tar.gz"
        )


# Per-platform SHA-256 pins of the release archives (reference section 4.4).
RELEASE_PINS: tuple[ReleasePin, ...] = (
    ReleasePin(
        "b9905", "macos-arm64", "0d3deb02fd7912c8ef360fa33b3b4a8c97967a3ac703c0ed7d5edd3680723ea8"
    ),
    ReleasePin(
        "b9905", "macos-x64", "5910cec4ce883d0ddef39974a54a5c9569c4c8b3d13b5e79dfcb32ffda19e44e"
    ),
    ReleasePin(
        "b9905", "ubuntu-x64", "69f1496c1eda919097668db49e529819e4eda9e8e3d504f90c680fed3587f5b0"
    ),
    ReleasePin(
        "b9905",
        "ubuntu-vulkan-x64",
        "81492d7844bcb40c4c025b826dced6b3faa6e484863482d6bd255c84db53bd55",
    ),
    ReleasePin(
        "b9415", "macos-arm64", "edf417cd8dd148fd423ea758953caa43376df98d8f027b7748ea0399a9a8023f"
    ),
    ReleasePin(
        "b9415", "macos-x64", "7c07ab8bb59e249340ed15afe03d5f164521242942a406661d6c499efc186a84"
    ),
)


def release_pin_for(
    tag: str, *, system: str, machine: str, acceleration: str, sha256: str | None = None
) -> ReleasePin | None:
    """The pinned release archive for this platform, or ``None`` (Linux CUDA has none).

    ``sha256`` (``engines.llama_cpp.sha256``) pins a tag the built-in table does not know;
    without it only the built-in pins count.
    """
    if system == "Linux" and machine in ("x86_64", "AMD64"):
        if acceleration == "cuda":
            return None
        infix = "ubuntu-vulkan-x64" if acceleration == "vulkan" else "ubuntu-x64"
    elif system == "Darwin":
        infix = "macos-arm64" if machine == "arm64" else "macos-x64"
    else:
        return None
    if sha256 is not None:
        return ReleasePin(tag, infix, sha256)
    return next((p for p in RELEASE_PINS if p.tag == tag and p.infix == infix), None)


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _published(layout: CacheLayout) -> list[BuildOutput]:
    root = layout.engines / "llama.cpp"
    if not root.is_dir():
        return []
    found = [published_build(layout, child.name) for child in sorted(root.iterdir())]
    return [build for build in found if build is not None]


def _from_config_path(config: EngineConfig) -> Detection | None:
    if config.launch != "binary":
        return Detection(
            KIND,
            Availability.BLOCKED,
            "llama.cpp only runs as a native binary",
            "Set engines.llama_cpp.launch: binary.",
        )
    if config.path is None:
        return None
    path = Path(config.path)
    if not _executable(path):
        return Detection(
            KIND,
            Availability.BLOCKED,
            f"configured path {path} is not an executable file",
            "Point engines.llama_cpp.path at llama-server, or remove it.",
            source="path",
        )
    if config.sha256 is not None and hash_file(path)[0].hexdigest() != config.sha256:
        return Detection(
            KIND,
            Availability.BLOCKED,
            f"configured path {path} does not match its sha256 pin",
            "Install the pinned build or update engines.llama_cpp.sha256.",
            source="path",
        )
    return Detection(
        KIND,
        Availability.AVAILABLE,
        "configured executable",
        source="path",
        executable=str(path),
        version=read_version(path),
    )


def _installed(
    config: EngineConfig, layout: CacheLayout, environ: Mapping[str, str] | None
) -> Detection | None:
    search = environ.get("PATH") if environ is not None else None
    on_path = shutil.which("llama-server", path=search)
    if on_path is not None and config.acceleration != "cuda":
        version = read_version(Path(on_path))
        if version is not None:
            return Detection(
                KIND,
                Availability.AVAILABLE,
                "llama-server found on PATH",
                source="PATH",
                executable=on_path,
                version=version,
            )
    wanted = ("src-cuda-",) if config.acceleration == "cuda" else ("src-cpu-", "release-")
    for build in _published(layout):
        if build.identity.startswith(wanted):
            return Detection(
                KIND,
                Availability.AVAILABLE,
                "built from a pinned source archive",
                source="cache",
                executable=build.executable,
                version=build.version,
            )
    return None


def _acquisition(config: EngineConfig, *, system: str, machine: str) -> Detection:
    if config.source is not None:
        return Detection(
            KIND,
            Availability.ACQUIRABLE,
            f"will build from the pinned source archive (sha256 {config.source.sha256[:12]}...)",
            "Run `sbproxy engines build llama_cpp` ahead of time to avoid a build at startup.",
            source="source_build",
        )
    tag = config.version or DEFAULT_TAG
    pin = release_pin_for(
        tag,
        system=system,
        machine=machine,
        acceleration=config.acceleration,
        sha256=config.sha256,
    )
    if pin is None:
        cuda = " (Linux CUDA builds from source)" if config.acceleration == "cuda" else ""
        return Detection(
            KIND,
            Availability.BLOCKED,
            f"no pinned llama.cpp {tag} archive exists for this platform{cuda}",
            "Configure engines.llama_cpp.source (archive + sha256 + strip_prefix) or "
            "engines.llama_cpp.path.",
        )
    return Detection(
        KIND,
        Availability.ACQUIRABLE,
        f"pinned release {tag} can be downloaded and verified",
        source="release",
    )


def detect_llama_cpp(
    config: EngineConfig | None,
    *,
    layout: CacheLayout,
    environ: Mapping[str, str] | None = None,
    system: str | None = None,
    machine: str | None = None,
) -> Detection:
    """Say whether llama-server can run here, and how it would be obtained (module doc)."""
    config = config or EngineConfig()
    return (
        _from_config_path(config)
        or _installed(config, layout, environ)
        or _acquisition(
            config, system=system or platform.system(), machine=machine or platform.machine()
        )
    )


def _offloaded_layers(request: LaunchRequest) -> str:
    """``--n-gpu-layers``: none on this host's CPU alone, all onto GPUs or RPC workers."""
    if request.accelerator == "cpu" and not request.rpc_servers:
        return "0"
    return str(ALL_GPU_LAYERS)


def plan_llama_launch(request: LaunchRequest, *, executable: Path) -> LaunchPlan:
    """The argv and environment of one llama-server generation.

    Raises:
        EngineError: ``artifact_not_ready`` (not exactly one .gguf, or not verified),
            ``engine_incompatible`` (format or devices), ``unsafe_argument``.
    """
    check_snapshot(request)
    if request.metadata.format != "gguf":
        raise EngineError(
            f"llama.cpp serves GGUF, not {request.metadata.format}", code="engine_incompatible"
        )
    ggufs = [item.path for item in request.metadata.files if item.path.endswith(".gguf")]
    if len(ggufs) != 1:
        raise EngineError(
            f"a llama.cpp artifact needs exactly one .gguf file, found {len(ggufs)}",
            code="artifact_not_ready",
        )
    problems = check_engine_args("llama_cpp", request.extra_args)
    if problems:
        raise EngineError(
            "; ".join(message for _, message in problems),
            code="unsafe_argument",
            remediation="Remove the flag from extra_args; the runtime sets it itself.",
        )
    argv = [
        str(executable),
        "--model", str(request.snapshot / ggufs[0]),
        "--host", "127.0.0.1",
        "--port", str(request.port),
        "--ctx-size", str(request.ctx_size),
        "--parallel", str(request.max_concurrency),
        "--n-gpu-layers", _offloaded_layers(request),
    ]  # fmt: skip
    # A split: every layer goes to the RPC workers (their devices), none stays here.
    argv += rpc_argv(request.rpc_servers)
    if request.accelerator == "cuda" and len(request.devices) > 1:
        argv += ["--split-mode", "row", "--tensor-split", ",".join("1" for _ in request.devices)]
    cache_type = _KV_TYPES.get(request.kv_quant)
    if cache_type:
        argv += ["--cache-type-k", cache_type, "--cache-type-v", cache_type]
    if request.chat_template:
        argv += ["--chat-template", request.chat_template]
    if request.threads is not None:
        argv += ["--threads", str(request.threads)]
    argv += list(request.extra_args)
    env = minimal_env({"LD_LIBRARY_PATH": str(executable.parent)})
    if request.accelerator == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in request.devices)
    return LaunchPlan(argv=tuple(argv), env=env, health_path="/health", port=request.port)
