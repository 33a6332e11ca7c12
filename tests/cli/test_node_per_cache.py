"""Two caches on one machine (one host name) sharing one PostgreSQL journal are two nodes:
each cache's jobs record its own node id, so one cache's ``models import`` never joins the
other's job (issue 30, item 12)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg

from tests.catalog.builders import document, entry, variant, write
from tests.support.postgres import PostgresServer

GGUF = b"GGUF" + bytes(range(256)) * 8


def _catalog(path: Path) -> Path:
    files = [
        {"path": "tiny.gguf", "sha256": hashlib.sha256(GGUF).hexdigest(), "size_bytes": len(GGUF)}
    ]
    doc = document(
        models={
            "tiny": entry(
                variant("q4_k_m", source="hf:org/tiny", files=files, min_memory_bytes=1024)
            )
        }
    )
    return write(path, doc)


def _import(url: str, cache: Path, catalog: Path, local: Path) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k not in ("SBPROXY_NODE_ID", "SBPROXY_CACHE_DIR")}
    done = subprocess.run(
        [sys.executable, "-m", "sbproxy.cli", "models", "import", str(local), "--model", "tiny",
         "--cache-dir", str(cache), "--catalog-file", str(catalog), "--format", "json"],
        env={**env, "SBPROXY_JOURNAL_URL": url}, capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)["artifacts"]
    return dict(row)


def test_two_caches_on_one_machine_are_two_nodes_of_one_postgres_journal(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    url = postgres_server.create_database()
    catalog = _catalog(tmp_path / "catalog.yaml")
    local = tmp_path / "tiny.gguf"
    local.write_bytes(GGUF)
    first, second = tmp_path / "cache-a", tmp_path / "cache-b"
    a = _import(url, first, catalog, local)
    b = _import(url, second, catalog, local)
    # Each cache holds its own verified copy: the second import ran, it did not join.
    assert str(a["snapshot_path"]).startswith(str(first))
    assert str(b["snapshot_path"]).startswith(str(second))
    assert (Path(str(b["snapshot_path"])) / "tiny.gguf").read_bytes() == GGUF
    with psycopg.connect(url) as connection:
        recorded = {str(r[0]) for r in connection.execute("SELECT DISTINCT node FROM jobs")}
    assert len(recorded) == 2, recorded  # not the one host name for both
    kept = {(first / "node-id").read_text().strip(), (second / "node-id").read_text().strip()}
    assert recorded == kept
