"""vLLM launch plans (uv and container), the compatibility verdict, and a plan run through
a stand-in executable (a live vLLM needs a CUDA worker this machine does not have)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from sbproxy.config import EngineConfig
from sbproxy.model_host.engines import Availability, EngineError, LaunchRequest, launch
from sbproxy.model_host.engines.vllm import (
    compat_probe_argv,
    detect_vllm,
    gpu_memory_utilization,
    judge_compat,
    network_create_argv,
    plan_vllm_container,
    plan_vllm_uv,
)
from sbproxy.workflows import WorkerIdentity
from tests.model_host.engines.support import FAKE_SERVER, free_port, verified_snapshot

IMAGE = "vllm/vllm-openai@sha256:05a31dc4185b042e91f4d2183689ac8a87bd845713d5c3f987563c5899878271"
GIB = 1024**3


def request(tmp_path: Path, **overrides: object) -> LaunchRequest:
    metadata, snapshot = verified_snapshot(
        tmp_path, {"config.json": b"{}", "model.safetensors": b"\0" * 64}, fmt="safetensors"
    )
    fields: dict[str, object] = {
        "deployment": "big",
        "generation": 3,
        "metadata": metadata,
        "snapshot": snapshot,
        "port": 18123,
        "ctx_size": 8192,
        "max_concurrency": 4,
        "accelerator": "cuda",
        "devices": (1,),
        "gpu_memory_bytes": 20 * GIB,
        "device_memory_bytes": 80 * GIB,
    }
    fields.update(overrides)
    return LaunchRequest(**fields)  # type: ignore[arg-type]


def flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_uv_plan_bounds_concurrency_and_memory(tmp_path: Path) -> None:
    launch_request = request(tmp_path)
    plan = plan_vllm_uv(
        launch_request, uv=Path("/usr/bin/uv"), version="0.10.0", env_root=tmp_path / "env"
    )
    argv = plan.argv
    assert argv[:7] == ("/usr/bin/uv", "tool", "run", "--from", "vllm==0.10.0", "vllm", "serve")
    assert argv[7] == str(launch_request.snapshot)
    assert flag(argv, "--host") == "127.0.0.1"
    assert flag(argv, "--max-num-seqs") == "4"
    assert flag(argv, "--max-model-len") == "8192"
    assert flag(argv, "--served-model-name") == "big"
    assert flag(argv, "--gpu-memory-utilization") == "0.2750"  # (20 + 2) / 80
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "1"
    assert plan.env["UV_TOOL_DIR"] == str(tmp_path / "env" / "tools")
    assert "--tensor-parallel-size" not in argv


def test_memory_share_is_clamped_and_defaults_when_unknown() -> None:
    assert gpu_memory_utilization(1, 80 * GIB) == 0.2
    assert gpu_memory_utilization(200 * GIB, 80 * GIB) == 0.95
    assert gpu_memory_utilization(None, 80 * GIB) == 0.90


def test_container_plan_is_locked_down(tmp_path: Path) -> None:
    launch_request = request(tmp_path, devices=(0, 1), kv_quant="fp8")
    plan = plan_vllm_container(
        launch_request, runtime=Path("/usr/bin/docker"), image=IMAGE, shm_size_gib=8
    )
    argv = plan.argv
    text = " ".join(argv)
    assert flag(argv, "--network") == "sbproxy-model-host"
    assert flag(argv, "--gpus") == '"device=0,1"'
    assert flag(argv, "-p") == "127.0.0.1:18123:8000"
    assert flag(argv, "--shm-size") == "8g"
    mount = flag(argv, "--mount")
    assert mount == f"type=bind,src={launch_request.snapshot},dst=/models/model,readonly"
    assert flag(argv, "--tensor-parallel-size") == "2"
    assert flag(argv, "--kv-cache-dtype") == "fp8"
    for forbidden in ("--privileged", "--network host", "--gpus all", "device=all"):
        assert forbidden not in text
    assert network_create_argv(Path("/usr/bin/docker"))[-2:] == ("--internal", "sbproxy-model-host")


def test_podman_uses_cdi_devices(tmp_path: Path) -> None:
    plan = plan_vllm_container(
        request(tmp_path), runtime=Path("/usr/bin/podman"), image=IMAGE, podman=True
    )
    assert flag(plan.argv, "--device") == "nvidia.com/gpu=1"
    assert "--gpus" not in plan.argv


@pytest.mark.parametrize(
    "image", ["vllm/vllm-openai:latest", "vllm/vllm-openai:v0.10.0", "vllm/vllm-openai"]
)
def test_tagged_images_are_refused(tmp_path: Path, image: str) -> None:
    with pytest.raises(EngineError) as info:
        plan_vllm_container(request(tmp_path), runtime=Path("/usr/bin/docker"), image=image)
    assert info.value.code == "engine_blocked"


def test_vllm_refuses_gguf_cpu_and_unsafe_args(tmp_path: Path) -> None:
    metadata, snapshot = verified_snapshot(tmp_path / "g", {"m.gguf": b"1"})
    with pytest.raises(EngineError) as gguf:
        plan_vllm_uv(
            request(tmp_path / "a", metadata=metadata, snapshot=snapshot),
            uv=Path("/uv"),
            version="0.10.0",
            env_root=tmp_path,
        )
    assert gguf.value.code == "engine_incompatible"
    with pytest.raises(EngineError) as cpu:
        plan_vllm_uv(
            request(tmp_path / "b", accelerator="cpu", devices=()),
            uv=Path("/uv"),
            version="0.10.0",
            env_root=tmp_path,
        )
    assert cpu.value.code == "engine_incompatible"
    with pytest.raises(EngineError) as unsafe:
        plan_vllm_uv(
            request(tmp_path / "c", extra_args=("--tensor-parallel-size", "8")),
            uv=Path("/uv"),
            version="0.10.0",
            env_root=tmp_path,
        )
    assert unsafe.value.code == "unsafe_argument"


def test_compat_probe_and_verdicts() -> None:
    argv = compat_probe_argv(Path("/uv"), version="0.10.0")
    assert argv[:6] == ("/uv", "run", "--isolated", "--no-project", "--with", "vllm==0.10.0")
    good = json.dumps(
        {
            "python": "3.12.3",
            "torch": "2.7.1",
            "cuda": "12.8",
            "vllm": "0.10.0",
            "cuda_available": True,
        }
    )
    assert judge_compat(
        good, version="0.10.0", accelerator="cuda", compute_capability=(9, 0)
    ).compatible
    wrong = judge_compat(good, version="0.11.0", accelerator="cuda", compute_capability=(9, 0))
    assert not wrong.compatible
    assert wrong.remediation is not None
    assert "vllm==0.11.0" in wrong.remediation
    no_gpu = json.dumps(
        {
            "python": "3.12",
            "torch": "2.7.1",
            "cuda": "12.8",
            "vllm": "0.10.0",
            "cuda_available": False,
        }
    )
    assert (
        "sees no GPU"
        in judge_compat(
            no_gpu, version="0.10.0", accelerator="cuda", compute_capability=(9, 0)
        ).reason
    )
    cpu_torch = json.dumps({"python": "3.12", "torch": "2.7.1", "cuda": None, "vllm": "0.10.0"})
    assert not judge_compat(
        cpu_torch, version="0.10.0", accelerator="cuda", compute_capability=(9, 0)
    ).compatible
    old_gpu = judge_compat(good, version="0.10.0", accelerator="cuda", compute_capability=(6, 1))
    assert "7.0" in old_gpu.reason
    assert not judge_compat(
        "garbage", version="0.10.0", accelerator="cuda", compute_capability=(9, 0)
    ).compatible


def test_detection_on_this_cpu_worker() -> None:
    found = detect_vllm(EngineConfig(launch="uv"), accelerator="cpu", compute_capability=None)
    assert found.availability == Availability.INCOMPATIBLE
    gpu = detect_vllm(EngineConfig(launch="uv"), accelerator="cuda", compute_capability=(9, 0))
    assert gpu.availability == Availability.ACQUIRABLE
    assert gpu.version == "0.10.0"


@pytest.mark.anyio
async def test_a_uv_plan_launches_through_a_stand_in_uv(tmp_path: Path) -> None:
    # A fake `uv` that drops the `tool run --from vllm==X vllm serve SNAPSHOT` prefix and
    # runs the stand-in server with the remaining vLLM flags it understands.
    uv = tmp_path / "uv"
    uv.write_text(
        "#!/bin/sh\n"
        "shift 7\n"
        'while [ $# -gt 0 ]; do case "$1" in --port) PORT=$2; shift 2;; *) shift;; esac; done\n'
        f'exec "{sys.executable}" "{FAKE_SERVER}" --port "$PORT"\n'
    )
    uv.chmod(0o755)
    port = free_port()
    plan = plan_vllm_uv(
        request(tmp_path, port=port), uv=uv, version="0.10.0", env_root=tmp_path / "env"
    )
    process = await launch(
        plan,
        log_path=tmp_path / "vllm.log",
        owned_dir=tmp_path / "owned",
        label="big/3",
        identity=WorkerIdentity.current(),
        ready_timeout_s=20,
    )
    assert await process.probe(f"http://127.0.0.1:{port}/health") == "ready"
    await process.shutdown()
