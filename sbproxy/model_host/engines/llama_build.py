"""The ``engine_build`` workflow: build ``llama-server`` from a pinned source archive.

Steps (a durable job; the idempotency key is the build identity):

1. ``archive`` -- hash the archive (a local file) and refuse it unless its SHA-256 equals the
   pin: a source without a digest is never built.
2. ``build`` -- in a fresh work directory named after the job and attempt, extract only the
   members under the archive's path prefix (``tarfile``'s ``data`` filter refuses absolute
   paths, ``..``, links out of the tree and device files), configure with CMake and build
   the ``llama-server`` and ``ggml-rpc-server`` targets. A crash anywhere in here reruns
   the whole step from a clean directory: a half-built tree is never reused or published.
3. ``publish`` -- run the built binary's ``--version``; only if it answers, copy ``build/bin``
   (the binary links shared libraries that live beside it) into a staging directory, write
   ``build.json`` and rename it to ``engines/llama.cpp/<identity>/``.

The build identity is the first 16 hex characters of the SHA-256 of the archive digest, the
path prefix, the acceleration, the CMake flags and :data:`RECIPE_VERSION`, so a change to any
of them builds into a new directory and never overwrites a published engine.

CMake flags (measured here: 6.5 minutes on 2 cores for the CPU build): ``-DCMAKE_BUILD_TYPE=
Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
-DBUILD_SHARED_LIBS=ON -DGGML_RPC=ON``. ``GGML_RPC`` (recipe 3) adds ggml's RPC backend, so
one build holds both halves of a model split over hosts (``engines/rpc.py``): the
``ggml-rpc-server`` a worker runs, and the ``--rpc`` option of the leader's ``llama-server``.
Nothing changes for a ``llama-server`` started without ``--rpc``. A CPU build keeps
llama.cpp's default ``GGML_NATIVE=ON`` (it runs on the machine that built it); CUDA adds
``-DGGML_CUDA=ON -DGGML_NATIVE=OFF`` (reference 4.4).

On x86-64 a CPU build also compiles without Intel AMX (``-mno-amx-tile -mno-amx-int8
-mno-amx-bf16`` in the C and C++ flags, recipe 2). ``-march=native`` turns AMX on wherever the
CPU advertises it, and virtual machines advertise it without running it: on a Firecracker guest
on a Sapphire Rapids host the first matrix product of SmolLM2 Q4_1 died in ``ldtilecfg``
(SIGSEGV, or SIGILL) though ``arch_prctl(ARCH_REQ_XCOMP_PERM)`` granted the tile state. The
AVX-512 paths stay; AMX only speeds up large prompt batches.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import tarfile
from pathlib import Path, PurePosixPath

import anyio
import anyio.to_thread
from pydantic import BaseModel, ConfigDict, Field

from sbproxy.model_host.artifacts import ArtifactCache, CacheLayout
from sbproxy.model_host.artifacts.download import hash_file
from sbproxy.model_host.artifacts.locks import hold
from sbproxy.model_host.engines.archives import extract_safely
from sbproxy.model_host.engines.errors import EngineError
from sbproxy.model_host.engines.process import minimal_env
from sbproxy.model_host.registry import registry
from sbproxy.workflows import StepContext, WorkflowContext, step

__all__ = [
    "RECIPE_VERSION",
    "RPC_SERVER",
    "BuildInput",
    "BuildOutput",
    "build_identity",
    "cmake_flags",
    "engine_build_workflow",
    "published_build",
    "read_version",
    "version_of",
]

RECIPE_VERSION = 3
# The RPC worker the build makes beside llama-server (``GGML_RPC=ON``).
RPC_SERVER = "ggml-rpc-server"
_X86_64 = frozenset({"x86_64", "amd64"})
_PERCENT_RE = re.compile(rb"^\[\s*(\d+)%\]")


class BuildInput(BaseModel):
    """What to build (the archive is a local file; fetch remote archives first)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    archive: str = Field(description="Absolute path of the source archive (tar.gz).")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Pinned SHA-256 of the archive.")
    strip_prefix: str = Field(default="", description="Directory of the llama.cpp tree inside.")
    acceleration: str = Field(default="cpu", description="cpu or cuda.")
    jobs: int = Field(default=0, ge=0, description="Parallel compile jobs; 0: CPU count.")


class BuildOutput(BaseModel):
    """A published build."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    identity: str
    directory: str
    executable: str
    version: str
    rpc_server: str | None = Field(
        default=None,
        description="The build's ggml-rpc-server (recipe 3 and later); None for older builds.",
    )


class BuildTree(BaseModel):
    """Output of ``build``: where the fresh binary is."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    work_dir: str
    bin_dir: str


