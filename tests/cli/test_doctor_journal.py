"""`sbproxy doctor` names the journal in use (SQLite path, or PostgreSQL host/db without the
password), its schema version and whether it is reachable."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import anyio
import yaml

from sbproxy.store import Database
from sbproxy.store.migrations import SCHEMA_VERSION
from tests.support.postgres import PostgresServer


def doctor(sb_yml: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sbproxy.cli", "doctor", "-f", str(sb_yml), "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **env},
    )


def sb_yml(tmp_path: Path, journal_url: str | None = None) -> Path:
    host: dict[str, object] = {"cache": {"directory": str(tmp_path / "cache")}}
    if journal_url is not None:
        host["journal"] = {"url": journal_url}
    path = tmp_path / "sb.yml"
    path.write_text(yaml.safe_dump({"proxy": {"model_host": host}}))
    return path


def _migrated(url: str) -> None:
    async def open_once() -> None:
        await (await Database.open(url)).close()

    anyio.run(open_once)


def test_doctor_shows_the_sqlite_journal(tmp_path: Path) -> None:
    done = doctor(sb_yml(tmp_path))
    assert done.returncode == 0, done.stderr
    journal = json.loads(done.stdout)["journal"]
    assert journal["backend"] == "sqlite"
    assert journal["location"] == str(tmp_path / "cache" / "jobs" / "journal.db")
    assert (journal["reachable"], journal["schema_version"]) == (True, None)  # not created
    assert not (tmp_path / "cache" / "jobs" / "journal.db").exists()  # doctor creates nothing


def test_doctor_shows_the_postgres_journal_without_its_password(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    url = postgres_server.create_database()
    _migrated(url)
    name = url.rsplit("/", 1)[1]
    done = doctor(sb_yml(tmp_path, "${JOURNAL_URL}"), JOURNAL_URL=url.replace("@", ":pw-xyz@"))
    assert done.returncode == 0, done.stderr
    assert "pw-xyz" not in done.stdout + done.stderr
    journal = json.loads(done.stdout)["journal"]
    assert journal == {
        "backend": "postgresql",
        "location": f"postgresql://{postgres_server.user}@127.0.0.1:{postgres_server.port}/{name}",
        "reachable": True,
        "schema_version": SCHEMA_VERSION,
        "supported_schema": SCHEMA_VERSION,
        "error": None,
        "code": None,
        "remediation": None,
    }


def test_doctor_fails_on_an_unreachable_postgres_journal(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = doctor(sb_yml(tmp_path, f"postgresql://sb:pw-xyz@127.0.0.1:{port}/jobs"))
    assert done.returncode == 1, done.stderr
    assert "pw-xyz" not in done.stdout + done.stderr
    journal = json.loads(done.stdout)["journal"]
    assert journal["reachable"] is False
    assert f"127.0.0.1:{port}" in journal["error"]


def test_a_journal_url_that_is_not_postgres_is_a_config_error(tmp_path: Path) -> None:
    done = doctor(sb_yml(tmp_path, "mysql://sb:pw-xyz@db/jobs"))
    assert done.returncode == 2, done.stderr
    output = done.stdout + done.stderr
    assert "proxy.model_host.journal.url" in output
    assert "postgresql://" in output
    assert "pw-xyz" not in output
