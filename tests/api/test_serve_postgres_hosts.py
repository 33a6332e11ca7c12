"""Several real ``sbproxy serve`` hosts on one PostgreSQL journal (issue 19, item 3).

Four hosts (own node ids, caches, ports) pull from an HF-shaped mirror, load, import and
reload at once; a host SIGKILLed at a fault point of a pull or of a load is finished by its
restart under the same job id; PostgreSQL stopped (``-m fast``) and restarted under running
hosts; a SIGSTOPped host whose lease expired cannot write when it resumes.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest

from tests.api.pg_hosts import (
    FILE,
    IMP_REPO,
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
from tests.support.hf_server import HfMirror, resolve_path
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
    by_kind = Counter(kind for _, _, kind, _, _ in jobs)
    print(
        f"4 hosts: {len(jobs)} jobs ({dict(sorted(by_kind.items()))}), all succeeded,"
        f" {sum(rows['claims'].values())} claims, {rows['steps'][0]} step rows,"
        f" {len(rows['duplicate_results'])} step results written twice"
    )


PULL_POINTS = [
    "step:plan:before",
    "step:plan:committed",
    f"step:fetch:{FILE}:before",
    "download.write",
    f"step:fetch:{FILE}:after",
    f"step:fetch:{FILE}:committed",
    "step:publish:before",
    "step:publish:after",
    "step:publish:committed",
]
LOAD_POINTS = [
    "step:resolve:after",
    "step:resolve:committed",
    "step:pull:before",
    "step:pull:committed",
    "step:engine:committed",
    "step:launch:before",
    "engine.spawned",
    "step:launch:after",
    "step:launch:committed",
]


def node_jobs(url: str, node: str) -> list[tuple[str, str, str]]:
    """``(kind, job id, status)`` of ``node``'s pull and load jobs, oldest first."""
    return [
        (kind, job_id, status)
        for kind, job_id, status in query(
            url,
            "SELECT kind, id, status FROM jobs WHERE node = %s AND kind IN ('pull', 'load')"
            " ORDER BY created_at_ms, id",
            node,
        )
    ]


@pytest.mark.parametrize("fault", PULL_POINTS + LOAD_POINTS)
def test_a_host_killed_at_a_fault_point_is_finished_by_its_restart(
    tmp_path: Path, postgres_server: PostgresServer, fault: str
) -> None:
    url = postgres_server.create_database()
    pulled = tiny_gguf(tmp_path / "src", vocab=50)
    catalog(tmp_path / "catalog.yaml", pulled, pulled)
    with HfMirror() as mirror:
        mirror.add_file(REPO, REVISION, FILE, pulled)
        host = PgHost("node-k", tmp_path / "node-k", url, mirror.url)
        killed = host.start(fault=fault)
        try:
            killed.wait(timeout=90)
        finally:
            host.stop()
        assert killed.returncode == -signal.SIGKILL, host.output
        before = node_jobs(url, "node-k")
        assert "running" in {status for *_, status in before}, before
        try:
            host.start()  # the same node id, cache and journal
            host.wait_ready("tiny")
            assert host.chat().status_code == 200
            poll(
                lambda: {status for *_, status in node_jobs(url, "node-k")} == {"succeeded"},
                timeout_s=30,
                what="every job succeeded",
            )
        finally:
            assert host.stop() == 0, host.output
    after = node_jobs(url, "node-k")
    # The interrupted jobs finished under their original ids. The only new job a restart
    # may add is the load's pull of an artifact the killed run had already published
    # (its pull job ended before the kill): a cache hit that fetched nothing.
    assert after[: len(before)] == [(kind, job_id, "succeeded") for kind, job_id, _ in before]
    new = after[len(before) :]
    assert [kind for kind, *_ in new] in ([], ["pull"]), after
    rows = journal_rows(url)
    attempts = {job_id: attempt for job_id, _, _, _, attempt in rows["jobs"]}
    assert rows["claims"] == attempts  # one claim per attempt
    assert [attempts[job_id] for _, job_id, _ in new] == [1] * len(new)  # a fresh job
    assert rows["steps"][0] == rows["steps"][1]  # one row per step
    # No step's result is recorded twice, but for a launch recorded whose engine died with
    # the host: the restart sees it gone (the step's observe) and launches again.
    twice = [name for _, name, _ in rows["duplicate_results"]]
    assert twice == (["launch"] if fault == "step:launch:committed" else []), rows
    assert mirror.bytes_served() <= 2 * len(pulled)  # at most a partial and a full copy
    snapshots = host.cache / "snapshots"
    assert not [p for p in snapshots.iterdir() if p.name.startswith(".")]  # nothing half-done


