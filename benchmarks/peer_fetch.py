"""Artifacts from peers, measured: ``python benchmarks/peer_fetch.py [--size-mib N]``.

Three real ``sbproxy serve`` hosts (``node-a``, ``node-b``, ``node-c``, each its own cache) on
a throw-away PostgreSQL place one deployment with ``replicas: 3`` of a generated artifact --
a valid GGUF header followed by random bytes, ``--size-mib`` MiB in all (default 1024: 1 GiB)
-- from an empty fleet. The upstream is the tests' HF-shaped mirror on loopback
(:class:`tests.support.hf_server.HfMirror`, serving the file from disk), which counts the
body bytes it sends. The engine is the tests' stand-in ``llama-server`` (a real process that
serves ``/health`` and the OpenAI routes; it does not load the weights): "ready" is the
fleet's placement state ``ready``, i.e. pulled, verified, published, launched and routable.

Two runs, each on its own database and caches:

* ``peers``: the product as it is -- the first node in id order fetches from the upstream,
  the others wait for it and fetch from its cache over the peer listener;
* ``upstream_only``: the same hosts with ``fleet.peer_artifacts: false``, so that no peer is
  asked (what every fleet did before issue 33: each node pulls its own copy).

Prints ONE JSON object: ``size_bytes``, and per run ``upstream_bytes``,
``upstream_ratio`` (upstream bytes / file size: 1.0 with peers, 3.0 without),
``all_ready_s`` (from ``sbproxy apply`` until the third replica is ``ready``), ``sources``
(bytes by source of each node's pull job) and ``heartbeat_ms``. ``--skip-baseline`` runs
only ``peers``. Run from the repository root with the test environment (``.venv``,
PostgreSQL's Debian binaries as ``scripts/test.sh`` installs them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml

from tests.api.cluster_hosts import FleetHost, ready_nodes
from tests.api.pg_hosts import FILE, REPO, REVISION, poll, query
from tests.api.test_fleet_hosts import apply, start_all, stop_all
from tests.model_host.runtime.support import write_gguf
from tests.support.hf_server import HfMirror
from tests.support.postgres import running_server

NODES = ("node-a", "node-b", "node-c")
BLOCK = 8 << 20


class _UpstreamOnlyHost(FleetHost):
    """A fleet member that asks no peer for files (``fleet.peer_artifacts: false``)."""

    def document(self, deployments: dict[str, dict[str, Any]]) -> dict[str, Any]:
        document = super().document(deployments)
        document["proxy"]["model_host"]["fleet"]["peer_artifacts"] = False
        return document


def make_artifact(path: Path, size: int) -> str:
    """A GGUF header padded with random bytes to ``size``; its SHA-256."""
    header = write_gguf(path.with_suffix(".header"), vocab=50).read_bytes()
    sha = hashlib.sha256(header)
    with path.open("wb") as out:
        out.write(header)
        left = size - len(header)
        while left > 0:
            block = os.urandom(min(BLOCK, left))
            sha.update(block)
            out.write(block)
            left -= len(block)
    return sha.hexdigest()


def write_catalog(path: Path, sha: str, size: int) -> None:
    variant = {
        "id": "q4_k_m",
        "format": "gguf",
        "quant": "Q4_K_M",
        "engines": ["llama_cpp"],
        "source": f"hf:{REPO}",
        "revision": REVISION,
        "files": [{"path": FILE, "sha256": sha, "size_bytes": size}],
        "requirements": {"accelerators": ["cpu"], "min_memory_bytes": 1},
        "stability": "preview",
        "certification": "test",
    }
    model = {"params": "1M", "license": "apache-2.0", "family": "test", "context_length": 4096}
    document = {
        "schema_version": 2,
        "catalog_revision": "peer-fetch-1",
        "models": {"tiny": {**model, "variants": [variant]}},
    }
    path.write_text(yaml.safe_dump(document))


def run(root: Path, url: str, mirror: HfMirror, *, peers: bool) -> dict[str, Any]:
    """One placement of three replicas from an empty fleet; its figures."""
    kind = FleetHost if peers else _UpstreamOnlyHost
    hosts = [kind(node, root / node, url, mirror.url) for node in NODES]
    for host in hosts:
        host.settings = {"cache": {"directory": str(host.cache), "budget_gib": 64}}
        host.write({})
    before = mirror.bytes_served(FILE)
    try:
        start_all(hosts)
        poll(
            lambda: len(hosts[0].fleet("nodes").get("nodes", [])) == len(NODES),
            timeout_s=60,
            what="every node joined",
        )
        started = time.monotonic()
        apply(hosts[0], {"tiny": {"model": "tiny", "variant": "q4_k_m", "replicas": 3}})
        poll(
            lambda: ready_nodes(hosts[0], "tiny") == list(NODES),
            timeout_s=1800,
            what="three replicas ready",
        )
        elapsed = time.monotonic() - started
        sources = {
            node: json.loads(output or "{}").get("sources")
            for node, output in query(
                url, "SELECT node, output_json FROM jobs WHERE kind = 'pull' ORDER BY node"
            )
        }
    finally:
        stop_all(hosts)
    return {
        "upstream_bytes": mirror.bytes_served(FILE) - before,
        "all_ready_s": round(elapsed, 2),
        "sources": sources,
        "heartbeat_ms": hosts[0].timing["heartbeat_ms"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="artifact size (MiB)")
    parser.add_argument("--skip-baseline", action="store_true", help="only the peers run")
    args = parser.parse_args(argv)
    if args.size_mib < 1:
        parser.error("--size-mib must be at least 1")
    size = args.size_mib << 20
    root = Path(tempfile.mkdtemp(prefix="sbproxy-peer-fetch-"))
    report: dict[str, Any] = {"size_bytes": size}
    try:
        source = root / "artifact.gguf"
        sha = make_artifact(source, size)
        with running_server() as postgres, HfMirror() as mirror:
            mirror.add_file(REPO, REVISION, FILE, source)
            modes = [True] if args.skip_baseline else [True, False]
            for peers in modes:
                name = "peers" if peers else "upstream_only"
                base = root / name
                base.mkdir()
                write_catalog(base / "catalog.yaml", sha, size)
                print(f"--- {name}", file=sys.stderr, flush=True)
                figures = run(base, postgres.create_database(), mirror, peers=peers)
                figures["upstream_ratio"] = round(figures["upstream_bytes"] / size, 3)
                report[name] = figures
                shutil.rmtree(base, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(report, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
