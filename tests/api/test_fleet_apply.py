"""``sbproxy apply`` on a fleet (issue 30, items 9 and 24 and the operator guide), on real
``sbproxy serve`` hosts of one real PostgreSQL journal:

* two applies through two hosts, interleaved at an exact point (the first host stops itself
  right after its compare-and-set wrote, the second writes, the first resumes): each
  reports the revision it committed, never the other writer's;
* a desired-state document applied through a member that serves another file becomes the
  fleet's next revision (no ``source_mismatch``), and the summary, text and JSON, shows
  the fleet's change: added, changed (``tiny: replicas 1 -> 2``), removed;
* a fleet credential rotated by a reload reaches the lease route (the new one accepted, the
  old refused) and the fence ask; a fleet timing change on reload is refused with
  ``restart_required`` naming the field, and nothing of that file is applied.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import psutil
import pytest
import yaml

from sbproxy.config import load_config
from sbproxy.fleet.agent import ask_peers_http
from sbproxy.model_host.runtime.reload import listener_changes
from tests.api.cluster_hosts import CREDENTIAL, FleetHost, ready_nodes
from tests.api.pg_hosts import PASSWORD, poll
from tests.api.test_fleet_hosts import start_all
from tests.support.hf_server import HfMirror
from tests.support.postgres import PostgresServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TINY = {"model": "tiny", "variant": "q4_k_m"}
# Long enough that a host stopped for a few seconds does not fence itself meanwhile.
CALM = {"heartbeat_ms": 500, "fence_after_ms": 30_000, "lost_after_ms": 60_000}
ROTATED = "rotated-fleet-credential-0123456789"


def apply_args(host: FleetHost, path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "sbproxy.cli", "apply", "-f", str(path), "--admin-url",
            f"http://127.0.0.1:{host.admin}", "--password", PASSWORD, *extra]  # fmt: skip


def apply(host: FleetHost, path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``sbproxy apply -f path`` through ``host``'s admin API."""
    return subprocess.run(
        apply_args(host, path, *extra),
        env=host.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def applied(host: FleetHost, path: Path) -> dict[str, Any]:
    """``apply --format json``'s answer (exit 0 asserted)."""
    done = apply(host, path, "--format", "json")
    assert done.returncode == 0, done.stdout + done.stderr
    return dict(json.loads(done.stdout))


def desired_revision(host: FleetHost) -> int | None:
    found = host.admin_call("GET", "/admin/model-host/deployments").json()["revision"]
    return int(found) if found is not None else None


def test_two_applies_through_two_hosts_each_report_the_revision_they_committed(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    url = postgres_server.create_database()
    a = FleetHost("node-a", tmp_path / "node-a", url, mirror.url, timing=dict(CALM))
    b = FleetHost("node-b", tmp_path / "node-b", url, mirror.url, timing=dict(CALM))
    try:
        # node-a stops itself (SIGSTOP) right after its compare-and-set wrote.
        start_all([a, b], fault="apply.fleet_written@stop")
        a.write({"tiny": TINY})
        first = subprocess.Popen(
            [*apply_args(a, a.config, "--format", "json")],
            env=a.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert a.process is not None
        stopped = psutil.Process(a.process.pid)
        poll(
            lambda: stopped.status() == psutil.STATUS_STOPPED,
            timeout_s=60,
            what="node-a stopped after its write",
        )
        assert desired_revision(b) == 1  # node-a's write committed before it stopped
        # Meanwhile another writer, through node-b, commits the next revision.
        b.write({"tiny": {**TINY, "replicas": 2}})
        second = applied(b, b.config)
        assert (second["revision"], second["fleet"]["revision"]) == (2, 2)
        assert second["fleet"]["change"]["changed"] == [
            {"deployment": "tiny", "fields": ["replicas"], "replicas": {"from": 1, "to": 2}}
        ]
        a.process.send_signal(signal.SIGCONT)
        out, err = first.communicate(timeout=120)
        assert first.returncode == 0, out + err
        answer = json.loads(out)
        # node-a reports what it wrote, revision 1, although the store is at 2 by now.
        assert (answer["revision"], answer["fleet"]["revision"]) == (1, 1), answer
        assert answer["fleet"]["previous_revision"] is None
        assert answer["fleet"]["change"]["added"] == [{"deployment": "tiny", "replicas": 1}]
        assert desired_revision(a) == 2
    finally:
        for host in (a, b):
            if host.process is not None and host.alive():
                host.process.send_signal(signal.SIGCONT)
            host.stop()


def test_a_desired_state_document_applied_through_any_member_shows_the_fleet_change(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    url = postgres_server.create_database()
    a = FleetHost("node-a", tmp_path / "node-a", url, mirror.url)
    b = FleetHost("node-b", tmp_path / "node-b", url, mirror.url)
    # The operator's document: a member's sb.yml kept elsewhere (neither host serves it).
    document = tmp_path / "operator" / "fleet.yml"
    document.parent.mkdir()

    def write(deployments: dict[str, dict[str, Any]]) -> None:
        document.write_text(yaml.safe_dump(b.document(deployments)))

    try:
        start_all([a, b])
        write({"tiny": TINY})
        first = applied(a, document)
        assert (first["revision"], first["job_id"], first["host_reloaded"]) == (1, None, False)
        assert first["fleet"]["written"] is True
        assert first["fleet"]["change"] == {
            "added": [{"deployment": "tiny", "replicas": 1}],
            "removed": [],
            "changed": [],
            "unchanged": [],
        }
        # It is the fleet's desired state: every member shows it, and a node runs it.
        shown = b.admin_call("GET", "/admin/model-host/deployments").json()
        assert (shown["revision"], shown["deployments"]) == (1, {"tiny": TINY})
        poll(lambda: len(ready_nodes(a, "tiny")) == 1, timeout_s=90, what="tiny placed, ready")

        # Text: the replica count's change, never "added -" nor "preserved".
        write({"tiny": {**TINY, "replicas": 2}})
        text = apply(b, document)
        assert text.returncode == 0, text.stdout + text.stderr
        lines = text.stdout.splitlines()
        assert lines[0] == "fleet revision 2 committed (was 1)"
        assert "  changed   tiny: replicas 1 -> 2" in lines
        assert not any(
            line.split()[:2] in (["added", "-"], ["preserved", "tiny"]) for line in lines
        )
        assert lines[-1] == "this host's own settings unchanged (it serves another file)"

        # Added and removed at once, with the replica counts.
        write({"tiny-imp": {"model": "tiny-imp", "variant": "q4_k_m", "replicas": 1}})
        third = applied(a, document)
        assert third["revision"] == 3
        change = third["fleet"]["change"]
        assert change["added"] == [{"deployment": "tiny-imp", "replicas": 1}]
        assert change["removed"] == [{"deployment": "tiny", "replicas": 2}]
        text = apply(a, document)
        assert (
            text.stdout.splitlines()[0]
            == "fleet revision 3 unchanged: the fleet runs these deployments already"
        )

        # A member's own file still reloads the member too, and its deployments are the fleet's.
        a.write({"tiny-imp": {"model": "tiny-imp", "variant": "q4_k_m"}, "tiny": TINY})
        own = applied(a, a.config)
        assert (own["revision"], own["host_reloaded"]) == (4, True) and own["job_id"]
        assert own["fleet"]["change"]["added"] == [{"deployment": "tiny", "replicas": 1}]
        assert own["fleet"]["change"]["unchanged"] == ["tiny-imp"]

        # A file that is not a fleet's document (no cluster_authority) is still refused.
        plain = tmp_path / "operator" / "plain.yml"
        single = b.document({"tiny": TINY})
        single["proxy"]["model_host"] = {
            k: v
            for k, v in single["proxy"]["model_host"].items()
            if k not in ("authority", "node", "fleet", "journal")
        }
        plain.write_text(yaml.safe_dump(single))
        refused = apply(a, plain, "--format", "json")
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert json.loads(refused.stdout)["error"]["code"] == "source_mismatch"
        # A document's bad deployment is refused with its path; deployments need a source.
        bad = {"tiny": {**TINY, "max_concurrency": 0}}
        for body, status, code in [
            ({"source": str(document), "deployments": bad}, 400, "invalid_desired"),
            ({"deployments": {"tiny": TINY}}, 400, "invalid_body"),
            ({"source": str(document), "deployments": {"x": {"model": "nope"}}}, 400,
             "unknown_catalog_model"),
        ]:  # fmt: skip
            answer = a.admin_call("POST", "/admin/reload", json=body)
            assert (answer.status_code, answer.json()["code"]) == (status, code), answer.text
        assert desired_revision(a) == 4
    finally:
        a.stop()
        b.stop()


def test_a_rotated_credential_reaches_the_lease_route_and_a_timing_change_is_refused(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    url = postgres_server.create_database()
    host = FleetHost("node-a", tmp_path / "node-a", url, mirror.url, timing=dict(CALM))
    lease_url = f"http://127.0.0.1:{host.gateway}/fleet/v1/lease"

    def lease(credential: str) -> int:
        headers = {"Authorization": f"Bearer {credential}"}
        return httpx.get(lease_url, headers=headers, timeout=10).status_code

    current = {"credential": CREDENTIAL}
    ask = ask_peers_http(lambda: current["credential"])

    def reached() -> bool:
        answers = anyio.run(ask, [(host.node, f"http://127.0.0.1:{host.gateway}")])
        return answers[0].reached

    try:
        start_all([host])
        assert (lease(CREDENTIAL), lease(ROTATED)) == (200, 401)
        host.settings = {"fleet": {**CALM, "credential": ROTATED}}
        host.write({})
        done = applied(host, host.config)
        assert done["host_reloaded"] is True
        # The lease route takes the credential in force now, and only it.
        assert (lease(ROTATED), lease(CREDENTIAL)) == (200, 401)
        # The fence ask reads the credential at each ask.
        assert reached() is False  # still the old one
        current["credential"] = ROTATED
        assert reached() is True

        # Fleet timing is the agent's from its start: a change is refused, naming the field,
        # and nothing of the file applies (the credential it rotates back stays rotated).
        revision = desired_revision(host)
        host.settings = {
            "fleet": {**CALM, "heartbeat_ms": 700, "credential": CREDENTIAL},
        }
        host.write({"tiny": TINY})
        refused = apply(host, host.config, "--format", "json")
        assert refused.returncode == 2, refused.stdout + refused.stderr
        error = json.loads(refused.stdout)["error"]
        assert error["code"] == "restart_required"
        assert "proxy.model_host.fleet.heartbeat_ms" in error["error"]
        assert (lease(ROTATED), lease(CREDENTIAL)) == (200, 401)
        assert desired_revision(host) == revision  # the fleet's deployments not written
    finally:
        host.stop()


def test_every_fleet_setting_but_the_credential_and_cool_down_needs_a_restart(
    tmp_path: Path,
) -> None:
    """The rule on its own, over every timing field (pure: two loaded configurations)."""
    host = FleetHost("node-a", tmp_path / "node-a", "postgresql://u@127.0.0.1:1/db", "http://x")
    base = load_config(host.config)
    changes = {
        "heartbeat_ms": 300,
        "fence_after_ms": 1_600,
        "lost_after_ms": 3_100,
        "placement_timeout_ms": 700_000,
        "rejoin_grace_ms": 1_000,
        "placement": "binpack",
        "max_replacements_in_flight": 3,
    }
    for name, value in changes.items():
        host.settings = {"fleet": {**host.timing, name: value, "credential": CREDENTIAL}}
        host.write({})
        assert listener_changes(base, load_config(host.config)) == [
            f"proxy.model_host.fleet.{name}"
        ], name
    host.settings = {"fleet": {**host.timing, "credential": ROTATED, "peer_cooldown_ms": 900}}
    host.write({})
    assert listener_changes(base, load_config(host.config)) == []
    host.settings = {"node": {"id": "node-a", "labels": {"zone": "z9"}}}
    host.write({})
    assert listener_changes(base, load_config(host.config)) == ["proxy.model_host.node"]
