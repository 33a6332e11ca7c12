"""Refusals about the journal exit 2 from every verb, as one clean message (issue 31, item 4):
a PostgreSQL server that cannot be reached (``journal_unavailable``) or whose journal is newer
than this sbproxy (``journal_schema_newer``), and a journal URL that names no server
(``invalid_journal_url``, never taken for an unreachable server at ``@:5432``). Every verb runs
as a real process; the servers are real (a PostgreSQL stopped under a running fleet host, a
closed port).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import anyio
import psycopg
import pytest
import yaml

from sbproxy.store import Database
from sbproxy.store.migrations import SCHEMA_VERSION
from tests.api.cluster_hosts import FleetHost
from tests.api.pg_hosts import PASSWORD, catalog, tiny_gguf
from tests.catalog.builders import COMMIT, document, entry, variant, write
from tests.support.hf_server import HfMirror
from tests.support.ports import free_port
from tests.support.postgres import PostgresServer

SECRET = "pw-xyz"
REPO = "org/tiny"


def sbproxy(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``sbproxy ARGS`` in a process of its own; no journal, cache or node from outside."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SBPROXY_", "HF_"))}
    return subprocess.run(
        [sys.executable, "-m", "sbproxy.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**base, "PYTHONWARNINGS": "ignore", **env},
    )


def sb_yml(tmp_path: Path, journal_url: str) -> Path:
    """A config of one host whose journal is ``journal_url`` (listeners on free ports)."""
    document = {
        "proxy": {
            "http_bind_port": free_port(),
            "model_host": {
                "cache": {"directory": str(tmp_path / "cache")},
                "journal": {"url": journal_url},
            },
        },
        "origins": {},
    }
    path = tmp_path / "sb.yml"
    path.write_text(yaml.safe_dump(document))
    return path


def one_message(done: subprocess.CompletedProcess[str]) -> str:
    """stderr, checked to be the verb's own message: no traceback, no driver's warning, no
    password."""
    err = done.stderr
    assert "Traceback" not in err, err
    assert "error ignored" not in err and "psycopg" not in err.lower(), err
    assert SECRET not in done.stdout + err
    return err


def closed_port_url() -> str:
    return f"postgresql://sb:{SECRET}@127.0.0.1:{free_port()}/jobs"


# -- journal_unavailable -----------------------------------------------------------------------


def test_serve_refuses_an_unreachable_journal_with_exit_2(tmp_path: Path) -> None:
    url = closed_port_url()
    port = url.rsplit(":", 1)[1].split("/")[0]
    done = sbproxy("serve", "-f", str(sb_yml(tmp_path, url)))
    err = one_message(done)
    assert done.returncode == 2, err
    (line,) = [line for line in err.splitlines() if line.startswith("serve:")]
    assert "(journal_unavailable)" in line and f"127.0.0.1:{port}" in line


@pytest.mark.parametrize("verb", [("jobs", "list"), ("models", "pull", "tiny"), ("models", "gc")])
def test_journal_verbs_refuse_an_unreachable_journal_with_exit_2(
    tmp_path: Path, verb: tuple[str, ...]
) -> None:
    url = closed_port_url()
    done = sbproxy(*verb, "-f", str(sb_yml(tmp_path, url)), "--format", "json")
    err = one_message(done)
    assert done.returncode == 2, err
    assert json.loads(done.stdout)["error"]["code"] == "journal_unavailable"
    assert len(err.strip().splitlines()) == 1, err


def test_doctor_says_an_unreachable_journal_is_unreachable_not_new(tmp_path: Path) -> None:
    url = closed_port_url()
    port = url.rsplit(":", 1)[1].split("/")[0]
    done = sbproxy("doctor", "-f", str(sb_yml(tmp_path, url)))
    assert done.returncode == 1, done.stderr  # a report that found the host blocked
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("journal:")]
    assert "not created yet" not in line
    assert "UNREACHABLE: journal_unavailable" in line and f"127.0.0.1:{port}" in line
    rest = done.stdout.split(line, 1)[1].splitlines()
    assert f"127.0.0.1:{port} is unavailable" in rest[1]
    assert rest[2].startswith("  to do: Check that the server runs")
    assert SECRET not in done.stdout + done.stderr
    report = json.loads(
        sbproxy("doctor", "-f", str(tmp_path / "sb.yml"), "--format", "json").stdout
    )
    assert report["journal"]["code"] == "journal_unavailable"
    assert report["journal"]["schema_version"] is None


def test_nodes_list_refuses_with_exit_2_when_the_fleet_host_lost_its_journal(
    tmp_path: Path, own_postgres_server: PostgresServer
) -> None:
    """A real fleet host whose PostgreSQL stops: it answers ``503 journal_unavailable``, and
    ``nodes list`` exits 2 (the refusal's code decides, not the HTTP status)."""
    url = own_postgres_server.create_database()
    # No deployment is placed: the catalog only has to be there.
    model = tiny_gguf(tmp_path / "src", vocab=50)
    catalog(tmp_path / "catalog.yaml", model, model)
    with HfMirror() as mirror:
        host = FleetHost("node-a", tmp_path / "node-a", url, mirror.url)
        host.start()
        try:
            admin = f"http://127.0.0.1:{host.admin}"
            nodes = ("nodes", "list", "--admin-url", admin, "--password", PASSWORD)
            deadline = time.monotonic() + 120
            while sbproxy(*nodes).returncode != 0:
                assert host.process is not None and host.process.poll() is None, host.output
                assert time.monotonic() < deadline, host.output
                time.sleep(0.5)
            own_postgres_server.stop_server("immediate")
            done = sbproxy(*nodes, "--format", "json")
        finally:
            assert host.process is not None
            host.process.terminate()
            host.process.wait(timeout=60)
    err = one_message(done)
    assert done.returncode == 2, err
    assert json.loads(done.stdout)["error"]["code"] == "journal_unavailable"
    assert len(err.strip().splitlines()) == 1, err


# -- journal_schema_newer ----------------------------------------------------------------------


def test_serve_refuses_a_newer_journal_with_exit_2(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    url = postgres_server.create_database()

    async def migrate() -> None:
        await (await Database.open(url)).close()

    anyio.run(migrate)
    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute(
            "INSERT INTO schema_migrations (version, description, applied_at_ms) "
            "VALUES (%s, 'from a newer sbproxy', 0)",
            (SCHEMA_VERSION + 1,),
        )
    done = sbproxy("serve", "-f", str(sb_yml(tmp_path, url)))
    err = one_message(done)
    assert done.returncode == 2, err
    (line,) = [line for line in err.splitlines() if line.startswith("serve:")]
    assert "(journal_schema_newer)" in line


# -- invalid_journal_url -----------------------------------------------------------------------

MALFORMED = [
    "postgresql://@:5432",
    f"postgres://user:{SECRET}@/db",
    "garbage",
    f"mysql://sb:{SECRET}@db/jobs",
    f"postgresql://sb:{SECRET}@db:99999/jobs",
]


@pytest.mark.parametrize("url", MALFORMED)
@pytest.mark.parametrize(
    "verb", [("serve",), ("jobs", "list"), ("models", "pull", "tiny"), ("doctor",)]
)
def test_a_malformed_journal_url_in_the_config_is_invalid_not_unreachable(
    tmp_path: Path, url: str, verb: tuple[str, ...]
) -> None:
    done = sbproxy(*verb, "-f", str(sb_yml(tmp_path, url)))
    err = one_message(done)
    assert done.returncode == 2, err
    assert "invalid_journal_url" in err
    assert "proxy.model_host.journal.url" in err
    assert "unavailable" not in err and "@:5432" not in err
    assert not (tmp_path / "cache" / "jobs" / "journal.db").exists()


@pytest.mark.parametrize("url", MALFORMED)
@pytest.mark.parametrize("verb", [("jobs", "list"), ("models", "gc"), ("doctor",)])
def test_a_malformed_journal_url_in_the_environment_is_invalid(
    tmp_path: Path, url: str, verb: tuple[str, ...]
) -> None:
    done = sbproxy(
        *verb, "--cache-dir", str(tmp_path / "cache"), "--format", "json", SBPROXY_JOURNAL_URL=url
    )
    err = one_message(done)
    assert done.returncode == 2, err
    error = json.loads(done.stdout)["error"]
    assert error["code"] == "invalid_journal_url"
    assert error["retryable"] is False
    assert "$SBPROXY_JOURNAL_URL" in error["error"]
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "cache" / "jobs" / "journal.db").exists()


# -- a connection lost under a running verb ----------------------------------------------------


def test_a_verb_that_loses_its_journal_prints_no_driver_warning(
    tmp_path: Path, own_postgres_server: PostgresServer
) -> None:
    """``models pull`` downloading (slowly) when its PostgreSQL stops: its next journal write
    meets a dead connection inside a pipeline. The verb ends with its own line and exit 2,
    without psycopg's ``error ignored terminating <psycopg.Pipeline [BAD]>`` before it."""
    data = b"GGUF" + bytes(range(256)) * 16_000  # 4 MiB, served at 256 KiB/s
    files = [
        {"path": "tiny.gguf", "sha256": hashlib.sha256(data).hexdigest(), "size_bytes": len(data)}
    ]
    doc = document(
        models={
            "tiny": entry(variant("q4_k_m", source=f"hf:{REPO}", files=files, min_memory_bytes=1))
        }
    )
    config = sb_yml(tmp_path, own_postgres_server.create_database())
    text = yaml.safe_load(config.read_text())
    text["proxy"]["model_host"]["catalog_file"] = str(write(tmp_path / "catalog.yaml", doc))
    config.write_text(yaml.safe_dump(text))
    with HfMirror() as mirror:
        mirror.add_file(REPO, COMMIT, "tiny.gguf", data, throttle_bps=256 * 1024)
        base = {k: v for k, v in os.environ.items() if not k.startswith(("SBPROXY_", "HF_"))}
        pull = subprocess.Popen(
            [sys.executable, "-m", "sbproxy.cli", "models", "pull", "tiny", "-f", str(config),
             "--format", "json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**base, "PYTHONWARNINGS": "ignore", "HF_ENDPOINT": mirror.url},
        )  # fmt: skip
        assert pull.stderr is not None
        seen: list[str] = []
        # Poll the verb's own progress: the download is under way, its journal in use.
        while not any("running step fetch" in line for line in seen):
            line = pull.stderr.readline()
            assert line, "".join(seen)
            seen.append(line)
        own_postgres_server.stop_server("immediate")
        out, rest = pull.communicate(timeout=120)
    err = "".join(seen) + rest
    assert pull.returncode == 2, err
    assert "error ignored" not in err and "Pipeline" not in err, err
    assert "Traceback" not in err, err
    assert json.loads(out)["error"]["code"] == "journal_unavailable"
    last = err.strip().splitlines()[-1]
    assert last.startswith("sbproxy models pull: the job journal's PostgreSQL server"), err
