"""Artifact-aware placement and artifacts from peers across real ``sbproxy serve`` hosts
(issue 33, items 1 and 2): a node that holds the artifact wins the placement and the
decision says so; a node that needs an artifact another member holds fetches it from that
member's cache over the peer listener (the upstream serves nothing more); a peer that fails
mid-transfer, serves corrupted bytes or does not hold the file never makes a bad snapshot:
the pull falls back to the upstream and records why. Real PostgreSQL, real processes, the
HF-shaped mirror as the upstream (it counts the bytes it serves); a TCP relay in front of a
peer's gateway cuts a transfer mid-answer (a fault no real host makes on demand)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.api.cluster_hosts import CREDENTIAL, FleetHost, placements, ready_nodes
from tests.api.pg_hosts import FILE, poll, query
from tests.api.test_fleet_hosts import TINY, apply, cli, start_all, stop_all
from tests.support.hf_server import HfMirror
from tests.support.postgres import PostgresServer
from tests.support.tcp_relay import TcpRelay

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


NODES = ("node-a", "node-b", "node-c")


def only(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """The one job of ``jobs``."""
    (job,) = jobs
    return job


def pulls(url: str, node: str) -> list[dict[str, Any]]:
    """The pull jobs ``node`` ran, oldest first: status, output and events."""
    rows = query(
        url,
        "SELECT id, status, output_json FROM jobs WHERE kind = 'pull' AND node = %s"
        " ORDER BY created_at_ms",
        node,
    )
    found = []
    for job_id, status, output in rows:
        events = query(
            url,
            "SELECT type, data_json FROM job_events WHERE job_id = %s ORDER BY seq",
            job_id,
        )
        found.append(
            {
                "status": status,
                "output": json.loads(output) if output else None,
                "events": [(kind, json.loads(data)) for kind, data in events],
            }
        )
    return found


def events_of(job: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [data for event, data in job["events"] if event == kind]


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def the_file(root: Path) -> tuple[str, int]:
    """The SHA-256 and size of ``tiny``'s one file, as the hosts' catalog pins it."""
    document = yaml.safe_load((root / "catalog.yaml").read_text())
    (pinned,) = document["models"]["tiny"]["variants"][0]["files"]
    return str(pinned["sha256"]), int(pinned["size_bytes"])


def first_replica_on_a(
    tmp_path: Path, url: str, mirror: HfMirror, *, advertise: str | None = None
) -> FleetHost:
    """node-a started alone, ``tiny`` placed and ready on it (pulled from the upstream)."""
    a = FleetHost("node-a", tmp_path / "node-a", url, mirror.url, advertise_url=advertise)
    a.write({})
    start_all([a])
    apply(a, {"tiny": TINY})
    poll(lambda: ready_nodes(a, "tiny") == ["node-a"], timeout_s=90, what="tiny ready on a")
    return a


def second_replica_on_b(a: FleetHost, b: FleetHost) -> None:
    """node-b joins, and ``tiny`` gets a second replica: it can only go to node-b."""
    b.start()
    poll(lambda: len(a.fleet("nodes").get("nodes", [])) == 2, timeout_s=60, what="b joined")
    apply(a, {"tiny": {**TINY, "replicas": 2}})
    poll(
        lambda: ready_nodes(a, "tiny") == ["node-a", "node-b"],
        timeout_s=120,
        what="the second replica ready on node-b",
    )


def published_right(host: FleetHost, sha: str) -> None:
    """``host`` published the artifact with the catalog's bytes, and nothing else."""
    blobs = sorted(p.name for p in (host.cache / "blobs" / "sha256").iterdir())
    assert blobs == [sha]
    assert sha256_of(host.cache / "blobs" / "sha256" / sha) == sha
    (snapshot,) = list((host.cache / "snapshots").iterdir())
    assert sha256_of(snapshot / FILE) == sha


