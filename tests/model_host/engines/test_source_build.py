"""The engine_build workflow on a tiny CMake project shaped like llama.cpp's tree.

The real llama.cpp build (minutes) runs in the end-to-end suite; here the same pipeline --
pin check, safe extraction, CMake configure and build of the ``llama-server`` target,
``--version`` check, atomic publish -- runs on a project that compiles in seconds.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from sbproxy.model_host.artifacts import ArtifactCache, CacheLayout
from sbproxy.model_host.engines import BuildInput, build_identity, engine_build_workflow
from sbproxy.model_host.flows import registry
from sbproxy.store import JobStatus
from sbproxy.workflows import WorkflowEngine

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

PREFIX = "tiny-1.0/llama.cpp"
CMAKE = """cmake_minimum_required(VERSION 3.16)
project(tiny CXX)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
add_executable(llama-server main.cpp)
# As llama.cpp's: the RPC worker only with GGML_RPC (the recipe turns it on).
option(GGML_RPC "RPC backend" OFF)
if (GGML_RPC)
  add_executable(ggml-rpc-server main.cpp)
endif()
"""
MAIN = """#include <cstdio>
#include <cstring>
int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--version") == 0) {
    std::puts("version: 42 (tiny)");
    return 0;
  }
  return 1;
}
"""


def make_archive(path: Path, *, extra: dict[str, bytes] | None = None) -> str:
    members = {f"{PREFIX}/CMakeLists.txt": CMAKE.encode(), f"{PREFIX}/main.cpp": MAIN.encode()}
    members["tiny-1.0/README"] = b"outside the prefix: not extracted\n"
    members.update(extra or {})
    with tarfile.open(path, "w:gz") as bundle:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            bundle.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def build(root: Path, request: BuildInput) -> tuple[JobStatus, dict[str, object] | None, str]:
    status, output, code, _ = await build_with_steps(root, request)
    return status, output, code


async def build_with_steps(
    root: Path, request: BuildInput
) -> tuple[JobStatus, dict[str, object] | None, str, list[str]]:
    cache = ArtifactCache(CacheLayout(root=root))
    engine = await WorkflowEngine.open(cache.layout.journal, registry, resources=[cache])
    try:
        submitted = await engine.submit(
            engine_build_workflow, request, idempotency_key=build_identity(request)
        )
        job = await engine.join(submitted.job.id)
        steps = [step.name for step in await engine.steps(job.id)]
        return job.status, job.output, job.error.code if job.error else "", steps
    finally:
        await engine.close()


async def test_builds_verifies_and_publishes_atomically(tmp_path: Path) -> None:
    archive = tmp_path / "src.tar.gz"
    digest = make_archive(archive)
    request = BuildInput(archive=str(archive), sha256=digest, strip_prefix=PREFIX, jobs=2)
    status, output, _ = await build(tmp_path / "cache", request)
    assert status == JobStatus.SUCCEEDED
    assert output is not None
    executable = Path(str(output["executable"]))
    assert executable.parent == tmp_path / "cache" / "engines" / "llama.cpp" / build_identity(
        request
    )
    assert output["version"] == "version: 42 (tiny)"
    marker = json.loads((executable.parent / "build.json").read_text())
    assert marker["archive_sha256"] == digest
    assert "-DLLAMA_CURL=OFF" in marker["cmake_flags"]
    assert "-DGGML_RPC=ON" in marker["cmake_flags"]
    assert marker["rpc_server"] == str(Path(str(marker["directory"])) / "ggml-rpc-server")
    assert Path(str(marker["rpc_server"])).is_file()
    assert not list((tmp_path / "cache" / "engines" / "staging").iterdir())
    # A second build of the same identity reuses the published one: nothing is rebuilt.
    again_status, again, _, steps = await build_with_steps(tmp_path / "cache", request)
    assert again_status == JobStatus.SUCCEEDED
    assert again == output
    assert steps == ["lookup"]


async def test_an_archive_not_matching_its_pin_is_refused(tmp_path: Path) -> None:
    archive = tmp_path / "src.tar.gz"
    make_archive(archive)
    request = BuildInput(archive=str(archive), sha256="0" * 64, strip_prefix=PREFIX)
    status, _, code = await build(tmp_path / "cache", request)
    assert status == JobStatus.FAILED
    assert code == "engine_blocked"
    assert not (tmp_path / "cache" / "engines" / "llama.cpp").exists()


async def test_unsafe_archive_members_are_refused(tmp_path: Path) -> None:
    archive = tmp_path / "src.tar.gz"
    digest = make_archive(archive, extra={f"{PREFIX}/../../../escape.txt": b"boom"})
    request = BuildInput(archive=str(archive), sha256=digest, strip_prefix=PREFIX)
    status, _, code = await build(tmp_path / "cache", request)
    assert status == JobStatus.FAILED
    assert code in ("engine_blocked", "engine_provision_failed")
    assert not (tmp_path / "escape.txt").exists()
    assert not any(p.name == "escape.txt" for p in tmp_path.rglob("*"))


@pytest.mark.parametrize("when", ["after", "committed"])
def test_a_build_killed_mid_way_restarts_cleanly(tmp_path: Path, when: str) -> None:
    archive = tmp_path / "src.tar.gz"
    digest = make_archive(archive)
    cache = tmp_path / "cache"
    command = [
        sys.executable,
        "-m",
        "sbproxy.cli",
        "engines",
        "build",
        "llama_cpp",
        "--source-archive",
        str(archive),
        "--sha256",
        digest,
        "--strip",
        PREFIX,
        "--cache-dir",
        str(cache),
        "--format",
        "json",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SBPROXY_FAULT")}
    killed = subprocess.run(
        command,
        env={**env, "SBPROXY_FAULT_POINTS": f"step:build:{when}"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    published = cache / "engines" / "llama.cpp"
    assert not published.exists() or not [
        p for p in published.iterdir() if not p.name.startswith(".")
    ]
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["version"] == "version: 42 (tiny)"
    assert Path(result["executable"]).is_file()
    jobs = subprocess.run(
        [
            sys.executable,
            "-m",
            "sbproxy.cli",
            "jobs",
            "show",
            result["job_id"],
            "--cache-dir",
            str(cache),
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    steps = json.loads(jobs.stdout)["steps"]
    # Killed after the build but before its output was journaled, the build runs again;
    # killed once it was journaled, the resumed job replays it. Its output commits with the
    # start of publish (one commit per step), so then publish, which never ran, begins again.
    assert [(s["name"], s["attempts"]) for s in steps] == [
        ("lookup", 1),
        ("archive", 1),
        ("build", 2 if when == "after" else 1),
        ("publish", 2 if when == "committed" else 1),
    ]
