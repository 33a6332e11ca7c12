"""Stuck placements and variants per node across real ``sbproxy serve`` hosts (issue 20): a
placement whose node cannot load it (the stand-in engine exits at start) stays, reported,
while no other node fits, and moves to a node that joins -- once, sized from the GGUF header
the failing node read, with the failing node avoided; a placement whose engine never becomes
ready moves after ``placement_timeout_ms``; a replica that served and whose engine then
crash-loops moves too; under ``heterogeneous_variants`` each replica runs
the variant that fits its node. Real PostgreSQL, real processes; fleet timing as in
``cluster_hosts`` (lost 3 s)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import psutil
import pytest
import yaml

from tests.api.cluster_hosts import FleetHost, placements, ready_nodes
from tests.api.pg_hosts import REPO, REVISION, poll, query, tiny_gguf
from tests.api.test_fleet_hosts import TINY, apply, cli, start_all, stop_all
from tests.model_host.engines.support import FAKE_SERVER, fake_llama_server
from tests.support.hf_server import HfMirror
from tests.support.postgres import PostgresServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def with_engine_mode(host: FleetHost, mode: str) -> FleetHost:
    """``host`` with a stand-in engine in fault ``mode`` (the real process fails there)."""
    host.executable = fake_llama_server(host.root / "bin-fault", mode=mode)
    host.write({})
    return host


def metric(host: FleetHost, line: str) -> bool:
    return line in host.admin_call("GET", "/metrics").text


def test_a_placement_that_fails_to_load_stays_alone_then_moves_to_a_new_node_and_avoids_its_own(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    url = postgres_server.create_database()
    broken = with_engine_mode(
        FleetHost("node-a", tmp_path / "node-a", url, mirror.url), "exit_at_start"
    )
    healthy = FleetHost("node-b", tmp_path / "node-b", url, mirror.url)
    try:
        start_all([broken])
        apply(broken, {"tiny": {**TINY, "max_launch_attempts": 1}})

        def stuck_on_a() -> bool:
            rows = placements(broken)
            return len(rows) == 1 and rows[0]["node"] == "node-a" and rows[0]["stuck"] is not None

        poll(stuck_on_a, timeout_s=90, what="the placement reported stuck on node-a")
        (first,) = placements(broken)
        assert first["stuck"] in ("load_failed", "crash_loop")
        assert first["estimate_basis"] == "file_size"  # no node held the artifact yet
        # No other node: it stays where it is, and the controller (node-a) says so.
        poll(
            lambda: metric(broken, "sbproxy_fleet_stuck_staying 1.0"),
            timeout_s=10,
            what="the stuck placement reported staying",
        )
        assert [p["id"] for p in placements(broken)] == [first["id"]]

        healthy.start()
        poll(lambda: ready_nodes(broken, "tiny") == ["node-b"], timeout_s=90, what="moved")
        assert healthy.chat().status_code == 200
        poll(
            lambda: [p["node"] for p in placements(broken)] == ["node-b"],
            timeout_s=30,
            what="the stuck placement stopped and removed",
        )
        (moved,) = placements(broken)
        assert moved["replaces"] == first["id"]
        # node-a pulled and verified the artifact before its engine failed: it reported the
        # GGUF header's facts, so the move is sized from the model's shape.
        assert moved["estimate_basis"] == "gguf_header"
        assert moved["reserved_bytes"] != first["reserved_bytes"]
        shown = broken.fleet("placements")
        assert [(a["deployment"], a["node"], a["placement"]) for a in shown["avoids"]] == [
            ("tiny", "node-a", first["id"])
        ]
        assert broken.engines() == [] and broken.deployments() == {}
        rows = query(url, "SELECT data_json FROM fleet_events WHERE type = 'stuck_replaced'")
        assert [json.loads(data)["reason"] for (data,) in rows] == [first["stuck"]]
        placed = query(url, "SELECT count(*) FROM jobs WHERE kind = 'fleet.place'")
        assert placed == [(2,)]  # once where it failed, once where it serves: nothing twice
        controller = broken.fleet("controller")["controller"]["holder"]
        holder = broken if controller == "node-a" else healthy
        assert metric(
            holder, f'sbproxy_fleet_stuck_replacements_total{{reason="{first["stuck"]}"}} 1.0'
        )
        ps = json.loads(cli(healthy, "models", "ps", "--fleet").stdout)
        assert [p["estimate_basis"] for p in ps["placements"]] == ["gguf_header"]
    finally:
        stop_all([broken, healthy])


def test_a_placement_whose_engine_never_gets_ready_moves_after_the_placement_timeout(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    url = postgres_server.create_database()
    hosts = [
        FleetHost("node-a", tmp_path / "node-a", url, mirror.url),
        FleetHost("node-b", tmp_path / "node-b", url, mirror.url),
    ]
    for host in hosts:
        host.timing = {**host.timing, "placement_timeout_ms": 6_000}
    slow = with_engine_mode(hosts[0], "hang")
    hosts[1].write({})
    try:
        start_all(hosts)
        apply(slow, {"tiny": TINY})
        poll(
            lambda: [p["node"] for p in placements(slow)] == ["node-a"],
            timeout_s=30,
            what="placed on node-a (the smaller id wins a tie)",
        )
        (first,) = placements(slow)
        poll(lambda: ready_nodes(slow, "tiny") == ["node-b"], timeout_s=90, what="moved")
        assert hosts[1].chat().status_code == 200
        rows = query(url, "SELECT data_json FROM fleet_events WHERE type = 'stuck_replaced'")
        assert [json.loads(data)["reason"] for (data,) in rows] == ["placement_timeout"]
        (moved,) = [p for p in placements(slow) if p["node"] == "node-b"]
        assert moved["replaces"] == first["id"]
        # The stuck one is stopping (its node drops it once its hanging load gives up) and
        # never counted ready.
        left = [p for p in placements(slow) if p["id"] == first["id"]]
        assert all(p["state"] == "stopping" for p in left)
    finally:
        stop_all(hosts)


def test_heterogeneous_replicas_each_run_the_variant_that_fits_their_node(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    """Two variants of one model, the larger first: the node with room runs it, the node
    whose CPU budget is too small for it runs the smaller one -- each placement names its
    variant and each node loads exactly that file."""
    sizes = {"big": 20_000, "small": 50}
    files = {name: tiny_gguf(tmp_path / name, vocab=vocab) for name, vocab in sizes.items()}
    for name, data in files.items():
        mirror.add_file(REPO, REVISION, f"{name}.gguf", data)
    variants = [
        {
            "id": name,
            "format": "gguf",
            "quant": "Q4_K_M",
            "engines": ["llama_cpp"],
            "source": f"hf:{REPO}",
            "revision": REVISION,
            "files": [
                {
                    "path": f"{name}.gguf",
                    "sha256": hashlib.sha256(data).hexdigest(),
                    "size_bytes": len(data),
                }
            ],
            "requirements": {"accelerators": ["cpu"], "min_memory_bytes": 1},
            "stability": "preview",
            "certification": "test",
        }
        for name, data in files.items()
    ]
    model = {"params": "1M", "license": "apache-2.0", "family": "test", "context_length": 4096}
    (tmp_path / "catalog.yaml").write_text(
        yaml.safe_dump(
            {
                "schema_version": 2,
                "catalog_revision": "het-1",
                "models": {"tiny-het": {**model, "variants": variants}},
            }
        )
    )
    url = postgres_server.create_database()
    # node-a offers ~300 kB to models: the small variant fits (its estimate from the file
    # size, ~7 kB, and from its header with 16 tokens of context, ~46 kB), the big one
    # (~0.8 MB from its size) does not. node-b offers the default share of RAM.
    budget = 300_000 / psutil.virtual_memory().total
    small = FleetHost("node-a", tmp_path / "node-a", url, mirror.url)
    small.extra_env["SBPROXY_CPU_MEMORY_FRACTION"] = repr(budget)
    large = FleetHost("node-b", tmp_path / "node-b", url, mirror.url)
    hosts = [small, large]
    try:
        start_all(hosts)
        deployment = {
            "model": "tiny-het",
            "replicas": 2,
            "heterogeneous_variants": True,
            "max_context": 16,
            "max_output_tokens": 8,
            "pull": "on_boot",
        }
        apply(small, {"tiny": deployment})
        poll(
            lambda: ready_nodes(small, "tiny") == ["node-a", "node-b"],
            timeout_s=90,
            what="both replicas ready",
        )
        chosen = {p["node"]: p["variant"] for p in placements(small)}
        assert chosen == {"node-a": "small", "node-b": "big"}
        for host in hosts:
            (engine,) = host.engines()
            assert f"{chosen[host.node]}.gguf" in " ".join(engine.cmdline())
            assert host.chat().status_code == 200
    finally:
        stop_all(hosts)


def test_a_ready_replica_whose_engine_then_crash_loops_moves_to_another_node(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    """node-a serves the replica (ready), then its engine dies and every relaunch exits at
    start (a flag file switches the stand-in's mode): node-a holds it in ``crash_loop`` and
    reports that; the controller moves the replica to node-b once and node-a keeps no
    engine."""
    url = postgres_server.create_database()
    flaky = FleetHost("node-a", tmp_path / "node-a", url, mirror.url)
    healthy = FleetHost("node-b", tmp_path / "node-b", url, mirror.url)
    broken_from_now = tmp_path / "relaunches-fail"
    wrapper = tmp_path / "bin-flaky" / "llama-server"
    wrapper.parent.mkdir()
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ -e "{broken_from_now}" ]; then export FAKE_LLAMA_MODE=exit_at_start;'
        " else export FAKE_LLAMA_MODE=crash_after_ready_s=2; fi\n"
        f'exec "{sys.executable}" "{FAKE_SERVER}" "$@"\n'
    )
    wrapper.chmod(0o755)
    flaky.executable = wrapper
    flaky.write({})
    try:
        start_all([flaky])
        apply(flaky, {"tiny": {**TINY, "max_launch_attempts": 2}})
        poll(lambda: ready_nodes(flaky, "tiny") == ["node-a"], timeout_s=60, what="ready on a")
        (first,) = placements(flaky)
        broken_from_now.touch()  # the engine dies in 2 s; every relaunch fails from here
        healthy.start()
        poll(lambda: ready_nodes(flaky, "tiny") == ["node-b"], timeout_s=90, what="moved to b")
        poll(
            lambda: [p["node"] for p in placements(flaky)] == ["node-b"],
            timeout_s=30,
            what="node-a's placement stopped and removed",
        )
        (moved,) = placements(flaky)
        assert moved["replaces"] == first["id"]
        assert healthy.chat().status_code == 200
        poll(lambda: flaky.engines() == [], timeout_s=30, what="no engine left on node-a")
        rows = query(url, "SELECT data_json FROM fleet_events WHERE type = 'stuck_replaced'")
        assert [json.loads(data)["reason"] for (data,) in rows] == ["crash_loop"]
        placed = query(url, "SELECT count(*) FROM jobs WHERE kind = 'fleet.place'")
        assert placed == [(2,)]
    finally:
        stop_all([flaky, healthy])
