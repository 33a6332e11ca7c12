"""``proxy.model_host.node`` and ``proxy.model_host.fleet``: defaults, the timing order and
the advertise URL, each error at its dotted path; cluster_authority needs the shared
PostgreSQL journal."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from sbproxy.config import PlacementStrategy
from tests.config.conftest import BASE, load

ErrorsAt = Callable[..., dict[str, str]]
HOST = "  model_host:\n"


def with_host(snippet: str) -> str:
    return BASE.replace(HOST, HOST + snippet, 1)


def test_defaults() -> None:
    host = load(BASE).model_host
    assert host is not None
    assert (host.node.id, host.node.labels, host.node.advertise_url) == (None, {}, None)
    fleet = host.fleet
    assert (fleet.heartbeat_ms, fleet.fence_after_ms, fleet.lost_after_ms) == (
        2_000,
        10_000,
        20_000,
    )
    assert fleet.placement is PlacementStrategy.SPREAD
    assert fleet.max_replacements_in_flight == 2
    assert fleet.placement_timeout_ms == 600_000


def test_a_full_node_and_fleet_block_loads() -> None:
    host = load(
        with_host(
            "    node:\n"
            "      id: gpu-box-1\n"
            "      labels: {gpu: l4, topology.kubernetes.io/zone: eu-1}\n"
            "      advertise_url: http://10.0.0.5:8080\n"
            "    fleet:\n"
            "      heartbeat_ms: 500\n"
            "      fence_after_ms: 3000\n"
            "      lost_after_ms: 5000\n"
            "      placement: binpack\n"
            "      max_replacements_in_flight: 4\n"
        )
    ).model_host
    assert host is not None
    assert host.node.id == "gpu-box-1"
    assert host.node.labels == {"gpu": "l4", "topology.kubernetes.io/zone": "eu-1"}
    assert host.node.advertise_url == "http://10.0.0.5:8080"
    assert host.fleet.placement is PlacementStrategy.BINPACK
    assert (host.fleet.heartbeat_ms, host.fleet.lost_after_ms) == (500, 5000)


@pytest.mark.parametrize(
    ("fleet", "path", "phrase"),
    [
        (
            "heartbeat_ms: 5000, fence_after_ms: 5000, lost_after_ms: 9000",
            "proxy.model_host.fleet.fence_after_ms",
            "must be greater than heartbeat_ms 5000",
        ),
        (
            "heartbeat_ms: 1000, fence_after_ms: 9000, lost_after_ms: 9000",
            "proxy.model_host.fleet.lost_after_ms",
            "must be greater than fence_after_ms 9000",
        ),
        (
            "fence_after_ms: 30000",  # past the default lost_after_ms of 20000
            "proxy.model_host.fleet.lost_after_ms",
            "must stop its own engines before",
        ),
        (
            "lost_after_ms: 20000, placement_timeout_ms: 20000",
            "proxy.model_host.fleet.placement_timeout_ms",
            "must be greater than lost_after_ms 20000",
        ),
        (
            "lost_after_ms: 700000",  # past the default placement_timeout_ms of 600000
            "proxy.model_host.fleet.placement_timeout_ms",
            "a slow load must not be taken for a lost node",
        ),
        ("heartbeat_ms: 0", "proxy.model_host.fleet.heartbeat_ms", "greater than or equal to 1"),
        ("placement: random", "proxy.model_host.fleet.placement", "spread"),
        (
            "max_replacements_in_flight: 0",
            "proxy.model_host.fleet.max_replacements_in_flight",
            "greater than or equal to 1",
        ),
        ("heartbeat: 5", "proxy.model_host.fleet.heartbeat", ""),
    ],
)
def test_fleet_rules(errors_at: ErrorsAt, fleet: str, path: str, phrase: str) -> None:
    found = errors_at(with_host(f"    fleet: {{{fleet}}}\n"))
    assert path in found, found
    assert phrase in found[path]


def test_both_timing_problems_are_reported_at_once(errors_at: ErrorsAt) -> None:
    found = errors_at(
        with_host("    fleet: {heartbeat_ms: 9000, fence_after_ms: 8000, lost_after_ms: 7000}\n")
    )
    assert {"proxy.model_host.fleet.fence_after_ms", "proxy.model_host.fleet.lost_after_ms"} <= set(
        found
    )


@pytest.mark.parametrize(
    ("node", "path", "phrase"),
    [
        ("id: 'a b'", "proxy.model_host.node.id", "must be 1-128 letters"),
        ("labels: {'bad key': x}", "proxy.model_host.node.labels", "must be 1-128 characters"),
        ("labels: {gpu: '  '}", "proxy.model_host.node.labels.gpu", "blank"),
        ("advertise_url: ftp://h:1", "proxy.model_host.node.advertise_url", "http:// or https://"),
        ("advertise_url: 'http://'", "proxy.model_host.node.advertise_url", "with a host"),
        (
            "advertise_url: 'http://u:secret@h:8080'",
            "proxy.model_host.node.advertise_url",
            "must not carry credentials",
        ),
        ("advertise_url: 'http://h:8080/?a=1'", "proxy.model_host.node.advertise_url", "query"),
        (
            "advertise_url: 'http://h:99999'",
            "proxy.model_host.node.advertise_url",
            "not a valid URL",
        ),
    ],
)
def test_node_rules(errors_at: ErrorsAt, node: str, path: str, phrase: str) -> None:
    found = errors_at(with_host(f"    node: {{{node}}}\n"))
    matching = {k: v for k, v in found.items() if k.startswith(path)}
    assert matching, found
    assert any(phrase in message for message in matching.values()), matching


@pytest.mark.parametrize("url", ["http://u:hunter2@h:8080", "http://u:hunter2@h:99999"])
def test_a_password_in_advertise_url_is_not_echoed(errors_at: ErrorsAt, url: str) -> None:
    found = errors_at(with_host(f"    node: {{advertise_url: '{url}'}}\n"))
    assert found
    assert all("hunter2" not in message for message in found.values()), found


def test_cluster_authority_without_the_shared_journal_is_refused(errors_at: ErrorsAt) -> None:
    found = errors_at(
        with_host("    authority: cluster_authority\n    node: {id: n1}\n    fleet: {}\n")
    )
    assert "needs the shared PostgreSQL journal" in found["proxy.model_host.authority"]


def test_cluster_authority_on_the_shared_journal_loads() -> None:
    host = load(
        with_host(
            "    authority: cluster_authority\n    node: {id: n1}\n    fleet: {}\n"
            "    journal: {url: 'postgresql://sb@127.0.0.1:5432/sb'}\n"
        )
    ).model_host
    assert host is not None and host.authority.value == "cluster_authority"


def test_the_fleet_credential_comes_from_the_environment_and_is_never_shown() -> None:
    secret = "fleet-secret-0123456789abcdef"
    host = load(
        with_host("    fleet: {credential: '${FLEET_CREDENTIAL}', peer_cooldown_ms: 750}\n"),
        env={"FLEET_CREDENTIAL": secret},
    ).model_host
    assert host is not None
    assert host.fleet.credential is not None
    assert host.fleet.credential.get_secret_value() == secret
    assert host.fleet.peer_cooldown_ms == 750
    assert secret not in repr(host.fleet)
    defaults = load(BASE).model_host
    assert defaults is not None
    assert (defaults.fleet.credential, defaults.fleet.peer_cooldown_ms) == (None, 5_000)


def test_a_short_fleet_credential_is_refused_without_echoing_it(errors_at: ErrorsAt) -> None:
    found = errors_at(with_host("    fleet: {credential: 'hunter2-short'}\n"))
    message = found["proxy.model_host.fleet.credential"]
    assert "at least 16 characters" in message
    assert "hunter2" not in message


def test_the_fleet_credential_must_not_be_the_admin_password(errors_at: ErrorsAt) -> None:
    secret = "the-same-secret-0123456789"
    text = with_host(f"    fleet: {{credential: '{secret}'}}\n").replace(
        "proxy:\n", f"proxy:\n  admin: {{enabled: true, password: '{secret}'}}\n", 1
    )
    found = errors_at(text)
    message = found["proxy.model_host.fleet.credential"]
    assert "must not be the admin password" in message
    assert secret not in message
