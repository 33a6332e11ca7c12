"""Every verb that takes ``-f`` or ``--cache-dir`` reads and writes the journal the config
names (``proxy.model_host.journal.url``), as ``serve`` and ``models pull`` do: run from
outside (a real ``sbproxy`` process) against a real PostgreSQL journal, with no
``$SBPROXY_JOURNAL_URL`` to help, each verb's work is found in PostgreSQL and the cache's
SQLite journal is never created (issue 31, item 3).

Not here, because they take neither option and open no journal: ``nodes *``, ``config
status`` and ``models ps|load|stop`` (a running host's admin API), ``engines list`` (probes
engines only), ``run`` (its own throw-away config); ``serve`` is covered by the real-host tests
(``tests/api/pg_hosts.py``).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import psycopg
import pytest

from sbproxy.store import Database, ErrorInfo, JobStatus, JobStore
from sbproxy.store.postgres import PgTarget
from tests.catalog.builders import COMMIT, document, entry, variant, write
from tests.support.hf_server import HfMirror
from tests.support.postgres import PostgresServer

GGUF = b"GGUF" + bytes(range(256)) * 8
REPO = "org/tiny"


@dataclass(frozen=True)
class Journal:
    """One test's PostgreSQL journal, its sb.yml and its cache.

    Attributes:
        url: The database (no password).
        config: ``sb.yml`` naming the cache, the catalog and ``journal.url``.
        cache: The cache root.
        local: A file ``models import`` takes as the model ``tiny``.
        hf_endpoint: The loopback mirror ``models pull`` downloads ``tiny`` from.
    """

    url: str
    config: Path
    cache: Path
    local: Path
    hf_endpoint: str

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``sbproxy ARGS -f sb.yml`` in a process of its own, nothing in the environment
        naming a journal, a cache or a node."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SBPROXY_", "HF_")) and k != "SB_CONFIG_FILE"
        }
        return subprocess.run(
            [sys.executable, "-m", "sbproxy.cli", *args, "-f", str(self.config)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            env={**env, "HF_ENDPOINT": self.hf_endpoint, "PYTHONWARNINGS": "ignore"},
        )

    def ok(self, *args: str) -> subprocess.CompletedProcess[str]:
        done = self.run(*args)
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    def jobs(self) -> dict[str, tuple[str, str]]:
        """Every job in PostgreSQL: id -> (kind, status)."""
        with psycopg.connect(self.url) as connection:
            created = connection.execute("SELECT to_regclass('jobs') IS NOT NULL").fetchone()
            if not (created and created[0]):
                return {}  # nothing has opened this journal yet
            rows = connection.execute("SELECT id, kind, status FROM jobs").fetchall()
        return {str(r[0]): (str(r[1]), str(r[2])) for r in rows}

    def seed(self, status: JobStatus) -> str:
        """A ``gc`` job in PostgreSQL, left ``queued`` or finished with ``status``."""

        async def submit() -> str:
            database = await Database.open(self.url)
            try:
                store = JobStore(database)
                job = (await store.submit(kind="gc", workflow_version=1, input_json="{}")).job
                if status != JobStatus.QUEUED:
                    claimed = await store.claim(owner="seed", lease_ms=60_000, job_id=job.id)
                    assert claimed is not None
                    error = ErrorInfo("seeded", "seeded") if status == JobStatus.FAILED else None
                    await store.finish(
                        job.id,
                        owner="seed",
                        attempt=claimed.attempt,
                        status=status,
                        output_json="{}" if error is None else None,
                        error=error,
                    )
                return job.id
            finally:
                await database.close()

        return anyio.run(submit)

    @property
    def sqlite_journal(self) -> Path:
        return self.cache / "jobs" / "journal.db"


@pytest.fixture
def journal(tmp_path: Path, postgres_server: PostgresServer) -> Iterator[Journal]:
    url = postgres_server.create_database()
    files = [
        {"path": "tiny.gguf", "sha256": hashlib.sha256(GGUF).hexdigest(), "size_bytes": len(GGUF)}
    ]
    catalog = write(
        tmp_path / "catalog.yaml",
        document(
            models={
                "tiny": entry(
                    variant("q4_k_m", source=f"hf:{REPO}", files=files, min_memory_bytes=1024)
                )
            }
        ),
    )
    cache = tmp_path / "cache"
    config = tmp_path / "sb.yml"
    config.write_text(
        "proxy:\n"
        "  model_host:\n"
        f"    catalog_file: {catalog}\n"
        "    cache:\n"
        f"      directory: {cache}\n"
        "    journal:\n"
        f"      url: {url}\n"
        "origins: {}\n"
    )
    local = tmp_path / "tiny.gguf"
    local.write_bytes(GGUF)
    with HfMirror() as mirror:
        mirror.add_file(REPO, COMMIT, "tiny.gguf", GGUF)
        yield Journal(url=url, config=config, cache=cache, local=local, hf_endpoint=mirror.url)


def _imported(journal: Journal) -> None:
    journal.ok("models", "import", str(journal.local), "--model", "tiny")


def _wrote_a_job(
    journal: Journal, *args: str, before: Callable[[Journal], None] | None = None
) -> None:
    if before is not None:
        before(journal)
    known = journal.jobs()
    journal.ok(*args)
    assert set(journal.jobs()) - set(known), f"{args}: no job written to PostgreSQL"


def check_models_pull(journal: Journal) -> None:
    known = journal.jobs()
    journal.ok("models", "pull", "tiny")
    fresh = {v for k, v in journal.jobs().items() if k not in known}
    assert ("pull", "succeeded") in fresh, fresh


def check_models_import(journal: Journal) -> None:
    _wrote_a_job(journal, "models", "import", str(journal.local), "--model", "tiny")


def check_models_remove(journal: Journal) -> None:
    _wrote_a_job(journal, "models", "remove", "tiny", before=_imported)


def check_models_prune(journal: Journal) -> None:
    _wrote_a_job(journal, "models", "prune", before=_imported)


def check_models_gc(journal: Journal) -> None:
    _wrote_a_job(journal, "models", "gc", "--budget-gib", "1", before=_imported)


def check_models_list(journal: Journal) -> None:
    # The cache holds tiny although its own SQLite journal does not exist: it is cached.
    _imported(journal)
    listed = json.loads(journal.ok("models", "list", "--format", "json").stdout)
    assert {row["id"]: row["status"] for row in listed["models"]} == {"tiny": "cached"}


def check_models_show(journal: Journal) -> None:
    _imported(journal)
    shown = json.loads(journal.ok("models", "show", "tiny", "--format", "json").stdout)
    assert [v["cached"] for v in shown["variants"]] == [True], shown


def check_models_verify(journal: Journal) -> None:
    _imported(journal)
    journal.ok("models", "verify")


def check_models_partials(journal: Journal) -> None:
    _imported(journal)
    payload = json.loads(journal.ok("models", "partials", "--format", "json").stdout)
    assert payload["cache_root"] == str(journal.cache)


def check_models_lock(journal: Journal) -> None:
    _imported(journal)
    journal.ok("models", "lock")


def check_jobs_list(journal: Journal) -> None:
    job_id = journal.seed(JobStatus.QUEUED)
    listed = json.loads(journal.ok("jobs", "list", "--format", "json").stdout)
    assert [job["id"] for job in listed["jobs"]] == [job_id]
    assert listed["journal"] == PgTarget.parse(journal.url).describe()


def check_jobs_show(journal: Journal) -> None:
    job_id = journal.seed(JobStatus.QUEUED)
    shown = json.loads(journal.ok("jobs", "show", job_id, "--format", "json").stdout)
    assert (shown["job"]["id"], shown["job"]["status"]) == (job_id, "queued")


def check_jobs_watch(journal: Journal) -> None:
    job_id = journal.seed(JobStatus.SUCCEEDED)
    watched = json.loads(journal.ok("jobs", "watch", job_id, "--format", "json").stdout)
    assert (watched["job"]["id"], watched["job"]["status"]) == (job_id, "succeeded")


def check_jobs_cancel(journal: Journal) -> None:
    job_id = journal.seed(JobStatus.QUEUED)
    journal.ok("jobs", "cancel", job_id)
    assert journal.jobs()[job_id] == ("gc", "cancelled")


def check_jobs_retry(journal: Journal) -> None:
    job_id = journal.seed(JobStatus.FAILED)
    journal.ok("jobs", "retry", job_id, "--detach")
    assert journal.jobs()[job_id] == ("gc", "queued")


def check_engines_build(journal: Journal) -> None:
    # An archive that does not match its pin: the build job fails at its digest check, and
    # that job is in PostgreSQL.
    archive = journal.cache.parent / "llama.cpp.tar.gz"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("llama.cpp/README")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    archive.write_bytes(buffer.getvalue())
    known = journal.jobs()
    done = journal.run(
        "engines", "build", "llama_cpp", "--source-archive", str(archive), "--sha256", "0" * 64
    )
    assert done.returncode in (1, 2), done.stdout + done.stderr
    fresh = {v[0] for k, v in journal.jobs().items() if k not in known}
    assert fresh == {"engine_build"}, done.stderr


def check_doctor(journal: Journal) -> None:
    done = journal.run("doctor", "--format", "json")
    assert done.returncode in (0, 1), done.stderr  # 1: an engine missing here is no matter
    report = json.loads(done.stdout)["journal"]
    assert report["backend"] == "postgresql"
    assert report["location"] == PgTarget.parse(journal.url).describe()
    assert report["reachable"] is True


VERBS = {
    "models pull": check_models_pull,
    "models import": check_models_import,
    "models remove": check_models_remove,
    "models prune": check_models_prune,
    "models gc": check_models_gc,
    "models list": check_models_list,
    "models show": check_models_show,
    "models verify": check_models_verify,
    "models partials": check_models_partials,
    "models lock": check_models_lock,
    "jobs list": check_jobs_list,
    "jobs show": check_jobs_show,
    "jobs watch": check_jobs_watch,
    "jobs cancel": check_jobs_cancel,
    "jobs retry": check_jobs_retry,
    "engines build": check_engines_build,
    "doctor": check_doctor,
}


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_each_verb_uses_the_postgres_journal_the_config_names(journal: Journal, verb: str) -> None:
    VERBS[verb](journal)
    assert not journal.sqlite_journal.exists(), f"{verb} opened the cache's SQLite journal"
