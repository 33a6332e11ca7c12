"""Writing and reading lockfiles on a real file system (the CLI tests cover resolution)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from sbproxy.catalog import EngineKind
from sbproxy.model_host.lockfile import (
    LockedEngine,
    LockedFile,
    LockedModel,
    Lockfile,
    LockfileError,
    default_lock_path,
    read_lock,
    write_lock,
)
from tests.catalog.builders import COMMIT, sha


def a_lock(revision: str = "ops-1") -> Lockfile:
    return Lockfile(
        schema_version=1,
        generated_at_ms=1_767_225_600_000,
        catalog_revision=revision,
        models=(
            LockedModel(
                name="tiny",
                variant_id="q4_k_m",
                artifact_digest=sha("artifact"),
                source="hf:Acme/Tiny",
                revision=COMMIT,
                files=(LockedFile(path="tiny.gguf", sha256=sha("file"), size_bytes=42),),
                engine=LockedEngine(kind=EngineKind.LLAMA_CPP),
            ),
        ),
    )


def test_write_then_read_round_trips_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "sbproxy-models.lock"
    write_lock(a_lock(), path)
    assert read_lock(path) == a_lock()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    # Unset engine fields are left out of the file rather than written as null.
    assert '"version"' not in path.read_text() and "null" not in path.read_text()


def test_a_failed_write_keeps_the_old_lockfile_and_removes_the_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "sbproxy-models.lock"
    write_lock(a_lock("old"), path)
    before = path.read_bytes()

    def broken_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(LockfileError) as caught:
        write_lock(a_lock("new"), path)
    monkeypatch.undo()
    assert caught.value.code == "lockfile_write_failed"
    assert str(path) in caught.value.message
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_default_path_is_next_to_the_config_else_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert default_lock_path(tmp_path / "conf" / "sb.yml") == (
        tmp_path / "conf" / "sbproxy-models.lock"
    )
    monkeypatch.chdir(tmp_path)
    assert default_lock_path(None) == tmp_path / "sbproxy-models.lock"


def test_a_boolean_schema_version_is_not_version_1(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    path.write_text(a_lock().to_json().replace('"schema_version": 1', '"schema_version": true'))
    with pytest.raises(LockfileError) as caught:
        read_lock(path)
    assert caught.value.code == "invalid_lockfile"
    assert caught.value.details["field"] == "schema_version"
    assert "schema_version true" in caught.value.message
