"""Several real ``sbproxy serve`` hosts on one PostgreSQL journal (issue 19, item 3).

Four hosts (own node ids, caches, ports) pull from an HF-shaped mirror, load, import and
reload at once; a host SIGKILLed at a fault point of a pull or of a load is finished by its
restart under the same job id; PostgreSQL stopped (``-m fast``) and restarted under running
hosts; a SIGSTOPped host whose lease expired cannot write when it resumes.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.api.pg_hosts import (
    FILE,
    REPO,
    REVISION,
    TERMINAL,
    PgHost,
    catalog,
    journal_rows,
    poll,
    query,
    tiny_gguf,
)
from tests.support.hf_server import HfMirror
from tests.support.postgres import PostgresServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

MIB = 1024 * 1024


def import_files(host: PgHost, source: Path) -> subprocess.CompletedProcess[str]:
    """``sbproxy models import`` into ``host``'s cache, as ``host``'s node, on the journal."""
    return subprocess.run(
        [sys.executable, "-m", "sbproxy.cli", "models", "import", str(source),
         "--model", "tiny-imp", "--cache-dir", str(host.cache),
         "--catalog-file", str(host.root.parent / "catalog.yaml"), "--format", "json"],
        env={**host.env, "SBPROXY_JOURNAL_URL": host.url},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_four_hosts_pull_import_load_and_reload_at_once(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    url = postgres_server.create_database()
    pulled, imported = tiny_gguf(tmp_path / "src", vocab=50), tiny_gguf(tmp_path / "imp", vocab=60)
    catalog(tmp_path / "catalog.yaml", pulled, imported)
    with HfMirror() as mirror:
        # Slow enough that the four pulls overlap.
        mirror.add_file(REPO, REVISION, FILE, pulled, throttle_bps=len(pulled) * 2)
        hosts = [PgHost(f"node-{n}", tmp_path / f"node-{n}", url, mirror.url) for n in "abcd"]
        try:
            for host in hosts:
                host.start()
            for host in hosts:
                host.wait_ready("tiny")
                assert host.chat().status_code == 200

            def work(host: PgHost) -> tuple[str, int, int, int]:
                done = import_files(host, tmp_path / "imp" / "tiny-60.gguf")
                host.write({"tiny": host.deployment("tiny"), "imp": host.deployment("tiny-imp")})
                reloaded = host.admin_call("POST", "/admin/reload")
                loaded = host.admin_call(
                    "POST", "/admin/model-host/load", json={"deployment": "imp"}
                )
                return done.stderr, done.returncode, reloaded.status_code, loaded.status_code

            with ThreadPoolExecutor(len(hosts)) as pool:
                outcomes = list(pool.map(work, hosts))
            for stderr, imported_rc, reloaded, loaded in outcomes:
                assert (imported_rc, reloaded, loaded) == (0, 200, 202), stderr
            for host in hosts:
                host.wait_ready("imp", timeout_s=60)

            def settled() -> bool:
                return all(status in TERMINAL for _, _, _, status, _ in journal_rows(url)["jobs"])

            poll(settled, timeout_s=60, what="every job terminal")
        finally:
            codes = [host.stop() for host in hosts]
    assert codes == [0, 0, 0, 0]
    rows = journal_rows(url)
    jobs = rows["jobs"]
    kinds = {(node, kind) for _, node, kind, _, _ in jobs}
    for node in ("node-a", "node-b", "node-c", "node-d"):
        for kind in ("pull", "load", "reload"):
            assert (node, kind) in kinds, (node, kind, jobs)
    assert [job for job in jobs if job[3] != "succeeded"] == []
    assert [job for job in jobs if job[4] != 1] == []  # no job claimed twice
    assert {job_id: 1 for job_id, *_ in jobs} == rows["claims"]  # one claim each
    assert rows["steps"][0] == rows["steps"][1]  # one row per step
    assert rows["duplicate_results"] == []  # no step result written twice
    # Each node pulled its own copy (node-local caches); the mirror served each once.
    assert mirror.bytes_served() == 4 * len(pulled)
    imports = query(
        url,
        "SELECT node, COUNT(*) FROM jobs WHERE kind = 'pull'"
        " AND (input_json::jsonb -> 'local_files') <> '{}'::jsonb GROUP BY node ORDER BY node",
    )
    assert imports == [(f"node-{n}", 1) for n in "abcd"]  # each node imported once, itself