def test_hosts_keep_serving_through_a_postgres_restart(
    tmp_path: Path, own_postgres_server: PostgresServer
) -> None:
    url = own_postgres_server.create_database()
    pulled = tiny_gguf(tmp_path / "src", vocab=50)
    catalog(tmp_path / "catalog.yaml", pulled, pulled)
    with HfMirror() as mirror:
        mirror.add_file(REPO, REVISION, FILE, pulled)
        hosts = [PgHost(f"node-{n}", tmp_path / f"node-{n}", url, mirror.url) for n in "ab"]
        try:
            for host in hosts:
                host.start()
            for host in hosts:
                host.wait_ready("tiny")
            acknowledged = {}
            # Loads acknowledged and finished before the outage (one in flight through it:
            # the next test).
            for host in hosts:
                answer = host.admin_call(
                    "POST", "/admin/model-host/load", json={"deployment": "tiny"}
                )
                assert answer.status_code == 202, answer.text
                acknowledged[host.node] = answer.json()["job_id"]
            ids = list(acknowledged.values())
            poll(
                lambda: query(url, "SELECT COUNT(*) FROM jobs WHERE id = ANY(%s)"
                              " AND status = 'succeeded'", ids) == [(2,)],
                timeout_s=30, what="both loads done",
            )  # fmt: skip

            own_postgres_server.stop_server("fast")
            for host in hosts:
                assert host.chat().status_code == 200  # the loaded engine keeps serving
                assert host.admin_call("GET", "/admin/model-host/status").status_code == 200
                refused = host.admin_call(
                    "POST", "/admin/model-host/load", json={"deployment": "tiny"}
                )
                assert refused.status_code == 503, refused.text
                assert refused.json()["code"] == "journal_unavailable", refused.text
                assert f"127.0.0.1:{own_postgres_server.port}" in refused.text
                assert host.chat().status_code == 200  # a refused mutation changed nothing
                assert host.alive(), host.output

            own_postgres_server.start_server()
            for host in hosts:
                again = host.admin_call(
                    "POST", "/admin/model-host/load", json={"deployment": "tiny"}
                )
                assert again.status_code == 202, again.text
                acknowledged[f"{host.node} again"] = again.json()["job_id"]

            def finished() -> bool:
                ids = list(acknowledged.values())
                rows = query(url, "SELECT status FROM jobs WHERE id = ANY(%s)", ids)
                return len(rows) == len(ids) and {status for (status,) in rows} == {"succeeded"}

            poll(finished, timeout_s=60, what="every acknowledged job succeeded")
        finally:
            codes = [host.stop() for host in hosts]
    assert codes == [0, 0], [host.output for host in hosts]
    rows = journal_rows(url)
    assert [job for job in rows["jobs"] if job[3] != "succeeded"] == []  # none lost or stuck
    assert rows["steps"][0] == rows["steps"][1]


