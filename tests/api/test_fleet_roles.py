"""The per-node PostgreSQL roles of docs/cluster.md ("Admitting nodes", hardening), applied
as the page writes them to a real PostgreSQL, with a real ``sbproxy serve`` host running
under such a role: it joins with a join token, takes and serves a replica; the role can
change no schema; the page's revocation at the database refuses its next login."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from sbproxy.store.admission import create_join_token
from sbproxy.store.fleet import FleetStore
from tests.api.cluster_hosts import FleetHost, ready_nodes
from tests.api.pg_hosts import PASSWORD, poll
from tests.support.hf_server import HfMirror
from tests.support.postgres import PostgresServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

DOC = Path(__file__).resolve().parents[2] / "docs" / "cluster.md"
SQL = re.compile(r"^```sql\n(?P<body>.*?)^```", re.M | re.S)


def doc_sql() -> tuple[str, str]:
    """The page's two ``sql`` blocks: the grants, then the revocation at the database."""
    section = DOC.read_text().split("## Admitting nodes", 1)[1].split("\n## ", 1)[0]
    blocks = [m.group("body") for m in SQL.finditer(section)]
    assert len(blocks) == 2, blocks
    return blocks[0], blocks[1]


def test_a_host_runs_under_a_per_node_role_of_the_guide(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    owner_url = postgres_server.create_database()
    database = owner_url.rsplit("/", 1)[1]
    owner = FleetStore(owner_url)
    try:
        owner.snapshot()  # the first start, as the owner: the tables exist
        _, token, _ = create_join_token(owner, by="owner", ttl_ms=600_000, uses=1)
    finally:
        owner.close()
    grants, revoke = doc_sql()
    postgres_server.psql(grants.replace("DATABASE sbproxy", f"DATABASE {database}"), database)
    node_url = owner_url.replace(f"//{postgres_server.user}@", "//sbproxy_gpu01@")
    with psycopg.connect(node_url, autocommit=True) as connection:
        for statement in ("DROP TABLE fleet_nodes", "ALTER TABLE jobs ADD COLUMN x TEXT"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                connection.execute(statement)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            connection.execute("DELETE FROM schema_migrations")

    host = FleetHost("gpu01", tmp_path / "gpu01", node_url, mirror.url)
    host.settings = {"fleet": {**host.timing, "accept_shared_credential": False}}
    host.extra_env["SBPROXY_JOIN_TOKEN"] = token
    try:
        host.write({"tiny": {"model": "tiny", "variant": "q4_k_m", "replicas": 1}})
        host.start()

        def joined() -> bool:
            assert host.alive(), host.output[-4000:]
            return bool(host.fleet("nodes").get("nodes"))

        poll(joined, timeout_s=90, what="gpu01 joined")
        applied = subprocess.run(
            [sys.executable, "-m", "sbproxy.cli", "apply", "-f", str(host.config),
             "--admin-url", f"http://127.0.0.1:{host.admin}", "--password", PASSWORD,
             "--format", "json"],
            env=host.env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert applied.returncode == 0, applied.stdout + applied.stderr + host.output[-3000:]
        assert json.loads(applied.stdout)["fleet"]["revision"] == 1
        poll(lambda: ready_nodes(host, "tiny") == ["gpu01"], timeout_s=60, what="replica")
        assert host.chat().status_code == 200
    finally:
        host.stop()
    postgres_server.psql(revoke, database)
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(node_url, connect_timeout=5).close()
