"""The configure flags of a llama.cpp source build, per acceleration and CPU architecture."""

from __future__ import annotations

import pytest

from sbproxy.model_host.engines import BuildInput, build_identity
from sbproxy.model_host.engines.llama_build import cmake_flags

NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


@pytest.mark.parametrize("machine", ["x86_64", "AMD64"])
def test_an_x86_cpu_build_leaves_amx_out(monkeypatch: pytest.MonkeyPatch, machine: str) -> None:
    # A VM may advertise AMX that it cannot run (ldtilecfg faults): -march=native must not use it.
    monkeypatch.setattr("platform.machine", lambda: machine)
    flags = cmake_flags("cpu")
    assert f"-DCMAKE_C_FLAGS={NO_AMX}" in flags
    assert f"-DCMAKE_CXX_FLAGS={NO_AMX}" in flags
    assert "-DGGML_NATIVE=OFF" not in flags


def test_an_arm_cpu_build_gets_no_x86_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    # gcc on aarch64 refuses -mno-amx-*: the flags are for x86-64 only.
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    assert not [flag for flag in cmake_flags("cpu") if "amx" in flag]


def test_a_cuda_build_is_portable_and_keeps_no_cpu_specific_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    flags = cmake_flags("cuda")
    assert "-DGGML_NATIVE=OFF" in flags
    assert not [flag for flag in flags if "amx" in flag]


def test_the_amx_free_recipe_builds_into_a_new_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    # A published AMX build must never be reused for the new recipe: the flags are in the identity.
    request = BuildInput(archive="/src.tar.gz", sha256="0" * 64)
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    x86 = build_identity(request)
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    assert build_identity(request) != x86
