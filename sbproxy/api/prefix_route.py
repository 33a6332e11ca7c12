"""Prefix-aware routing in the gateway: which replica of a ``routing: prefix`` deployment takes
a request, among this host's replicas and its peers' (issue 34, item 1; the key and the
choice are :mod:`sbproxy.fleet.prefix`, pure).

Only on a host of a fleet, and only for a deployment whose placements say ``routing:
prefix`` (the routing table carries it, so a host with no replica of its own knows too). A
single host runs one replica per deployment: nothing to choose, its request path never
looks here.

A client's request (:func:`fleet_choice`): the candidates are the deployment's replicas the
routing table lists ready -- this host's own (ready in the table, or routable here now) and
its peers' that are in this gateway's rotation and reachable -- the loaded ones only when
any is loaded (an idle one would load first); their ids (``<node>/<runtime id>``) are the
same on every gateway, so every gateway that sees the same table picks the same replica.
Each one's load: requests in flight and queued, from this host's runtime for its own
replicas, else as last reported plus this gateway's own requests in flight to it. The
chosen replica serves it: here, or through a peer hop (the first replica tried; a refusal
before any byte moves on by least outstanding, as for any hop).

A peer's hop (:func:`local_choice`): the calling gateway chose this node; among this node's
replicas the same key and ids pick the same one (the heaviest of a set is the heaviest of
any subset that holds it), bounded by this host's own loads.

Counted in ``sbproxy_gateway_prefix_routes_total{deployment,outcome}`` by the gateway that
took the client's request (:class:`~sbproxy.fleet.prefix.PrefixOutcome`): ``first_choice``
(a hit: the replica most likely to hold the prefix), ``load_bound`` (a fall-back: it was at
its load bound), ``no_prefix`` (a fall-back: nothing to key on, least outstanding).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sbproxy.api.peers import PeerDispatch
from sbproxy.config import RoutingPolicy
from sbproxy.fleet.prefix import PrefixOutcome, choose, prefix_key
from sbproxy.fleet.routing import PeerReplica

__all__ = ["PrefixTarget", "fleet_choice", "local_choice", "prefix_routed"]

_PREFIX = RoutingPolicy.PREFIX.value


@dataclass(frozen=True, slots=True)
class PrefixTarget:
    """The replica a prefix-routed request goes to; ``local``: on this host."""

    replica: PeerReplica
    local: bool
    outcome: PrefixOutcome


def prefix_routed(fleet: PeerDispatch, deployment: str) -> bool:
    """Whether the fleet's table lists ``deployment`` with ``routing: prefix``."""
    replicas = fleet.directory.routing().for_deployment(deployment)
    return bool(replicas) and replicas[0].routing == _PREFIX


def fleet_choice(
    fleet: PeerDispatch,
    deployment: str,
    path: str,
    document: Mapping[str, Any],
    local_load: Callable[[str], tuple[int, bool] | None],
) -> PrefixTarget | None:
    """Where a client's request for a ``routing: prefix`` deployment goes (see the module
    docstring), counted on ``fleet``; ``None`` when the deployment is not prefix-routed, the
    request has no key (counted ``no_prefix``) or no replica is a candidate -- the request
    then takes the least-outstanding path.

    ``local_load(runtime_id)``: requests in flight and queued at this host's replica and
    whether it is routable now; ``None`` when this host does not run it.
    """
    if not prefix_routed(fleet, deployment):
        return None
    key = prefix_key(path, document)
    if key is None:
        fleet.prefix_routes[(deployment, PrefixOutcome.NO_PREFIX.value)] += 1
        return None
    table = fleet.directory.routing()
    here = table.local_node_id
    loads: dict[str, int] = {}
    loaded: dict[str, bool] = {}
    replicas: dict[str, PeerReplica] = {}
    for replica in table.for_deployment(deployment):
        load: int | None
        if replica.node_id == here:
            found = local_load(replica.runtime_id)
            if found is None:
                continue
            load, is_loaded = found
            if not (is_loaded or replica.ready):
                continue  # neither routable here now nor idle and loadable
        else:
            load = fleet.outstanding(replica)
            is_loaded = replica.loaded
        if load is None:
            continue
        name = replica.replica_key
        loads[name], loaded[name], replicas[name] = load, is_loaded, replica
    if any(loaded.values()):
        loads = {name: load for name, load in loads.items() if loaded[name]}
    choice = choose(key, loads)
    if choice is None:
        return None
    fleet.prefix_routes[(deployment, choice.outcome.value)] += 1
    chosen = replicas[choice.replica]
    return PrefixTarget(chosen, chosen.node_id == here, choice.outcome)


def local_choice(key: bytes, node_id: str, loads: Mapping[str, int]) -> str | None:
    """The runtime id, among this node's routable replicas ``loads`` (runtime id: requests in
    flight and queued), that takes a hop keyed ``key`` (see the module docstring); ``None``
    when there is none."""
    named = {f"{node_id}/{local}": local for local in loads}
    choice = choose(key, {name: loads[local] for name, local in named.items()})
    return None if choice is None else named[choice.replica]
