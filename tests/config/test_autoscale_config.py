"""``deployments.<id>.replicas`` as a range (autoscaling): defaults, bounds at their dotted
paths, and refused on a single host (SQLite or any authority but cluster_authority)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from sbproxy.config import ReplicaRange
from tests.config.conftest import BASE, load

ErrorsAt = Callable[..., dict[str, str]]
CLUSTER = (
    "    authority: cluster_authority\n"
    "    journal: {url: 'postgresql://sbproxy@db.internal:5432/sbproxy'}\n"
)
VARIANT = "        variant: q4_k_m\n"


def with_replicas(replicas: str, *, cluster: bool = True) -> str:
    text = BASE.replace(VARIANT, VARIANT + f"        replicas: {replicas}\n", 1)
    if cluster:
        text = text.replace("  model_host:\n", "  model_host:\n" + CLUSTER, 1)
    return text


def test_a_range_loads_with_knative_like_defaults() -> None:
    host = load(with_replicas("{min: 0, max: 4}")).model_host
    assert host is not None
    deployment = host.deployments["local-qwen"]
    bounds = deployment.replica_range
    assert isinstance(bounds, ReplicaRange)
    assert (bounds.min, bounds.max, bounds.target) == (0, 4, None)
    assert (bounds.window_ms, bounds.panic_window_ms, bounds.panic_threshold) == (
        60_000,
        6_000,
        2.0,
    )
    assert bounds.scale_down_delay_ms == 60_000
    # Target defaults to max_concurrency; a new deployment starts with one replica.
    assert deployment.scale_target == float(deployment.max_concurrency)
    assert (deployment.max_replicas, deployment.replica_count) == (4, 1)


def test_an_integer_stays_a_fixed_count() -> None:
    host = load(with_replicas("3")).model_host
    assert host is not None
    deployment = host.deployments["local-qwen"]
    assert deployment.replica_range is None
    assert (deployment.replicas, deployment.max_replicas, deployment.replica_count) == (3, 3, 3)


@pytest.mark.parametrize(
    ("replicas", "path", "phrase"),
    [
        ("{min: 3, max: 2}", "replicas.max", "below min 3"),
        ("{min: -1, max: 2}", "replicas.min", "greater than or equal to 0"),
        ("{max: 0}", "replicas.max", "greater than or equal to 1"),
        ("{min: 1}", "replicas.max", "required"),
        ("{max: 2, target: 0}", "replicas.target", "greater than 0"),
        ("{max: 2, window_ms: 1000, panic_window_ms: 2000}", "replicas.panic_window_ms", "exceeds"),
        ("{max: 2, panic_threshold: 0.5}", "replicas.panic_threshold", "greater than or equal"),
        ("{max: 2, windw_ms: 5}", "replicas.windw_ms", "unknown field"),
        ("two", "replicas", "whole number or a range"),
    ],
)
def test_range_errors_name_the_dotted_path(
    errors_at: ErrorsAt, replicas: str, path: str, phrase: str
) -> None:
    found = errors_at(with_replicas(replicas))
    key = f"proxy.model_host.deployments.local-qwen.{path}"
    assert key in found, found
    assert phrase in found[key]


def test_a_range_is_refused_on_a_single_host(errors_at: ErrorsAt) -> None:
    found = errors_at(with_replicas("{min: 0, max: 2}", cluster=False))
    message = found["proxy.model_host.deployments.local-qwen.replicas"]
    assert "cluster_authority" in message
    assert "give replicas a number" in message


def test_a_range_above_one_needs_a_pinned_variant(errors_at: ErrorsAt) -> None:
    text = with_replicas("{min: 1, max: 2}").replace(VARIANT, "", 1)
    found = errors_at(text)
    assert "pinned `variant`" in found["proxy.model_host.deployments.local-qwen.replicas"]