def test_a_second_node_fetches_the_artifact_from_the_member_that_holds_it(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    url = postgres_server.create_database()
    sha, size = the_file(tmp_path)
    a = first_replica_on_a(tmp_path, url, mirror)
    b = FleetHost("node-b", tmp_path / "node-b", url, mirror.url)
    try:
        assert mirror.bytes_served(FILE) == size
        # node-a reports what its cache holds: digest, size, verified.
        (me,) = [n for n in a.fleet("nodes")["nodes"] if n["id"] == "node-a"]
        (digest,) = me["artifact_inventory"]
        assert me["artifact_inventory"][digest] == {"bytes": size, "verified": True}

        second_replica_on_b(a, b)
        assert mirror.bytes_served(FILE) == size  # the upstream served nothing more
        (job,) = pulls(url, "node-b")
        assert job["status"] == "succeeded"
        assert job["output"]["sources"] == {"node-a": size}
        assert events_of(job, "source") == [
            {"path": FILE, "source": "node-a", "bytes": size, "resumed_from": 0}
        ]
        published_right(b, sha)
        # The fleet shows where the artifact is cached, now on both nodes.
        ps = json.loads(cli(b, "models", "ps", "--fleet").stdout)
        assert [(x["artifact_digest"], x["nodes"]) for x in ps["artifacts"]] == [
            (digest, ["node-a", "node-b"])
        ]
    finally:
        stop_all([a, b])


def test_three_nodes_placing_one_deployment_take_the_artifact_from_the_upstream_once(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    url = postgres_server.create_database()
    sha, size = the_file(tmp_path)
    hosts = [FleetHost(n, tmp_path / n, url, mirror.url) for n in NODES]
    for host in hosts:
        host.write({})
    try:
        start_all(hosts)
        apply(hosts[0], {"tiny": {**TINY, "replicas": 3}})
        poll(
            lambda: ready_nodes(hosts[0], "tiny") == ["node-a", "node-b", "node-c"],
            timeout_s=120,
            what="three replicas ready",
        )
        assert mirror.bytes_served(FILE) == size  # 1.0x the file, not 3x
        assert [r.range_start for r in mirror.requests] == [None]
        # One node took it from the upstream (the smallest id among those pulling when it
        # looked: usually node-a, but a node whose pull started first may find itself alone);
        # the other two took all of it from members.
        sources = {node: only(pulls(url, node))["output"]["sources"] for node in NODES}
        upstream = [node for node, got in sources.items() if got == {"upstream": size}]
        assert len(upstream) == 1, sources
        for node, got in sources.items():
            if node in upstream:
                continue
            ((peer, sent),) = got.items()
            assert peer in NODES and peer != node and sent == size, sources
            assert events_of(only(pulls(url, node)), "peer_failed") == []
        for host in hosts:
            published_right(host, sha)
    finally:
        stop_all(hosts)


def test_the_node_that_holds_the_artifact_wins_the_placement_and_the_reason_says_so(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    url = postgres_server.create_database()
    # node-b pulls the artifact first (the only node then), and the deployment is removed:
    # its cache keeps the artifact.
    b = FleetHost("node-b", tmp_path / "node-b", url, mirror.url)
    a = FleetHost("node-a", tmp_path / "node-a", url, mirror.url)
    try:
        start_all([b])
        apply(b, {"tiny": TINY})
        poll(lambda: ready_nodes(b, "tiny") == ["node-b"], timeout_s=90, what="ready on b")
        apply(b, {})
        poll(lambda: placements(b) == [], timeout_s=60, what="the placement removed")
        a.start()
        poll(lambda: len(b.fleet("nodes").get("nodes", [])) == 2, timeout_s=60, what="a joined")
        # Equal nodes: without locality the tie goes to the smaller id, node-a.
        apply(b, {"tiny": TINY})
        poll(lambda: ready_nodes(b, "tiny") == ["node-b"], timeout_s=90, what="placed on b")
        rows = query(
            url,
            "SELECT input_json FROM jobs WHERE kind = 'fleet.place' ORDER BY created_at_ms",
        )
        reason = json.loads(rows[-1][0])["reason"]
        assert reason.startswith("node-b holds sha256:"), reason
        assert "KiB)" in reason or " B)" in reason, reason  # the size it reported
    finally:
        stop_all([a, b])


def test_a_peer_blob_needs_the_fleet_credential_and_answers_ranges(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    url = postgres_server.create_database()
    sha, size = the_file(tmp_path)
    a = first_replica_on_a(tmp_path, url, mirror)
    try:
        blob = f"http://127.0.0.1:{a.gateway}/fleet/v1/blobs/sha256/{sha}"
        assert httpx.get(blob).status_code == 401
        wrong = httpx.get(blob, headers={"Authorization": "Bearer nope"})
        assert (wrong.status_code, wrong.json()["code"]) == (401, "peer_unauthorized")
        auth = {"Authorization": f"Bearer {CREDENTIAL}"}
        whole = httpx.get(blob, headers=auth)
        assert whole.status_code == 200
        assert hashlib.sha256(whole.content).hexdigest() == sha
        assert whole.headers["etag"] == f'"sha256:{sha}"'
        part = httpx.get(blob, headers={**auth, "Range": "bytes=100-"})
        assert part.status_code == 206
        assert part.headers["content-range"] == f"bytes 100-{size - 1}/{size}"
        assert part.content == whole.content[100:]
        past = httpx.get(blob, headers={**auth, "Range": f"bytes={size}-"})
        assert past.status_code == 416
        absent = httpx.get(blob.replace(sha, "0" * 64), headers=auth)
        assert (absent.status_code, absent.json()["code"]) == (404, "blob_not_held")
        escape = httpx.get(blob.replace(sha, "..%2F..%2Fnode-id"), headers=auth)
        assert escape.status_code in (400, 404)
        assert escape.status_code != 200
    finally:
        stop_all([a])


def test_a_peer_transfer_cut_once_continues_from_the_partial_with_a_range_request(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    url = postgres_server.create_database()
    sha, size = the_file(tmp_path)
    a = FleetHost("node-a", tmp_path / "node-a", url, mirror.url)
    with TcpRelay(a.gateway) as relay:
        a.advertise_url = f"http://127.0.0.1:{relay.port}"
        a.write({})
        b = FleetHost("node-b", tmp_path / "node-b", url, mirror.url)
        try:
            start_all([a])
            apply(a, {"tiny": TINY})
            poll(lambda: ready_nodes(a, "tiny") == ["node-a"], timeout_s=90, what="ready on a")
            relay.cut_after, relay.cut_times = 1500, 1  # the first transfer breaks mid-file
            second_replica_on_b(a, b)
            assert mirror.bytes_served(FILE) == size  # the upstream served a's pull only
            (job,) = pulls(url, "node-b")
            assert job["output"]["sources"] == {"node-a": size}
            (source,) = events_of(job, "source")
            assert source["source"] == "node-a"
            assert 0 < source["resumed_from"] < size  # the second transfer was a Range
            assert source["bytes"] == size
            assert events_of(job, "peer_failed") == []
            published_right(b, sha)
        finally:
            stop_all([a, b])


@pytest.mark.parametrize("fault", ["cut_mid_transfer", "corrupted", "not_held"])
def test_a_failing_peer_never_publishes_a_bad_snapshot_and_the_upstream_serves_instead(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror, fault: str
) -> None:
    url = postgres_server.create_database()
    sha, size = the_file(tmp_path)
    a = FleetHost("node-a", tmp_path / "node-a", url, mirror.url)
    with TcpRelay(a.gateway) as relay:
        # node-a's peers reach its gateway through the relay.
        a.advertise_url = f"http://127.0.0.1:{relay.port}"
        a.write({})
        b = FleetHost("node-b", tmp_path / "node-b", url, mirror.url)
        try:
            start_all([a])
            apply(a, {"tiny": TINY})
            poll(lambda: ready_nodes(a, "tiny") == ["node-a"], timeout_s=90, what="ready on a")
            held = a.cache / "blobs" / "sha256" / sha
            expected_code = {"cut_mid_transfer": "transport", "corrupted": "digest_mismatch"}
            if fault == "cut_mid_transfer":
                relay.cut_after = 1500  # the answer's headers and about 1.2 KiB of the body
            elif fault == "corrupted":
                held.chmod(0o644)
                damaged = bytearray(held.read_bytes())
                damaged[-10:] = b"X" * 10  # the same size: only the SHA-256 can tell
                held.write_bytes(bytes(damaged))
            else:
                held.chmod(0o644)
                held.unlink()  # it still reports the artifact: the route must say 404
            second_replica_on_b(a, b)
            assert mirror.bytes_served(FILE) == 2 * size  # a's pull, then b's fallback
            (job,) = pulls(url, "node-b")
            assert job["status"] == "succeeded"
            assert job["output"]["sources"] == {"upstream": size}
            (failed,) = events_of(job, "peer_failed")
            assert failed["node"] == "node-a"
            assert failed["code"] == expected_code.get(fault, "http_status")
            if fault == "not_held":
                assert "404" in failed["error"]
            published_right(b, sha)
        finally:
            stop_all([a, b])
