"""``proxy.model_host.deployments.<id>.replicas`` as a range: a fleet deployment that scales
with its load (``authority: cluster_authority`` only).

The names follow Knative's autoscaler (KPA), which KServe uses: a ``target`` of requests in
flight per replica, a stable ``window`` the average is taken over, a shorter panic window
for bursts with a panic threshold as a multiple of the target, and a delay before a replica
is taken away. The decision itself is :mod:`sbproxy.fleet.autoscale`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, ValidationError, model_validator

from sbproxy.config._rules import ConfigModel, RuleViolation

__all__ = ["ReplicaRange", "range_or_problems"]

_ONE_DAY_MS = 86_400_000
_MILLION = 1_000_000


class ReplicaRange(ConfigModel):
    """``replicas: {min, max, ...}``: the fleet keeps between ``min`` and ``max`` replicas,
    as many as the requests in flight need at ``target`` per replica.

    ``min: 0`` lets an idle deployment scale to zero: a request then makes the fleet place
    one replica and waits for it (up to the deployment's ``queue_timeout_ms``).
    """

    min: int = Field(
        default=1,
        ge=0,
        le=_MILLION,
        description="Fewest replicas; 0 scales an idle deployment to zero (the next request "
        "places one and waits for it, up to queue_timeout_ms).",
    )
    max: int = Field(
        ge=1,
        le=_MILLION,
        description="Most replicas the fleet places, whatever the load.",
    )
    target: float | None = Field(
        default=None,
        gt=0,
        le=_MILLION,
        description="Requests in flight (running and queued) per replica the fleet aims "
        "at; above it on average over `window_ms` it adds replicas. Default: the "
        "deployment's max_concurrency.",
    )
    window_ms: int = Field(
        default=60_000,
        ge=1,
        le=_ONE_DAY_MS,
        description="Stable window: the fleet-wide load is averaged over this many "
        "milliseconds (Knative's stable window).",
    )
    panic_window_ms: int = Field(
        default=6_000,
        ge=1,
        le=_ONE_DAY_MS,
        description="Panic window, in milliseconds: when the average over it reaches "
        "panic_threshold times the target per replica, the fleet scales up at once to what "
        "it needs. At most window_ms.",
    )
    panic_threshold: float = Field(
        default=2.0,
        ge=1,
        le=1_000,
        description="Multiple of the target per replica over the panic window that counts "
        "as a burst (Knative's default: 200 %).",
    )
    scale_down_delay_ms: int = Field(
        default=60_000,
        ge=1,
        le=_ONE_DAY_MS,
        description="Milliseconds the load must fit in one replica fewer (every sample "
        "over this time), and since the last scaling decision, before one replica is "
        "removed; one at a time, never below min. With min 0 the last one goes after this "
        "long without a request in flight.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> ReplicaRange:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        if self.min > self.max:
            problems.append(
                (("max",), f"max {self.max} is below min {self.min}; raise max or lower min")
            )
        if self.panic_window_ms > self.window_ms:
            problems.append(
                (
                    ("panic_window_ms",),
                    f"panic_window_ms {self.panic_window_ms} exceeds window_ms "
                    f"{self.window_ms}: the panic window is the short one",
                )
            )
        if problems:
            raise RuleViolation(problems)
        return self

    def initial(self) -> int:
        """Replicas a deployment starts with, before any load was seen: ``min``, and one
        when ``min`` is 0 (a new deployment is tried once; idle, it goes to zero)."""
        return max(self.min, 1)


def range_or_problems(value: Mapping[str, Any]) -> ReplicaRange:
    """``value`` validated as a :class:`ReplicaRange`.

    Raises:
        RuleViolation: every problem at its path inside the range (``max``, ``target``),
            so that the loader names ``...deployments.<id>.replicas.max``.
    """
    try:
        return ReplicaRange.model_validate(value)
    except ValidationError as exc:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        for error in exc.errors():
            cause = (error.get("ctx") or {}).get("error")
            if isinstance(cause, RuleViolation):
                problems.extend(cause.problems)
                continue
            loc = tuple(error["loc"])
            if error["type"] == "missing":
                message = "required field is missing"
            elif error["type"] == "extra_forbidden":
                allowed = ", ".join(ReplicaRange.model_fields)
                message = f"unknown field {loc[-1]!r}; allowed fields: {allowed}"
            else:
                message = str(error["msg"]).removeprefix("Value error, ")
            problems.append((loc, message))
        raise RuleViolation(problems) from None
