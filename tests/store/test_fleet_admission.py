"""Fleet admission on a real PostgreSQL server (docs/cluster.md, "Admitting nodes"): a join
token admits as many nodes as it has uses and none after its expiry on database time; a
node's own credential lets it rejoin without a token; a revoked node's renewal is refused by
the statement itself, and it joins again only with a fresh token after an admit; no secret
reaches a table."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from sbproxy.store.admission import (
    JoinRefused,
    create_join_token,
    list_join_tokens,
    new_node_credential,
    parse_join_token,
    revoke_join_token,
    revoke_node,
    secret_hash,
)
from sbproxy.store.fleet import Deposed, FleetStore
from tests.support.postgres import PostgresServer

_OPEN: list[FleetStore] = []


@pytest.fixture
def url(postgres_server: PostgresServer) -> Iterator[str]:
    yield postgres_server.create_database()
    while _OPEN:
        _OPEN.pop().close()


def _open(url: str) -> FleetStore:
    store = FleetStore(url)
    _OPEN.append(store)
    return store


def _join(
    store: FleetStore,
    node: str,
    credential: str,
    *,
    token: str | None = None,
    instance: str = "",
    shared_admits: bool = False,
) -> int:
    return store.join(
        node,
        advertise_url=f"http://127.0.0.1/{node}",
        labels={},
        engines=["llama_cpp"],
        devices=[{"index": 0, "capacity_bytes": 1000}],
        artifacts=[],
        instance=instance,
        credential_sha256=secret_hash(credential),
        join_token=None if token is None else parse_join_token(token),
        shared_admits=shared_admits,
    )


def _refused(code: str, *args: Any, **kwargs: Any) -> JoinRefused:
    with pytest.raises(JoinRefused) as refused:
        _join(*args, **kwargs)
    assert refused.value.code == code, refused.value
    return refused.value


def _members(url: str) -> list[str]:
    with psycopg.connect(url) as connection:
        return [str(r[0]) for r in connection.execute("SELECT id FROM fleet_nodes ORDER BY id")]


def test_a_node_without_a_token_or_a_known_credential_is_refused_and_writes_nothing(
    url: str,
) -> None:
    store = _open(url)
    refused = _refused("join_token_required", store, "n1", new_node_credential())
    assert refused.details == {"node_id": "n1"}
    _, token = create_join_token(store, by="test", ttl_ms=None, uses=None)[:2]
    token_id = token.partition(".")[0]
    wrong = f"{token_id}.{'0' * 32}"
    _refused("join_token_invalid", store, "n1", new_node_credential(), token=wrong)
    _refused("join_token_invalid", store, "n1", new_node_credential(), token=f"zzzzzzzz.{'1' * 32}")
    with pytest.raises(JoinRefused) as malformed:
        parse_join_token("not-a-token")
    assert malformed.value.code == "join_token_invalid"
    assert "not-a-token" not in str(malformed.value)
    assert _members(url) == []
    # The refusals counted no use.
    (row,) = list_join_tokens(store)[1]
    assert row.used == 0


def test_a_token_with_one_use_admits_one_node_and_refuses_the_second(url: str) -> None:
    store = _open(url)
    _, token, _ = create_join_token(store, by="test", ttl_ms=None, uses=1)
    _join(store, "n1", new_node_credential(), token=token)
    refused = _refused("join_token_used_up", store, "n2", new_node_credential(), token=token)
    assert refused.details["token_id"] == token.partition(".")[0]
    assert _members(url) == ["n1"]
    now, (row,) = list_join_tokens(store)
    assert (row.uses_left, row.used, row.state(now)) == (0, 1, "used_up")


def test_two_nodes_racing_for_the_last_use_admit_exactly_one(url: str) -> None:
    _, token, _ = create_join_token(_open(url), by="test", ttl_ms=None, uses=1)
    outcomes: dict[str, str] = {}
    start = threading.Barrier(2)

    def race(node: str) -> None:
        store = _open(url)
        start.wait()
        try:
            _join(store, node, new_node_credential(), token=token)
            outcomes[node] = "joined"
        except JoinRefused as exc:
            outcomes[node] = exc.code

    threads = [threading.Thread(target=race, args=(n,)) for n in ("n1", "n2")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(outcomes.values()) == ["join_token_used_up", "joined"]
    assert len(_members(url)) == 1


def test_an_expired_token_is_refused_on_database_time(url: str) -> None:
    store = _open(url)
    _, token, _ = create_join_token(store, by="test", ttl_ms=3_600_000, uses=None)
    _join(store, "n1", new_node_credential(), token=token)  # valid for an hour: admits
    # An hour passes on the database's clock: its expiry is moved before the server's now.
    with psycopg.connect(url) as connection:
        connection.execute(
            "UPDATE fleet_join_tokens SET expires_at_ms ="
            " (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT - 1"
        )
    refused = _refused("join_token_expired", store, "n2", new_node_credential(), token=token)
    assert refused.details["token_id"] == token.partition(".")[0]
    now, (row,) = list_join_tokens(store)
    assert row.state(now) == "expired" and row.used == 1
    assert _members(url) == ["n1"]


def test_a_revoked_token_admits_nobody(url: str) -> None:
    store = _open(url)
    _, token, _ = create_join_token(store, by="test", ttl_ms=None, uses=5)
    assert revoke_join_token(store, token.partition(".")[0], by="test") is not None
    assert revoke_join_token(store, "nosuchid", by="test") is None
    _refused("join_token_invalid", store, "n1", new_node_credential(), token=token)


def test_an_admitted_node_rejoins_with_its_own_credential_and_no_token(url: str) -> None:
    store = _open(url)
    _, token, _ = create_join_token(store, by="test", ttl_ms=None, uses=1)
    credential = new_node_credential()
    _join(store, "n1", credential, token=token, instance="first")
    assert store.leave("n1", instance="first")
    # The token is used up: the rejoin stands on the node's own credential.
    _join(store, "n1", credential, instance="second")
    renewed = store.renew("n1", replicas={}, instance="second")
    assert renewed is not None and renewed.renewed
    # Another credential under the same id (a replaced cache) is refused.
    _refused("node_credential_invalid", store, "n1", new_node_credential(), instance="third")


def test_the_shared_credential_admits_an_existing_member_and_records_its_credential(
    url: str,
) -> None:
    store = _open(url)
    # A member from before admission (no credential recorded) migrates on its next join.
    store.join("n1", advertise_url=None, labels={}, engines=[], devices=[], artifacts=[])
    credential = new_node_credential()
    _join(store, "n1", credential, shared_admits=True)
    snapshot = store.snapshot()
    (node,) = snapshot.nodes
    assert node.credential_sha256 == secret_hash(credential)
    assert "credential_sha256" not in node.to_dict()
    # With the shared credential off, that credential is what lets it back.
    _join(store, "n1", credential)


def test_a_revoked_node_is_refused_by_the_renewal_statement_and_rejoins_only_with_a_new_token(
    url: str,
) -> None:
    store = _open(url)
    _, token, _ = create_join_token(store, by="test", ttl_ms=None, uses=1)
    credential = new_node_credential()
    _join(store, "n1", credential, token=token, instance="i1")
    lease = store.hold_controller("n1", lease_ms=60_000, instance="i1")
    assert lease is not None
    job_id = revoke_node(store, "n1", by="operator-node", reason="stolen disk")
    assert job_id is not None and revoke_node(store, "ghost", by="x", reason="r") is None
    with psycopg.connect(url) as connection:
        before = connection.execute("SELECT renewed_at_ms FROM fleet_nodes").fetchone()
        # The renewal's own statement, as a node that ignores its client logic would send it.
        updated = connection.execute(
            "UPDATE fleet_nodes SET renewed_at_ms = renewed_at_ms + 1"
            " WHERE id = 'n1' AND left_fleet = 0 AND revoked_at_ms IS NULL AND instance = 'i1'"
        ).rowcount
        assert updated == 0
        job = connection.execute(
            "SELECT kind, node, input_json FROM jobs WHERE id = %s", (job_id,)
        ).fetchone()
    assert job is not None and (job[0], job[1]) == ("fleet.node", "operator-node")
    assert '"reason": "stolen disk"' in job[2] and '"revoked": true' in job[2]
    renewal = store.renew("n1", replicas={}, instance="i1")
    assert renewal is not None and (renewal.renewed, renewal.revoked) == (False, True)
    with psycopg.connect(url) as connection:
        assert connection.execute("SELECT renewed_at_ms FROM fleet_nodes").fetchone() == before
    # Its controller lease lapsed with the revocation: its next fenced write is refused.
    with pytest.raises(Deposed):
        store.stop_placement(lease, "none", cause="test")
    assert store.hold_controller("n1", lease_ms=60_000, instance="i1") is None
    (node,) = store.snapshot().nodes
    assert node.left and node.revoked and node.revoked_reason == "stolen disk"
    assert node.credential_sha256 is None
    # Refused while revoked, its old credential or not; admitted again, a token is needed.
    _refused("node_revoked", store, "n1", credential, instance="i2")
    assert store.set_flags("n1", by="operator-node", left=False) is not None
    _refused("node_revoked", store, "n1", credential, instance="i2")
    _refused("node_revoked", store, "n1", credential, instance="i2", shared_admits=True)
    _, fresh, _ = create_join_token(store, by="test", ttl_ms=None, uses=1)
    _join(store, "n1", credential, token=fresh, instance="i2")
    renewal = store.renew("n1", replicas={}, instance="i2")
    assert renewal is not None and renewal.renewed


def test_no_secret_reaches_a_table(url: str) -> None:
    store = _open(url)
    _, token, _ = create_join_token(store, by="test", ttl_ms=60_000, uses=2, description="d")
    credential = new_node_credential()
    _join(store, "n1", credential, token=token)
    revoke_join_token(store, token.partition(".")[0], by="test")
    revoke_node(store, "n1", by="test", reason="test")
    secret = token.partition(".")[2]
    with psycopg.connect(url) as connection:
        tables = [
            str(r[0])
            for r in connection.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'"
            )
        ]
        for table in tables:
            for row in connection.execute(f"SELECT * FROM {table}"):  # noqa: S608
                text = " ".join(str(value) for value in row)
                assert secret not in text, table
                assert credential not in text, table
        stored = connection.execute("SELECT secret_sha256 FROM fleet_join_tokens").fetchone()
    assert stored == (secret_hash(secret),)
