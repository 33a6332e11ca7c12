"""``sbproxy jobs list`` reads through ``JournalReader``, and says exactly what the full store
(the workflow engine) would say about the same journal."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import CliRunner

from sbproxy.cli import jobs_control_cmd
from sbproxy.cli.main import cli
from sbproxy.store import JournalReader, ReaderDeclined
from tests.support.journals import fill_varied_journal

FILTERS = [
    (),
    ("--state", "running"),
    ("--state", "queued", "--state", "failed", "--kind", "pull"),
    ("--kind", "gc"),
    ("--kind", "nothing-of-this-kind"),
    ("--limit", "2"),
]


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("reader-cache")
    anyio.run(fill_varied_journal, root / "jobs" / "journal.db")
    return root


def _list(root: Path, *args: str) -> str:
    result = CliRunner().invoke(
        cli, ["jobs", "list", "--cache-dir", str(root), *args], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    return result.stdout


def _through_engine(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make the reader decline, as for an older schema; returns the journals the engine read."""
    used: list[str] = []
    fallback = jobs_control_cmd.list_with_engine

    def declined(path: Path) -> Any:
        raise ReaderDeclined(f"declined {path} for the test")

    def engine_listing(*args: Any, **kwargs: Any) -> Any:
        used.append(str(args[2].location))  # the JournalChoice the verb selected
        return fallback(*args, **kwargs)

    monkeypatch.setattr(JournalReader, "open", declined)
    monkeypatch.setattr(jobs_control_cmd, "list_with_engine", engine_listing)
    return used


def _without_ages(payload: dict[str, Any]) -> dict[str, Any]:
    for job in payload["jobs"]:
        if job["stale"] is not None:
            job["stale"]["age_ms"] = "<age>"
    return payload


def _text_without_ages(text: str) -> str:
    text = re.sub(r"silent for [0-9hms.]+", "silent for <age>", text)
    text = re.sub(r"just now|\d+[smhd] ago", "<ago>", text)
    return re.sub(r" +", " ", text)


@pytest.mark.parametrize("filters", FILTERS)
def test_json_listing_equals_the_engines(
    cache_root: Path, filters: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    read = json.loads(_list(cache_root, "--format", "json", *filters))
    used = _through_engine(monkeypatch)
    engine = json.loads(_list(cache_root, "--format", "json", *filters))
    assert used == [str(cache_root / "jobs" / "journal.db")]
    assert _without_ages(read) == _without_ages(engine)


def test_the_listing_judges_both_kinds_of_stale_job(cache_root: Path) -> None:
    payload = json.loads(_list(cache_root, "--format", "json", "--state", "running"))
    stale = [job["stale"]["reason"] for job in payload["jobs"] if job["stale"]]
    assert sorted(stale) == ["lease_expired", "owner_gone"]
    by_reason = {job["stale"]["reason"]: job for job in payload["jobs"] if job["stale"]}
    assert by_reason["owner_gone"]["stale"]["last_step"]["name"] == "plan"
    assert "resumed by" in by_reason["lease_expired"]["stale"]["resume"]
    live = [job for job in payload["jobs"] if job["stale"] is None]
    assert len(live) == 2  # running under this process's live lease, one asked to cancel


@pytest.mark.parametrize("filters", FILTERS)
def test_text_listing_equals_the_engines(
    cache_root: Path, filters: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    read = _list(cache_root, *filters)
    _through_engine(monkeypatch)
    engine = _list(cache_root, *filters)
    assert _text_without_ages(read) == _text_without_ages(engine)


def test_an_older_journal_is_listed_by_the_store_which_migrates_it(tmp_path: Path) -> None:
    import sqlite3

    from sbproxy.store.migrations import SCHEMA_VERSION

    root = tmp_path / "cache"
    journal = root / "jobs" / "journal.db"
    anyio.run(fill_varied_journal, journal)
    with sqlite3.connect(journal) as raw:
        # Back to schema 4: before the recovery count (5), the job's node (6), the
        # shared revision documents (7), idempotency keys per node (8), the fleet's
        # tables (9), its avoided nodes (10; its new columns go with their tables) and
        # the autoscaler's (12) and join tokens (13).
        raw.execute("DELETE FROM schema_migrations WHERE version >= 5")
        for table in (
            "fleet_demand",
            "fleet_scale",
            "fleet_join_tokens",
            "fleet_avoid",
            "fleet_events",
            "fleet_placements",
            "fleet_controller",
            "fleet_nodes",
        ):
            raw.execute(f"DROP TABLE {table}")
        raw.execute("DROP TABLE desired_revisions")
        raw.execute("DROP INDEX jobs_active_idempotency_key")
        raw.execute(
            "CREATE UNIQUE INDEX jobs_active_idempotency_key ON jobs (idempotency_key) "
            "WHERE idempotency_key IS NOT NULL AND status IN ('queued', 'running', 'parked')"
        )
        raw.execute("ALTER TABLE jobs DROP COLUMN recoveries")
        raw.execute("ALTER TABLE jobs DROP COLUMN node")
    payload = json.loads(_list(root, "--format", "json"))
    assert len(payload["jobs"]) == 10
    assert {job["recoveries"] for job in payload["jobs"]} == {0}
    assert {job["node"] for job in payload["jobs"]} == {None}  # older jobs: any node
    with sqlite3.connect(journal) as raw:
        version = raw.execute("SELECT MAX(version) FROM schema_migrations").fetchone()[0]
    assert version == SCHEMA_VERSION


def test_a_damaged_journal_is_reported_by_the_store(tmp_path: Path) -> None:
    journal = tmp_path / "cache" / "jobs" / "journal.db"
    journal.parent.mkdir(parents=True)
    journal.write_bytes(b"this is not a database\n" * 100)
    result = CliRunner().invoke(
        cli, ["jobs", "list", "--cache-dir", str(tmp_path / "cache"), "--format", "json"]
    )
    assert result.exit_code == 1
    error = json.loads(result.stdout)["error"]
    assert error["code"] == "store_failed"
    assert f"cannot open the journal {journal}" in error["error"]
