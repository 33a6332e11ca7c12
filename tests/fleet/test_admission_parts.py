"""The parts of fleet admission that need no database (docs/cluster.md, "Admitting nodes"):
a hop's credential check against the members' recorded hashes, the node credential file,
the join token's shapes in the config and the environment, and the token verbs' bad input."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from click.testing import CliRunner
from pydantic import SecretStr, ValidationError

from sbproxy.api.fleet_admission import _request as token_request
from sbproxy.api.peers import PeerDispatch, PeerUnauthorized
from sbproxy.cli.main import cli
from sbproxy.config import FleetConfig
from sbproxy.fleet.admission import (
    CREDENTIAL_FILE,
    NodeCredentialFile,
    PeerCheck,
    PeerCredentials,
)
from sbproxy.store.admission import JoinRefused, new_node_credential, parse_join_token, secret_hash
from sbproxy.store.fleet import NodeRow
from tests.api.fleet_hosts import CREDENTIAL, StaticDirectory

TOKEN = "k3x9q2ab.5f0c1e9a7b2d4c6e8f0a1b3c5d7e9f01"


def member(
    node: str, credential: str | None, *, left: bool = False, revoked: bool = False
) -> NodeRow:
    return NodeRow(
        id=node, advertise_url=None, labels={}, engines=[], devices=[], artifacts=[],
        replicas={}, state="left" if left else "ready", cordoned=False, draining=False,
        left=left, joined_at_ms=0, renewed_at_ms=0,
        revoked_at_ms=1 if revoked else None,
        credential_sha256=None if credential is None else secret_hash(credential),
    )  # fmt: skip


class Fleet:
    """A fleet as the agent knows it: this node's secret and the members' hashes."""

    def __init__(self, secret: str | None, nodes: list[NodeRow]) -> None:
        self.secret = secret
        self.known = PeerCredentials.from_nodes(nodes)

    def node_secret(self) -> str | None:
        return self.secret

    def check_peer(self, node: str, secret: str) -> PeerCheck:
        return self.known.check(node, secret)


def test_a_hop_is_admitted_by_the_calling_nodes_own_credential_and_never_for_a_revoked_one() -> (
    None
):
    b, c = new_node_credential(), new_node_credential()
    fleet = Fleet("mine", [member("b", b), member("c", c, left=True, revoked=True)])
    dispatch = PeerDispatch(
        StaticDirectory("a"), credential=CREDENTIAL, admission=fleet, accept_shared=True
    )
    assert dispatch.admit_hop(f"Bearer {b}", None, node="b").name is None
    # Another member's credential, or b's presented as another node: not b's.
    for token, node in ((b, "x"), (c, "b"), (b + "x", "b")):
        with pytest.raises(PeerUnauthorized):
            dispatch.admit_hop(f"Bearer {token}", None, node=node)
    # The shared credential still admits an unknown caller (the migration path) ...
    dispatch.admit_hop(f"Bearer {CREDENTIAL}", None, node="new-node")
    # ... but never a revoked member, whatever it presents.
    for token in (c, CREDENTIAL):
        with pytest.raises(PeerUnauthorized) as refused:
            dispatch.admit_hop(f"Bearer {token}", None, node="c")
        assert refused.value.code == "peer_unauthorized"
    # What the snapshot knows: a member that joined since is not known (the agent then reads
    # the fleet again).
    assert fleet.known.knows("b") and fleet.known.knows("c") and not fleet.known.knows("x")
    # This host sends its own node credential, not the shared one.
    assert dispatch._authorization == "Bearer mine"


def test_with_the_shared_credential_off_only_node_credentials_pass() -> None:
    b = new_node_credential()
    fleet = Fleet(None, [member("b", b)])
    dispatch = PeerDispatch(
        StaticDirectory("a"), credential=CREDENTIAL, admission=fleet, accept_shared=False
    )
    dispatch.admit_hop(f"Bearer {b}", None, node="b")
    with pytest.raises(PeerUnauthorized):
        dispatch.admit_hop(f"Bearer {CREDENTIAL}", None, node="new-node")
    assert dispatch._authorization is None  # nothing to send before it joined
    dispatch.configure(credential=CREDENTIAL, cooldown_s=5, accept_shared=True)
    dispatch.admit_hop(f"Bearer {CREDENTIAL}", None, node="new-node")


def test_the_node_credential_is_kept_0600_for_its_node_id_only(tmp_path: Path) -> None:
    kept = NodeCredentialFile(tmp_path, "gpu-01")
    first = kept.load_or_make()
    path = tmp_path / CREDENTIAL_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert NodeCredentialFile(tmp_path, "gpu-01").load_or_make() == first
    # A cache now serving another node id makes that node a credential of its own.
    other = NodeCredentialFile(tmp_path, "gpu-02").load_or_make()
    assert other != first
    assert NodeCredentialFile(tmp_path, "gpu-02").load_or_make() == other
    path.write_text("not json")
    assert NodeCredentialFile(tmp_path, "gpu-02").load_or_make() not in (first, other)


def test_a_join_token_in_the_config_must_have_the_token_shape() -> None:
    assert FleetConfig(join_token=SecretStr(TOKEN)).join_token is not None
    with pytest.raises(ValidationError) as refused:
        FleetConfig(join_token=SecretStr("k3x9q2ab.not-hex-secret-value"))
    text = str(refused.value)
    assert "join_token" in text and "not-hex-secret-value" not in text
    assert parse_join_token(TOKEN) == ("k3x9q2ab", secret_hash(TOKEN.partition(".")[2]))
    with pytest.raises(JoinRefused) as bad:
        parse_join_token("k3x9q2ab")
    assert bad.value.code == "join_token_invalid"


@pytest.mark.parametrize(
    ("args", "what"),
    [
        (["--ttl", "5x"], "is not a duration"),
        (["--ttl", "0"], "positive"),
        (["--uses", "0"], "0"),
    ],
)
def test_token_create_refuses_a_bad_ttl_or_uses_with_exit_2(args: list[str], what: str) -> None:
    result = CliRunner().invoke(
        cli,
        ["nodes", "token", "create", *args, "--password", "p", "--admin-url", "http://127.0.0.1:9"],
    )
    assert result.exit_code == 2, result.output
    assert what in result.output


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"[1]", "body"),
        (b"not json", "body"),
        (b'{"ttl_ms": 0}', "ttl_ms"),
        (b'{"uses": true}', "uses"),
        (b'{"uses": 1.5}', "uses"),
        (b'{"secret": "x"}', "secret"),
        (b'{"description": 7}', "description"),
    ],
)
def test_a_bad_token_request_is_a_400_naming_its_field(body: bytes, field: str) -> None:
    answer = token_request(body)
    assert not isinstance(answer, tuple)
    assert answer.status_code == 400
    assert answer.content["code"] == "invalid_join_token_request"
    assert answer.content["field"] == field


def test_a_token_request_may_leave_everything_out() -> None:
    assert token_request(b"") == (None, None, "")
    assert token_request(b'{"ttl_ms": 60000, "uses": 2}') == (60_000, 2, "")
