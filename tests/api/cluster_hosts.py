"""Real ``sbproxy serve`` hosts of one fleet (``authority: cluster_authority``) on one
PostgreSQL journal, for the fleet tests: :class:`FleetHost` is a :class:`PgHost` whose
``sb.yml`` declares no deployment of its own (the fleet's desired state places them), with
its node id, labels, short fleet timing and the fleet credential."""

from __future__ import annotations

import contextlib
import signal
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil

from tests.api.pg_hosts import PgHost

CREDENTIAL = "fleet-test-credential"
HEARTBEAT_MS = 200
FENCE_AFTER_MS = 1_500
LOST_AFTER_MS = 3_000


@dataclass
class FleetHost(PgHost):
    """One fleet member (not started until :meth:`start`)."""

    labels: dict[str, str] = field(default_factory=dict)
    timing: dict[str, int] = field(
        default_factory=lambda: {
            "heartbeat_ms": HEARTBEAT_MS,
            "fence_after_ms": FENCE_AFTER_MS,
            "lost_after_ms": LOST_AFTER_MS,
            # A stopped test host restarts in seconds on a busy machine: keep its placements
            # as long as a silent one's (tests of the grace itself set their own).
            "rejoin_grace_ms": LOST_AFTER_MS,
        }
    )

    settings: dict[str, Any] = field(default_factory=dict)
    """Further ``proxy.model_host`` keys of this host (``cpu_devices``, ...)."""

    advertise_url: str | None = None
    """Where peers reach this host's gateway (``node.advertise_url``; ``None``: the product's
    default, the listener's address). The nemesis points it at a relay it can blackhole."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.write({})

    def document(self, deployments: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """A cluster member's ``sb.yml``: ``deployments`` are what ``sbproxy apply`` makes
        the fleet's desired state; the gateway routes ``tiny-chat`` to ``tiny``."""
        document = super().document(deployments)
        node: dict[str, Any] = {"id": self.node, "labels": getattr(self, "labels", {}) or {}}
        # Read with getattr: PgHost.__post_init__ writes the file before this dataclass's
        # own fields are set.
        if advertise := getattr(self, "advertise_url", None):
            node["advertise_url"] = advertise
        document["proxy"]["model_host"].update(
            {
                "authority": "cluster_authority",
                "node": node,
                "fleet": {**(getattr(self, "timing", None) or {}), "credential": CREDENTIAL},
                **(getattr(self, "settings", None) or {}),
            }
        )
        return document

    def fleet(self, path: str) -> dict[str, Any]:
        """``GET /admin/fleet/<path>`` ({} while the host does not answer)."""
        try:
            response = self.admin_call("GET", f"/admin/fleet/{path}")
        except httpx.HTTPError:
            return {}
        return dict(response.json()) if response.status_code == 200 else {}

    def engines(self) -> list[psutil.Process]:
        """Live engine processes this host started (the stand-in llama-server serving a model
        from this host's cache), wherever they were re-parented."""
        found = []
        for process in psutil.process_iter(["cmdline"]):
            line = " ".join(process.info.get("cmdline") or [])
            if "fake_llama_server" in line and str(self.cache) in line:
                with contextlib.suppress(psutil.Error):
                    if process.status() != psutil.STATUS_ZOMBIE:
                        found.append(process)
        return found

    def deployments(self) -> dict[str, str]:
        """This host's own deployments and their states (the live status route)."""
        return self.states()

    def pause(self) -> None:
        """SIGSTOP the host process (its engines, other processes, keep running)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the host process."""
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the host process (its engines stay orphaned until something stops them)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()


def placements(host: FleetHost) -> list[dict[str, Any]]:
    """The fleet's placements as ``host`` reports them."""
    return list(host.fleet("placements").get("placements", []))


def ready_nodes(host: FleetHost, deployment: str) -> list[str]:
    """Nodes with a ``ready`` placement of ``deployment``, sorted."""
    return sorted(
        p["node"]
        for p in placements(host)
        if p["deployment"] == deployment and p["state"] == "ready"
    )
