"""llama.cpp driver: acquisition order, pins, argv construction and the allowlist."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from sbproxy.config import EngineConfig, SourceArchiveConfig
from sbproxy.model_host.artifacts import CacheLayout
from sbproxy.model_host.engines import (
    Availability,
    EngineError,
    LaunchRequest,
    detect_llama_cpp,
    plan_llama_launch,
)
from sbproxy.model_host.engines.llama_cpp import release_pin_for
from tests.model_host.engines.support import fake_llama_server, verified_snapshot

SHA = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"


def layout(tmp_path: Path) -> CacheLayout:
    return CacheLayout(root=tmp_path / "cache")


def empty_path(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "empty-bin").mkdir(exist_ok=True)
    return {"PATH": str(tmp_path / "empty-bin")}


def test_configured_path_comes_first(tmp_path: Path) -> None:
    exe = fake_llama_server(tmp_path / "opt")
    on_path = fake_llama_server(tmp_path / "bin")
    found = detect_llama_cpp(
        EngineConfig(path=str(exe)), layout=layout(tmp_path), environ={"PATH": str(on_path.parent)}
    )
    assert found.availability == Availability.AVAILABLE
    assert found.source == "path"
    assert found.executable == str(exe)
    assert found.version is not None
    assert "fake" in found.version


def test_configured_path_must_be_executable_and_match_its_pin(tmp_path: Path) -> None:
    plain = tmp_path / "llama-server"
    plain.write_text("not executable")
    blocked = detect_llama_cpp(EngineConfig(path=str(plain)), layout=layout(tmp_path))
    assert blocked.availability == Availability.BLOCKED
    assert "not an executable" in blocked.reason
    exe = fake_llama_server(tmp_path / "opt")
    pinned = detect_llama_cpp(EngineConfig(path=str(exe), sha256="0" * 64), layout=layout(tmp_path))
    assert pinned.availability == Availability.BLOCKED
    assert "sha256 pin" in pinned.reason
    digest = hashlib.sha256(exe.read_bytes()).hexdigest()
    ok = detect_llama_cpp(EngineConfig(path=str(exe), sha256=digest), layout=layout(tmp_path))
    assert ok.availability == Availability.AVAILABLE


def test_path_lookup_then_published_build_then_pinned_acquisition(tmp_path: Path) -> None:
    exe = fake_llama_server(tmp_path / "bin")
    found = detect_llama_cpp(None, layout=layout(tmp_path), environ={"PATH": str(exe.parent)})
    assert (found.availability, found.source) == (Availability.AVAILABLE, "PATH")

    cache = layout(tmp_path)
    published = cache.engines / "llama.cpp" / "src-cpu-0123456789abcdef"
    built = fake_llama_server(published)
    (published / "build.json").write_text(
        json.dumps(
            {
                "identity": published.name,
                "directory": str(published),
                "executable": str(built),
                "version": "version: 1 (test)",
            }
        )
    )
    from_cache = detect_llama_cpp(None, layout=cache, environ=empty_path(tmp_path))
    assert (from_cache.availability, from_cache.source) == (Availability.AVAILABLE, "cache")
    assert from_cache.executable == str(built)

    fresh = layout(tmp_path / "other")
    release = detect_llama_cpp(
        None, layout=fresh, environ=empty_path(tmp_path), system="Linux", machine="x86_64"
    )
    assert (release.availability, release.source) == (Availability.ACQUIRABLE, "release")
    source = detect_llama_cpp(
        EngineConfig(source=SourceArchiveConfig(file="/src/llama.tar.gz", sha256=SHA)),
        layout=fresh,
        environ=empty_path(tmp_path),
    )
    assert (source.availability, source.source) == (Availability.ACQUIRABLE, "source_build")


def test_unpinned_acquisition_is_blocked(tmp_path: Path) -> None:
    cuda = detect_llama_cpp(
        EngineConfig(acceleration="cuda"),
        layout=layout(tmp_path),
        environ=empty_path(tmp_path),
        system="Linux",
        machine="x86_64",
    )
    assert cuda.availability == Availability.BLOCKED
    assert "builds from source" in cuda.reason
    custom = detect_llama_cpp(
        EngineConfig(version="b7000"),
        layout=layout(tmp_path),
        environ=empty_path(tmp_path),
        system="Linux",
        machine="x86_64",
    )
    assert custom.availability == Availability.BLOCKED
    assert custom.remediation is not None
    assert "sha256" in custom.remediation


def test_release_pins_per_platform() -> None:
    linux = release_pin_for("b9905", system="Linux", machine="x86_64", acceleration="cpu")
    assert linux is not None
    assert linux.sha256 == "69f1496c1eda919097668db49e529819e4eda9e8e3d504f90c680fed3587f5b0"
    assert linux.url.endswith("/b9905/llama-b9905-bin-ubuntu-x64.tar.gz")
    mac = release_pin_for("b9905", system="Darwin", machine="arm64", acceleration="metal")
    assert mac is not None
    assert mac.infix == "macos-arm64"
    assert release_pin_for("b9415", system="Linux", machine="x86_64", acceleration="cpu") is None


def request(tmp_path: Path, **overrides: object) -> LaunchRequest:
    metadata, snapshot = verified_snapshot(tmp_path, {"model.gguf": b"GGUF" + b"\0" * 64})
    fields: dict[str, object] = {
        "deployment": "local",
        "generation": 1,
        "metadata": metadata,
        "snapshot": snapshot,
        "port": 18080,
        "ctx_size": 2048,
        "max_concurrency": 2,
    }
    fields.update(overrides)
    return LaunchRequest(**fields)  # type: ignore[arg-type]


def test_cpu_argv_uses_the_verified_snapshot_only(tmp_path: Path) -> None:
    exe = tmp_path / "bin" / "llama-server"
    launch = request(tmp_path, extra_args=("--threads", "2", "--flash-attn"))
    plan = plan_llama_launch(launch, executable=exe)
    argv = list(plan.argv)
    assert argv[0] == str(exe)
    assert argv.count("--model") == 1
    assert argv[argv.index("--model") + 1] == str(launch.snapshot / "model.gguf")
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--port") + 1] == "18080"
    assert argv[argv.index("--ctx-size") + 1] == "2048"
    assert argv[argv.index("--parallel") + 1] == "2"
    assert argv[argv.index("--n-gpu-layers") + 1] == "0"
    assert argv[-3:] == ["--threads", "2", "--flash-attn"]
    assert not any(flag in argv for flag in ("--hf-repo", "--hf-file", "--cache-type-k"))
    assert "CUDA_VISIBLE_DEVICES" not in plan.env
    assert plan.env["LD_LIBRARY_PATH"] == str(exe.parent)


def test_cuda_argv_offloads_all_layers_and_quantises_the_kv_cache(tmp_path: Path) -> None:
    plan = plan_llama_launch(
        request(tmp_path, accelerator="cuda", devices=(2,), kv_quant="int4"),
        executable=Path("/x/llama-server"),
    )
    argv = list(plan.argv)
    assert argv[argv.index("--n-gpu-layers") + 1] == "999"
    assert argv[argv.index("--cache-type-k") + 1] == "q4_0"
    assert argv[argv.index("--cache-type-v") + 1] == "q4_0"
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "2"


@pytest.mark.parametrize(
    "flag", ["--host", "--port", "--model", "--hf-repo", "--api-key", "--ctx-size", "--mount"]
)
def test_runtime_owned_flags_are_unsafe(tmp_path: Path, flag: str) -> None:
    with pytest.raises(EngineError) as info:
        plan_llama_launch(request(tmp_path, extra_args=(flag, "x")), executable=Path("/x"))
    assert info.value.code == "unsafe_argument"
    assert info.value.remediation is not None


@pytest.mark.parametrize(
    ("files", "fmt", "code"),
    [
        ({"a.gguf": b"1", "b.gguf": b"2"}, "gguf", "artifact_not_ready"),
        ({"readme.txt": b"1"}, "gguf", "artifact_not_ready"),
        ({"model.safetensors": b"1"}, "safetensors", "engine_incompatible"),
    ],
)
def test_artifact_shape_is_checked(
    tmp_path: Path, files: dict[str, bytes], fmt: str, code: str
) -> None:
    metadata, snapshot = verified_snapshot(tmp_path, files, fmt=fmt)
    with pytest.raises(EngineError) as info:
        plan_llama_launch(
            request(tmp_path / "x", metadata=metadata, snapshot=snapshot), executable=Path("/x")
        )
    assert info.value.code == code


def test_only_a_verified_absolute_snapshot_launches(tmp_path: Path) -> None:
    launch = request(tmp_path)
    with pytest.raises(EngineError) as relative:
        plan_llama_launch(
            request(tmp_path / "r", snapshot=Path("snapshots/x")), executable=Path("/x")
        )
    assert relative.value.code == "artifact_not_ready"
    untrusted = launch.metadata.model_copy(update={"trust": "unverified"})
    with pytest.raises(EngineError) as info:
        plan_llama_launch(
            request(tmp_path / "u", metadata=untrusted, snapshot=launch.snapshot),
            executable=Path("/x"),
        )
    assert info.value.code == "artifact_not_ready"
    with pytest.raises(EngineError) as devices:
        plan_llama_launch(request(tmp_path / "d", devices=(0,)), executable=Path("/x"))
    assert devices.value.code == "engine_incompatible"