def cmake_flags(acceleration: str) -> tuple[str, ...]:
    """The configure flags of a build."""
    flags = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DBUILD_SHARED_LIBS=ON",
        "-DGGML_RPC=ON",
    ]
    if acceleration == "cuda":
        # A CUDA build may run on other GPUs of the fleet: no host-specific CPU code.
        flags += ["-DGGML_CUDA=ON", "-DGGML_NATIVE=OFF"]
    elif platform.machine().lower() in _X86_64:
        # -march=native would enable AMX where a VM advertises it but cannot run it (above).
        no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        flags += [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"]
    return tuple(flags)


def build_identity(request: BuildInput) -> str:
    """Directory name of a build (see the module docstring)."""
    material = json.dumps(
        {
            "sha256": request.sha256,
            "strip_prefix": request.strip_prefix.strip("/"),
            "acceleration": request.acceleration,
            "flags": cmake_flags(request.acceleration),
            "recipe": RECIPE_VERSION,
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(material.encode()).hexdigest()[:16]
    return f"src-{request.acceleration}-{digest}"


def published_build(layout: CacheLayout, identity: str) -> BuildOutput | None:
    """The published build ``identity``, if its marker and binary are present."""
    directory = layout.engines / "llama.cpp" / identity
    try:
        marker = json.loads((directory / "build.json").read_bytes())
        output = BuildOutput.model_validate({k: marker.get(k) for k in BuildOutput.model_fields})
    except (OSError, ValueError):
        return None
    return output if Path(output.executable).is_file() else None


@step("archive")
async def check_archive(ctx: StepContext, request: BuildInput) -> str:
    """Verify the archive against its pin.

    Idempotency: reads only.
    """
    path = Path(request.archive)
    if not path.is_absolute() or not path.is_file():
        raise EngineError(
            f"source archive {request.archive} is not an absolute path to a file",
            code="engine_provision_failed",
        )
    sha, _ = await anyio.to_thread.run_sync(hash_file, path)
    digest = str(sha.hexdigest())
    if digest != request.sha256:
        raise EngineError(
            f"source archive {path} has SHA-256 {digest}, not the pinned {request.sha256}",
            code="engine_blocked",
            remediation="Use the archive the pin names, or pin this archive's digest.",
        )
    return digest


def _extract(archive: Path, prefix: str, target: Path) -> None:
    prefix_path = PurePosixPath(prefix.strip("/")) if prefix.strip("/") else None
    with tarfile.open(archive, "r:*") as bundle:
        members = []
        for member in bundle.getmembers():
            name = PurePosixPath(member.name)
            if prefix_path is not None:
                if name == prefix_path or prefix_path not in name.parents:
                    continue
                member.name = str(name.relative_to(prefix_path))
            members.append(member)
        if not members:
            raise EngineError(
                f"{archive} has nothing under {prefix!r}", code="engine_provision_failed"
            )
        extract_safely(archive, bundle, target, members)


async def _run_logged(argv: list[str], *, log: Path, ctx: StepContext, cwd: Path) -> None:
    """Run a build command (no shell, minimal environment), logging its output and turning
    CMake's ``[ NN%]`` lines into progress."""
    with log.open("ab") as sink:
        process = await anyio.open_process(
            argv, cwd=cwd, env=minimal_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        async with process:
            assert process.stdout is not None  # noqa: S101 - requested above
            buffer = b""
            async for chunk in process.stdout:
                sink.write(chunk)
                buffer = (buffer + chunk)[-4096:]
                for line in chunk.splitlines():
                    match = _PERCENT_RE.match(line)
                    if match:
                        await ctx.report_progress(
                            done=int(match.group(1)), total=100, unit="percent", current="build"
                        )
                ctx.check_cancelled()
            await process.wait()
    if process.returncode != 0:
        tail = log.read_bytes()[-3000:].decode("utf-8", "replace")
        raise EngineError(
            f"{argv[0]} {argv[1] if len(argv) > 1 else ''} failed with status "
            f"{process.returncode}; see {log}\n{tail}",
            code="engine_provision_failed",
        )


@step("build")
async def build_tree(ctx: StepContext, request: BuildInput) -> BuildTree:
    """Extract, configure and compile in a fresh directory.

    Idempotency: the work directory is removed and rebuilt from scratch on every run, so
    a crash mid-build never leaves a half tree that a later run would trust.
    """
    layout = ctx.resource(ArtifactCache).layout
    identity = build_identity(request)
    existing = published_build(layout, identity)
    if existing is not None:  # published meanwhile (another job, or before a crash)
        return BuildTree(work_dir="", bin_dir=existing.directory)
    work = layout.engines / "staging" / f"build-{identity}-{ctx.job_id}"
    shutil.rmtree(work, ignore_errors=True)
    source = work / "src"
    build = work / "build"
    source.mkdir(parents=True)
    log = work / "build.log"
    async with hold(layout.engines / "locks" / f"llama-build-{identity}.lock", timeout_s=7200):
        await anyio.to_thread.run_sync(
            _extract, Path(request.archive), request.strip_prefix, source
        )
        for tool in ("cmake", "c++"):
            if shutil.which(tool) is None:
                raise EngineError(
                    f"{tool} is not installed; a source build needs CMake and a C++ compiler",
                    code="engine_blocked",
                    remediation="Install cmake and g++ (Debian: apt-get install cmake g++).",
                )
        await _run_logged(
            ["cmake", "-S", str(source), "-B", str(build), *cmake_flags(request.acceleration)],
            log=log,
            ctx=ctx,
            cwd=work,
        )
        jobs = request.jobs or os.cpu_count() or 2
        await _run_logged(
            [
                "cmake",
                "--build",
                str(build),
                "--target",
                "llama-server",
                RPC_SERVER,
                "-j",
                str(jobs),
            ],
            log=log,
            ctx=ctx,
            cwd=work,
        )
    return BuildTree(work_dir=str(work), bin_dir=str(build / "bin"))


def read_version(executable: Path) -> str | None:
    """The ``version`` line of ``<executable> --version``, or ``None`` if it does not answer.

    The binary's own directory goes on ``LD_LIBRARY_PATH``: llama.cpp builds link the shared
    ``libllama``/``libggml`` that sit beside the executable.
    """
    try:
        done = subprocess.run(  # noqa: S603 - an operator-approved or freshly built binary
            [str(executable), "--version"],
            capture_output=True,
            text=True,
            timeout=60,
            env=minimal_env({"LD_LIBRARY_PATH": str(executable.parent)}),
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (done.stdout + done.stderr).strip()
    if done.returncode != 0 or "version" not in text.lower():
        return None
    return next((line for line in text.splitlines() if "version" in line.lower()), text)


def version_of(executable: Path) -> str:
    """:func:`read_version` of a freshly built or unpacked binary, which must answer.

    Raises:
        EngineError: ``engine_provision_failed`` when it does not.
    """
    version = read_version(executable)
    if version is None:
        raise EngineError(
            f"the new {executable.name} does not answer --version; see its build or archive",
            code="engine_provision_failed",
        )
    return version


@step("publish")
async def publish_build(ctx: StepContext, request: BuildInput) -> BuildOutput:
    """Check the binary answers ``--version`` and publish its directory atomically.

    Idempotency: an already published identity is returned as is.
    """
    layout = ctx.resource(ArtifactCache).layout
    identity = build_identity(request)
    existing = published_build(layout, identity)
    if existing is not None:
        return existing
    work = layout.engines / "staging" / f"build-{identity}-{ctx.job_id}"
    built = work / "build" / "bin" / "llama-server"
    if not built.is_file():
        raise EngineError(f"{built} was not produced", code="engine_provision_failed")
    version = await anyio.to_thread.run_sync(version_of, built)
    final = layout.engines / "llama.cpp" / identity
    staging = layout.engines / "llama.cpp" / f".staging-{identity}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    await anyio.to_thread.run_sync(lambda: shutil.copytree(built.parent, staging, symlinks=True))
    rpc_server = final / RPC_SERVER if (built.parent / RPC_SERVER).is_file() else None
    output = BuildOutput(
        identity=identity,
        directory=str(final),
        executable=str(final / "llama-server"),
        version=version,
        rpc_server=None if rpc_server is None else str(rpc_server),
    )
    marker = {
        **output.model_dump(),
        "archive_sha256": request.sha256,
        "strip_prefix": request.strip_prefix,
        "acceleration": request.acceleration,
        "cmake_flags": list(cmake_flags(request.acceleration)),
        "recipe": RECIPE_VERSION,
    }
    (staging / "build.json").write_text(json.dumps(marker, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)  # an unpublished leftover without a valid marker
    staging.rename(final)
    shutil.rmtree(work, ignore_errors=True)
    return output


@step("lookup")
async def lookup_build(ctx: StepContext, request: BuildInput) -> BuildOutput | None:
    """An already published build of this identity, if any.

    Idempotency: reads only.
    """
    return published_build(ctx.resource(ArtifactCache).layout, build_identity(request))


@registry.workflow("engine_build", version=1)
async def engine_build_workflow(ctx: WorkflowContext, request: BuildInput) -> BuildOutput:
    """Build and publish llama-server from a pinned source archive (reuses a published one)."""
    existing = await ctx.step(lookup_build, request)
    if existing is not None:
        return existing
    await ctx.step(check_archive, request)
    await ctx.step(build_tree, request)
    return await ctx.step(publish_build, request)