def test_a_load_in_flight_through_a_postgres_outage_is_resumed_under_its_id(
    tmp_path: Path, own_postgres_server: PostgresServer
) -> None:
    url = own_postgres_server.create_database()
    pulled, imported = tiny_gguf(tmp_path / "src", vocab=50), tiny_gguf(tmp_path / "imp", vocab=60)
    catalog(tmp_path / "catalog.yaml", pulled, imported)
    with HfMirror() as mirror:
        mirror.add_file(REPO, REVISION, FILE, pulled)
        # Every download of imp's file stops half-way until released: both pulls are in
        # flight when the server stops, and finish while it is away.
        held = mirror.add_file(IMP_REPO, REVISION, FILE, imported, hold_after=len(imported) // 2)
        hosts = [PgHost(f"node-{n}", tmp_path / f"node-{n}", url, mirror.url) for n in "ab"]
        try:
            for host in hosts:
                host.write(
                    {
                        "tiny": host.deployment("tiny"),
                        "imp": host.deployment("tiny-imp", warm=False),
                    }
                )
                host.start()
            for host in hosts:
                host.wait_ready("tiny")
            acknowledged = {}
            for host in hosts:
                answer = host.admin_call(
                    "POST", "/admin/model-host/load", json={"deployment": "imp"}
                )
                assert answer.status_code == 202, answer.text
                acknowledged[host.node] = answer.json()["job_id"]
            poll(lambda: held.holding == 2, timeout_s=30, what="both imp pulls held mid-way")
            pulls = dict(
                query(
                    url,
                    "SELECT node, id FROM jobs WHERE kind = 'pull' AND status = 'running'"
                    " AND input_json LIKE %s",
                    "%tiny-imp%",
                )
            )

            own_postgres_server.stop_server("fast")
            held.release()
            whole = resolve_path(IMP_REPO, REVISION, FILE)
            poll(
                lambda: mirror.bytes_served(whole) >= 2 * len(imported),
                timeout_s=30,
                what="both imp downloads done while the journal is away",
            )
            # Each pull's next journal write (the download's last progress) met the outage.
            for host in hosts:
                said = f"job {pulls[host.node]} (pull)"
                poll(
                    lambda host=host, said=said: any(  # type: ignore[misc]
                        said in line and "[journal_unavailable]" in line
                        for line in host.output.splitlines()
                    ),
                    timeout_s=30,
                    what=f"{host.node}'s pull met the outage",
                )
                assert host.chat().status_code == 200  # what was loaded keeps serving
            own_postgres_server.start_server()

            for host in hosts:
                host.wait_ready("imp", timeout_s=90)
            ids = list(acknowledged.values())
            poll(
                lambda: query(url, "SELECT COUNT(*) FROM jobs WHERE id = ANY(%s)"
                              " AND status = 'succeeded'", ids) == [(2,)],
                timeout_s=30, what="both acknowledged loads succeeded",
            )  # fmt: skip
        finally:
            codes = [host.stop() for host in hosts]
    assert codes == [0, 0], [host.output for host in hosts]
    rows = journal_rows(url)
    # Nothing acknowledged was lost or failed: the loads finished under the ids they were
    # acknowledged with, and each node's imp pull under its one job.
    assert [job for job in rows["jobs"] if job[3] != "succeeded"] == []
    imp_pulls = query(
        url,
        "SELECT node, id, output_json::jsonb -> 'transferred_bytes' FROM jobs"
        " WHERE kind = 'pull' AND input_json LIKE %s ORDER BY created_at_ms, id",
        "%tiny-imp%",
    )
    # The acknowledged pulls finished under their ids; a load resumed after its pull ended
    # may join the artifact once more, which is a cache hit that fetches nothing.
    for node, job_id in pulls.items():
        mine = [(pull, sent) for owner, pull, sent in imp_pulls if owner == node]
        assert mine[0][0] == job_id, imp_pulls
        assert [sent for _, sent in mine[1:]] == [0] * (len(mine) - 1), imp_pulls
    assert mirror.bytes_served(whole) == 2 * len(imported)  # each host downloaded it once
    assert rows["steps"][0] == rows["steps"][1]
    assert rows["duplicate_results"] == []
    for host in hosts:
        snapshot = [p for p in (host.cache / "snapshots").rglob(FILE) if p.read_bytes() == imported]
        assert len(snapshot) == 1, host.node


def test_a_stopped_host_whose_lease_expired_cannot_write_when_it_resumes(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    url = postgres_server.create_database()
    pulled = tiny_gguf(tmp_path / "src", vocab=50)
    catalog(tmp_path / "catalog.yaml", pulled, pulled)
    with HfMirror() as mirror:
        # About 40 s of download: the stopped host is in the middle of it.
        mirror.add_file(REPO, REVISION, FILE, pulled, throttle_bps=len(pulled) // 40)
        host = PgHost("node-s", tmp_path / "node-s", url, mirror.url)
        process = host.start()
        try:

            def pulling() -> list[tuple[str, int, str]]:
                try:
                    return [
                        (job_id, attempt, progress)
                        for job_id, attempt, progress in query(
                            url,
                            "SELECT id, attempt, progress_json FROM jobs"
                            " WHERE kind = 'pull' AND status = 'running'",
                        )
                        if progress and '"done": 0' not in progress
                    ]
                except psycopg.errors.UndefinedTable:  # the schema is still being made
                    return []

            poll(lambda: bool(pulling()), timeout_s=60, what="the pull under way")
            ((job_id, first_attempt, _),) = pulling()
            process.send_signal(signal.SIGSTOP)
            mirror.entry(REPO, REVISION, FILE).throttle_bps = None
            # Another runner of the same node: it waits for the lease to lapse on the
            # database's clock (the stopped host's heartbeats stopped), then takes the job.
            taken = subprocess.run(
                [sys.executable, "-m", "sbproxy.cli", "models", "pull", "tiny",
                 "--cache-dir", str(host.cache),
                 "--catalog-file", str(tmp_path / "catalog.yaml"), "--format", "json"],
                env={**host.env, "SBPROXY_JOURNAL_URL": url},
                capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            assert taken.returncode == 0, taken.stderr
            ((status, attempt),) = query(
                url, "SELECT status, attempt FROM jobs WHERE id = %s", job_id
            )
            assert (status, attempt) == ("succeeded", first_attempt + 1)

            process.send_signal(signal.SIGCONT)
            host.wait_ready("tiny", timeout_s=60)  # the resumed host serves the pulled artifact
            assert host.chat().status_code == 200
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
            code = host.stop()
    assert code == 0, host.output
    # The resumed host's writes for its old attempt were fenced off, and it said so.
    assert f"job {job_id}: " in host.output and "no longer holds the job" in host.output
    ((status, attempt),) = query(url, "SELECT status, attempt FROM jobs WHERE id = %s", job_id)
    assert (status, attempt) == ("succeeded", first_attempt + 1)  # finished once, unchanged
    rows = journal_rows(url)
    assert rows["claims"][job_id] == first_attempt + 1  # one claim per attempt
    assert rows["steps"][0] == rows["steps"][1]
    assert rows["duplicate_results"] == []  # the stopped run recorded no result after resuming
    snapshot = next((host.cache / "snapshots").iterdir())
    files = list(snapshot.rglob("*.gguf"))
    assert [p.read_bytes() for p in files] == [pulled]  # the published file is intact
