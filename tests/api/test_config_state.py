"""The host's configuration state: what a commit and a failure record, and its JSON shape."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

from sbproxy.api.config_state import (
    MAX_MESSAGE_CHARS,
    ConfigState,
    ReloadResult,
    ReloadSource,
    result_of,
)
from sbproxy.config import load_config
from sbproxy.errors import ConfigError, ConfigIssue, SbproxyError

MINIMAL = "proxy:\n  http_bind_port: 18080\n"


def fixed_clock() -> datetime:
    return datetime(2026, 12, 1, 1, 2, 3, 456789, tzinfo=timezone(timedelta(hours=2)))


def state_for(path: Path) -> ConfigState:
    state = ConfigState.of(load_config(path), revision=3)
    state.clock = fixed_clock
    return state


def test_the_state_of_a_loaded_file_names_its_path_digest_and_revision(tmp_path: Path) -> None:
    import hashlib

    real = tmp_path / "real"
    real.mkdir()
    (real / "sb.yml").write_text(MINIMAL)
    link = tmp_path / "sb.yml"
    link.symlink_to(real / "sb.yml")
    state = state_for(link)
    assert state.to_dict() == {
        "path": str(link),
        "resolved_path": str((real / "sb.yml").resolve()),
        "content_sha256": hashlib.sha256(MINIMAL.encode()).hexdigest(),
        "revision": 3,
        "last_reload": None,
        "watch": None,
    }


def test_a_committed_reload_records_the_new_content_and_revision(tmp_path: Path) -> None:
    path = tmp_path / "sb.yml"
    path.write_text(MINIMAL)
    state = state_for(path)
    path.write_text(MINIMAL + "# edited\n")
    candidate = load_config(path)
    state.on_commit(candidate)
    state.committed(ReloadSource.WATCH, job_id="01JOB", revision=4)
    assert state.content_sha256 == candidate.content_sha256
    assert state.to_dict()["revision"] == 4
    assert state.to_dict()["last_reload"] == {
        "source": "watch",
        "result": "committed",
        "at": "2026-11-30T23:02:03.456Z",  # UTC, milliseconds
        "job_id": "01JOB",
        "revision": 4,
        "content_sha256": candidate.content_sha256,
        "reason_code": None,
        "message": None,
    }


def test_a_refused_reload_keeps_the_active_content(tmp_path: Path) -> None:
    path = tmp_path / "sb.yml"
    path.write_text(MINIMAL)
    state = state_for(path)
    before = state.content_sha256
    error = ConfigError(
        [ConfigIssue("proxy.http_bind_port", "must be at most 65535", line=2)],
        source=str(path),
    )
    attempt = state.failed(ReloadSource.SIGHUP, error, content_sha256="ab" * 32)
    assert state.content_sha256 == before and state.revision == 3
    assert attempt.result == ReloadResult.REFUSED
    assert state.to_dict()["last_reload"] == {
        "source": "sighup",
        "result": "refused",
        "at": "2026-11-30T23:02:03.456Z",
        "job_id": None,
        "revision": None,
        "content_sha256": "ab" * 32,
        "reason_code": "invalid_config",
        "message": "proxy.http_bind_port: must be at most 65535",
    }


def test_refusals_and_failures_are_told_apart_by_reason_code() -> None:
    assert result_of(SbproxyError("x", code="restart_required")) == ReloadResult.REFUSED
    assert result_of(SbproxyError("x", code="lock_drift")) == ReloadResult.REFUSED
    assert result_of(ConfigError([], code="empty_config")) == ReloadResult.REFUSED
    assert result_of(SbproxyError("x", code="insufficient_capacity")) == ReloadResult.FAILED
    assert result_of(SbproxyError("x", code="crash_loop")) == ReloadResult.FAILED


def test_a_failure_message_is_bounded_redacted_and_names_its_job(tmp_path: Path) -> None:
    path = tmp_path / "sb.yml"
    path.write_text(MINIMAL)
    state = state_for(path)
    error = SbproxyError(
        "engine said: Authorization: Bearer sk-secret-value\n" + "x" * 5000,
        code="engine_early_exit",
        details={"job_id": "01RELOAD"},
    )
    attempt = state.failed(ReloadSource.ADMIN, error)
    assert attempt.result == ReloadResult.FAILED
    assert attempt.job_id == "01RELOAD"
    assert attempt.message is not None
    assert len(attempt.message) == MAX_MESSAGE_CHARS
    assert "sk-secret-value" not in attempt.message
    assert "\n" not in attempt.message


def test_many_config_issues_are_summarised(tmp_path: Path) -> None:
    path = tmp_path / "sb.yml"
    path.write_text(MINIMAL)
    state = state_for(path)
    issues = [ConfigIssue(f"proxy.field{i}", "is wrong") for i in range(8)]
    attempt = state.failed(ReloadSource.WATCH, ConfigError(issues))
    assert attempt.message is not None
    assert attempt.message.startswith("proxy.field0: is wrong; proxy.field1: is wrong")
    assert attempt.message.endswith("; and 3 more")


def test_the_watch_object_counts_looks(tmp_path: Path) -> None:
    path = tmp_path / "sb.yml"
    path.write_text(MINIMAL)
    state = state_for(path)
    state.watching(poll_interval_s=2.0)
    state.looked()
    state.looked()
    assert state.to_dict()["watch"] == {
        "poll_interval_s": 2.0,
        "looks": 2,
        "last_look_at": "2026-11-30T23:02:03.456Z",
    }
    assert datetime.fromisoformat("2026-11-30T23:02:03.456+00:00").tzinfo == UTC
