"""How a served host gets peer dispatch (``build_servers``): the fleet's directory when one is
given, a lone table when only the fleet credential is configured, nothing on a single host;
and a reload from the file hands the gateway the new credential without losing its
rotation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from sbproxy.api.host import open_host
from sbproxy.api.peers import LoneDirectory, PeerUnauthorized
from sbproxy.api.server import build_servers
from sbproxy.config import load_config
from sbproxy.fleet.routing import PeerReplica
from sbproxy.model_host.runtime.reload import reload_from_source
from tests.api.fleet_hosts import CREDENTIAL, StaticDirectory
from tests.api.test_serve import write_config
from tests.model_host.engines.support import free_port

pytestmark = pytest.mark.anyio

PEER = PeerReplica("tiny", "b", "http://127.0.0.1:1", 1, True, 0, 0)


def config(root: Path, fleet: dict[str, Any] | None) -> Path:
    host: dict[str, Any] = {"node": {"id": "n1"}}
    if fleet is not None:
        host["fleet"] = fleet
    return write_config(root, free_port(), free_port(), host=host)


def with_credential(path: Path, credential: str) -> None:
    document = yaml.safe_load(path.read_text())
    document["proxy"]["model_host"]["fleet"]["credential"] = credential
    path.write_text(yaml.safe_dump(document))


async def test_a_single_host_has_no_peer_dispatch(tmp_path: Path) -> None:
    compiled = load_config(config(tmp_path, None))
    async with open_host(compiled) as host:
        _, gateway, admin = build_servers(compiled, host)
        assert gateway.fleet is None
        assert admin is not None
        assert admin.peers is None


async def test_the_fleet_directory_is_wired_and_a_reload_takes_the_new_credential(
    tmp_path: Path,
) -> None:
    path = config(tmp_path, {"credential": CREDENTIAL, "peer_cooldown_ms": 750})
    compiled = load_config(path)
    directory = StaticDirectory("n1")
    async with open_host(compiled) as host:
        _, gateway, admin = build_servers(compiled, host, directory=directory)
        fleet = gateway.fleet
        assert fleet is not None
        assert fleet.directory is directory
        assert fleet.cooldown_s == 0.75
        assert admin is not None
        assert admin.peers is fleet  # /metrics and the console read the same rotation
        fleet.admit_hop(f"Bearer {CREDENTIAL}", None)
        fleet.out_of_rotation(PEER, "test")
        with_credential(path, "the-next-fleet-credential-0123")
        await reload_from_source(host.manager, source="test")
        assert gateway.fleet is fleet
        assert fleet.out_now() == ["b"]
        fleet.admit_hop("Bearer the-next-fleet-credential-0123", None)
        with pytest.raises(PeerUnauthorized):
            fleet.admit_hop(f"Bearer {CREDENTIAL}", None)


async def test_a_credential_without_a_directory_takes_hops_and_knows_no_peer(
    tmp_path: Path,
) -> None:
    compiled = load_config(config(tmp_path, {"credential": CREDENTIAL}))
    async with open_host(compiled) as host:
        _, gateway, _ = build_servers(compiled, host)
        fleet = gateway.fleet
        assert fleet is not None
        assert isinstance(fleet.directory, LoneDirectory)
        table = fleet.directory.routing()
        assert (table.local_node_id, dict(table.replicas)) == ("n1", {})
        assert fleet.serves_here("tiny", known=True, running=lambda: False)
        fleet.admit_hop(f"Bearer {CREDENTIAL}", None)
