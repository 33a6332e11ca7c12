"""Node admission with real ``sbproxy serve`` hosts on one real PostgreSQL (issue 33, item 4;
docs/cluster.md, "Admitting nodes"). Every host here runs with the shared credential off
(``accept_shared_credential: false``, no ``credential``): peers know each other only by
their own node credentials.

* the fleet's first token is made straight in the journal (``nodes token create -f``); a
  host with no token, a wrong one, or a used-up one is refused at start (exit 2, a stable
  reason code) and is never a member nor placed; a token with one use admits one host; an
  admitted host restarted without a token rejoins with the credential in its cache (0600);
* ``nodes revoke``: the revoked node's peer calls get 401 ``peer_unauthorized``, its
  renewals stop (the statement refuses them), it fences (its engine killed), its replica is
  re-placed on another node, and started again it is refused (``node_revoked``);
* no secret -- a token's, a node credential -- reaches a host's log or a table.
"""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.api.cluster_hosts import FleetHost, ready_nodes
from tests.api.pg_hosts import PASSWORD, poll, query
from tests.support.hf_server import HfMirror
from tests.support.postgres import PostgresServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TINY = {"model": "tiny", "variant": "q4_k_m"}
CREDENTIAL_FILE = "fleet-node-credential"


def cli(host: FleetHost, *args: str, admin: bool = True) -> subprocess.CompletedProcess[str]:
    """``sbproxy <args> --format json``, against ``host``'s admin API when ``admin``."""
    connection = (
        ["--admin-url", f"http://127.0.0.1:{host.admin}", "--password", PASSWORD] if admin else []
    )
    return subprocess.run(
        [sys.executable, "-m", "sbproxy.cli", *args, *connection, "--format", "json"],
        env=host.env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def token_host(
    name: str, root: Path, url: str, mirror: HfMirror, labels: dict[str, str] | None = None
) -> FleetHost:
    """A fleet host with the shared credential off: it joins by token or node credential."""
    host = FleetHost(name, root / name, url, mirror.url, labels=labels or {})
    host.settings = {"fleet": {**host.timing, "accept_shared_credential": False}}
    host.write({})
    return host


def new_token(host: FleetHost, *options: str, bootstrap: bool = False) -> str:
    """A join token made through ``host``'s admin API (or, ``bootstrap``, straight in the
    journal its sb.yml names); the token text."""
    if bootstrap:
        done = cli(host, "nodes", "token", "create", "-f", str(host.config), *options, admin=False)
    else:
        done = cli(host, "nodes", "token", "create", *options)
    assert done.returncode == 0, done.stdout + done.stderr
    return str(json.loads(done.stdout)["token"]["token"])


def start_with(host: FleetHost, token: str | None) -> None:
    if token is None:
        host.extra_env.pop("SBPROXY_JOIN_TOKEN", None)
    else:
        host.extra_env["SBPROXY_JOIN_TOKEN"] = token
    host.start()


def refused_at_start(host: FleetHost, token: str | None) -> str:
    """Start ``host``: it must exit 2; its stderr."""
    start_with(host, token)
    assert host.process is not None
    assert host.process.wait(timeout=90) == 2, host.output[-3000:]
    return host.output


def members(host: FleetHost) -> dict[str, str]:
    """``{node: state}`` of every member, removed ones too."""
    return {n["id"]: n["state"] for n in host.fleet("nodes?all=true").get("nodes", [])}


def joined(observer: FleetHost, host: FleetHost) -> None:
    def ready() -> bool:
        if not host.alive():
            raise AssertionError(f"{host.node} exited: {host.output[-4000:]}")
        return members(observer).get(host.node) == "ready"

    poll(ready, timeout_s=90, what=f"{host.node} joined")


def node_credential(host: FleetHost) -> str:
    path = host.cache / CREDENTIAL_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    body = json.loads(path.read_text())
    assert body["node_id"] == host.node
    return str(body["credential"])


def no_secret_anywhere(url: str, hosts: list[FleetHost], secrets: list[str]) -> None:
    """None of ``secrets`` in any host's log nor in any table of the journal."""
    for host in hosts:
        log = host.output
        for secret in secrets:
            assert secret not in log, host.node
    tables = query(url, "SELECT table_name FROM information_schema.tables"
                   " WHERE table_schema = 'public'")  # fmt: skip
    for (table,) in tables:
        for row in query(url, f"SELECT * FROM {table}"):  # noqa: S608
            text = " ".join(str(value) for value in row)
            for secret in secrets:
                assert secret not in text, table


def stop_all(hosts: list[FleetHost]) -> None:
    for host in hosts:
        host.stop()


def test_only_a_valid_join_token_admits_a_host_and_an_admitted_host_rejoins_without_one(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    url = postgres_server.create_database()
    a, b, c, x, y = (token_host(n, tmp_path, url, mirror) for n in ("a", "b", "c", "x", "y"))
    hosts = [a, b, c, x, y]
    try:
        first = new_token(a, "--uses", "1", bootstrap=True)
        start_with(a, first)
        joined(a, a)
        assert a.fleet("placements")["placements"] == []
        # No token at all, a token that is not the fleet's: refused at start, exit 2.
        assert "join_token_required" in refused_at_start(x, None)
        forged = f"{first.partition('.')[0]}.{'0' * 32}"
        assert "join_token_invalid" in refused_at_start(y, forged)
        # One use: the first host joins, the second is refused.
        single = new_token(a, "--uses", "1", "--ttl", "1h")
        start_with(b, single)
        joined(a, b)
        assert "join_token_used_up" in refused_at_start(c, single)
        # The refused hosts are no members; with a deployment applied, nothing lands on them.
        a.write({"tiny": {**TINY, "replicas": 2}})
        applied = cli(a, "apply", "-f", str(a.config))
        assert applied.returncode == 0, applied.stderr
        poll(lambda: ready_nodes(a, "tiny") == ["a", "b"], timeout_s=60, what="2 replicas")
        assert set(members(a)) == {"a", "b"}
        placed = query(url, "SELECT DISTINCT node FROM fleet_placements")
        assert sorted(n for (n,) in placed) == ["a", "b"]
        # Restarted with no token (the one it used is used up): its own credential admits it.
        b_credential = node_credential(b)
        b.stop()
        start_with(b, None)
        # It runs its replica again (as tiny or tiny.r1: the replica it holds).
        poll(lambda: "ready" in b.deployments().values(), timeout_s=60, what="b serves")
        poll(lambda: members(a).get("b") == "ready", timeout_s=30, what="b recorded ready")
        assert node_credential(b) == b_credential
        listed = cli(a, "nodes", "token", "list")
        assert listed.returncode == 0, listed.stderr
        states = {t["id"]: (t["state"], t["used"]) for t in json.loads(listed.stdout)["tokens"]}
        assert states[single.partition(".")[0]] == ("used_up", 1)
        assert single.partition(".")[2] not in listed.stdout
        # Peers reach each other by node credential alone: a's lease route takes b's.
        lease = httpx.get(
            f"http://127.0.0.1:{a.gateway}/fleet/v1/lease",
            headers={"Authorization": f"Bearer {b_credential}", "X-Sbproxy-Peer-Node": "b"},
            timeout=10,
        )
        assert lease.status_code == 200 and lease.json()["node_id"] == "a"
        assert "deprecated" not in a.output  # no shared credential here
        secrets = [t.partition(".")[2] for t in (first, single)]
        no_secret_anywhere(url, hosts, [*secrets, b_credential, node_credential(a)])
    finally:
        stop_all(hosts)


def test_a_revoked_node_is_refused_by_its_peers_fences_and_its_replica_moves(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    url = postgres_server.create_database()
    a = token_host("a", tmp_path, url, mirror)
    b = token_host("b", tmp_path, url, mirror, labels={"role": "serve"})
    c = token_host("c", tmp_path, url, mirror, labels={"role": "serve"})
    hosts = [a, b, c]
    try:
        start_with(a, new_token(a, bootstrap=True))
        joined(a, a)
        shared = new_token(a, "--uses", "2")
        start_with(b, shared)
        start_with(c, shared)
        joined(a, b)
        joined(a, c)
        a.write({"tiny": {**TINY, "replicas": 1, "required_labels": {"role": "serve"}}})
        applied = cli(a, "apply", "-f", str(a.config))
        assert applied.returncode == 0, applied.stderr
        poll(lambda: len(ready_nodes(a, "tiny")) == 1, timeout_s=60, what="1 replica")
        (held,) = ready_nodes(a, "tiny")
        victim, survivor = (b, c) if held == "b" else (c, b)
        poll(lambda: len(victim.engines()) == 1, timeout_s=30, what="the victim's engine")
        secret = node_credential(victim)
        as_victim = {"Authorization": f"Bearer {secret}", "X-Sbproxy-Peer-Node": victim.node}
        hop = {"Authorization": f"Bearer {secret}", "X-Sbproxy-Peer-Hop": victim.node}
        lease_url = f"http://127.0.0.1:{survivor.gateway}/fleet/v1/lease"
        chat_url = f"http://localhost:{survivor.gateway}/v1/chat/completions"
        body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.get(lease_url, headers=as_victim, timeout=10).status_code == 200
        # A hop from the victim is admitted (the survivor has no replica: 503, not 401).
        before = httpx.post(chat_url, json=body, headers=hop, timeout=30)
        assert before.status_code != 401, before.text

        revoked = cli(a, "nodes", "revoke", victim.node, "--reason", "disk stolen")
        assert revoked.returncode == 0, revoked.stdout + revoked.stderr
        revoked_at = time.monotonic()
        job_id = json.loads(revoked.stdout)["job_id"]

        def refused() -> bool:
            answer = httpx.get(lease_url, headers=as_victim, timeout=10)
            return answer.status_code == 401

        poll(refused, timeout_s=5, what="the survivor refuses the victim's credential")
        refused_after_s = time.monotonic() - revoked_at
        # Its last renewal as the revocation left it: no later one goes through.
        renewed = query(url, "SELECT renewed_at_ms FROM fleet_nodes WHERE id = %s", victim.node)
        answer = httpx.post(chat_url, json=body, headers=hop, timeout=30)
        assert (answer.status_code, answer.json()["error"]["code"]) == (401, "peer_unauthorized")
        lease = httpx.get(lease_url, headers=as_victim, timeout=10)
        assert lease.json()["code"] == "peer_unauthorized"
        # It fences: its engine is killed while its process runs on, refused at each renewal.
        poll(lambda: victim.engines() == [], timeout_s=20, what="the victim's engine killed")
        assert victim.alive()
        poll(lambda: ready_nodes(a, "tiny") == [survivor.node], timeout_s=60, what="re-placed")
        replaced_after_s = time.monotonic() - revoked_at
        assert "was revoked" in victim.output
        assert "fenced itself" in victim.output
        # Many heartbeats later (the re-placed replica started meanwhile), its process alive.
        again = query(url, "SELECT renewed_at_ms FROM fleet_nodes WHERE id = %s", victim.node)
        assert again == renewed and victim.alive()
        assert members(a)[victim.node] == "left"
        job = query(url, "SELECT kind, input_json FROM jobs WHERE id = %s", job_id)
        assert job[0][0] == "fleet.node" and '"reason": "disk stolen"' in job[0][1]
        place = query(url, "SELECT input_json FROM jobs WHERE kind = 'fleet.place'"
                      " ORDER BY created_at_ms DESC LIMIT 1")  # fmt: skip
        assert json.loads(place[0][0])["node"] == survivor.node
        # Started again, with its old credential: refused.
        victim.stop()
        assert "node_revoked" in refused_at_start(victim, None)
        print(
            f"revoked -> peer 401: {refused_after_s:.2f} s; -> re-placed {replaced_after_s:.2f} s"
        )
        no_secret_anywhere(url, hosts, [secret, node_credential(survivor)])
    finally:
        stop_all(hosts)
