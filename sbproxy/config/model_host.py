"""``proxy.model_host``: host policy, cache, engines and deployments.

Field names, defaults and bounds follow the reference implementation's
``ModelHostControlConfig`` / ``ManagedEngineConfig`` / ``ManagedDeploymentConfig``
(reference section 3) so a file written for one loads in the other.
"""

from __future__ import annotations

import math
import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Final, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from sbproxy.config._rules import (
    ConfigModel,
    Identifier,
    NonBlank,
    RuleViolation,
    check_absolute_path,
    check_path_text,
    is_sha256_hex,
)
from sbproxy.config.autoscale import ReplicaRange, range_or_problems
from sbproxy.config.engine_args import EngineKind, check_engine_args
from sbproxy.config.journal_url import INVALID_JOURNAL_URL, JOURNAL_URL_FORM, journal_url_problem

__all__ = [
    "MAX_CACHE_BUDGET_GIB",
    "UNSUPPORTED_DEPLOYMENT_FIELDS",
    "AbsolutePath",
    "Authority",
    "CacheConfig",
    "ChunkedPrefillConfig",
    "ColdStart",
    "DeploymentConfig",
    "EngineChoice",
    "EngineConfig",
    "EnginesConfig",
    "FleetConfig",
    "KvQuant",
    "ModelHostConfig",
    "NodeConfig",
    "PlacementStrategy",
    "PullPolicy",
    "Rollout",
    "SourceArchiveConfig",
    "resolve_relative",
]

_TAG_RE = re.compile(r"^(?=.{1,128}$)[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")
_IMAGE_RE = re.compile(r"^[a-z0-9][a-z0-9._/:-]*@sha256:[0-9a-f]{64}$")
_LABEL_RE = re.compile(r"^[A-Za-z0-9._/-]{1,128}$")
_MAX_U32 = 2**32 - 1
_ONE_DAY_MS = 86_400_000
_ONE_YEAR_SECS = 366 * 24 * 3600
_MILLION = 1_000_000
MAX_CACHE_BUDGET_GIB = 2**33
"""Largest cache budget in GiB: 2**63 bytes (8 EiB), the most a signed 64-bit count holds.

Beyond it ``budget_gib * 2**30`` overflows a float to infinity, which has no byte count.
"""

# Fields some older configurations carry that this runtime does not honour. Each maps to
# what the operator should do instead; they are refused rather than silently ignored.
UNSUPPORTED_DEPLOYMENT_FIELDS: dict[str, str] = {
    "gguf_file": (
        "file selection comes from the pinned catalog variant; remove gguf_file and pin "
        "`variant:` instead"
    ),
    "reference": "raw repository references bypass the catalog; add the model to a catalog",
    "hf_repo": "raw repository references bypass the catalog; add the model to a catalog",
    "lora_adapters": "LoRA adapters are not supported by this runtime; remove the field",
    "max_loras": "LoRA adapters are not supported by this runtime; remove the field",
    "speculative": "speculative decoding is not supported by this runtime; remove the field",
}


class Authority(StrEnum):
    """Which system owns deployment definitions."""

    FILE_MANAGED = "file_managed"
    ADMIN_MANAGED = "admin_managed"
    CLUSTER_AUTHORITY = "cluster_authority"


class PullPolicy(StrEnum):
    """What happens on a cache miss: verify at prepare, fetch on first request, or refuse."""

    ON_BOOT = "on_boot"
    ON_DEMAND = "on_demand"
    MANUAL = "manual"


class ColdStart(StrEnum):
    """What a request does when no ready replica exists."""

    WAIT = "wait"
    REJECT = "reject"
    FALLBACK = "fallback"


class Rollout(StrEnum):
    """How a changed deployment replaces its running generation."""

    ROLLING = "rolling"
    RECREATE = "recreate"


class RoutingPolicy(StrEnum):
    """How a request picks among a deployment's replicas."""

    LEAST_OUTSTANDING = "least_outstanding"
    PREFIX = "prefix"


class SplitMode(StrEnum):
    """Whether a fleet may split one replica over several nodes with llama.cpp's RPC
    backend (docs/cluster.md, "One model over several hosts")."""

    AUTO = "auto"
    """Split only when no single node has room for the replica (the decision says so)."""
    RPC = "rpc"
    """Always split, over the fewest nodes (two or more) whose devices hold it."""
    NONE = "none"
    """Never split: a replica no single node holds stays unplaced."""


class PlacementStrategy(StrEnum):
    """How the fleet planner scores nodes: ``spread`` (fewest replicas, most free memory
    first) or ``binpack`` (fill the fullest node that still fits first)."""

    SPREAD = "spread"
    BINPACK = "binpack"


class EngineChoice(StrEnum):
    """Engine selection for a deployment; ``auto`` takes the variant's first supported engine."""

    AUTO = "auto"
    LLAMA_CPP = "llama_cpp"
    VLLM = "vllm"


class KvQuant(StrEnum):
    """KV-cache element type; ``auto`` keeps the engine default (f16)."""

    AUTO = "auto"
    F16 = "f16"
    FP8 = "fp8"
    INT8 = "int8"
    INT4 = "int4"


def resolve_relative(value: str | None, info: ValidationInfo) -> str | None:
    """Resolve a relative path against the directory of the file being loaded.

    The loader passes ``{"base_dir": <dir of sb.yml>}`` as validation context; without it
    (a model built in code) relative paths are kept as written.
    """
    if value is None:
        return None
    check_path_text(value)
    base = (info.context or {}).get("base_dir")
    if base is None or Path(value).is_absolute():
        return value
    return str((Path(base) / value).resolve())


def _check_tag(value: str) -> str:
    if value == "latest":
        raise ValueError("'latest' is not a pinned version; name an exact release tag")
    if not _TAG_RE.match(value):
        raise ValueError(
            "must be 1-128 characters of letters, digits, '.', '_' or '-', starting and "
            "ending with a letter or digit"
        )
    return value


def _check_sha256(value: str) -> str:
    if not is_sha256_hex(value):
        raise ValueError("must be 64 lowercase hexadecimal characters (a SHA-256 digest)")
    return value


def _check_image(value: str) -> str:
    if not _IMAGE_RE.match(value):
        raise ValueError(
            f"{value!r} must use an immutable digest: <repository>@sha256:<64 hex>; "
            "tags such as :latest or :v0.10.0 can change under you"
        )
    return value


VersionTag = Annotated[str, AfterValidator(_check_tag)]
Sha256Hex = Annotated[str, AfterValidator(_check_sha256)]
ImageRef = Annotated[str, AfterValidator(_check_image)]
AbsolutePath = Annotated[str, AfterValidator(check_absolute_path)]


class CacheConfig(ConfigModel):
    """``proxy.model_host.cache``: where verified artifacts live and how much they may use."""

    directory: AbsolutePath | None = Field(
        default=None,
        description=(
            "Absolute cache root (blobs, snapshots, metadata, partials, locks, jobs, engines). "
            "Default: the platform default chosen by the CLI."
        ),
    )
    budget_gib: float | None = Field(
        default=None,
        gt=0,
        le=MAX_CACHE_BUDGET_GIB,
        description="Cache size budget in GiB (2^30 bytes), enforced by collection after pulls.",
    )
    max_resident_models: int | None = Field(
        default=None,
        gt=0,
        le=_MAX_U32,
        description="Most engine generations resident at once, counted across all devices.",
    )
    eviction: Literal["lru", "never"] = Field(
        default="lru",
        description=(
            "Residency eviction policy: lru evicts the least recently used idle generation; "
            "never refuses a load that would displace any resident generation."
        ),
    )

    # Before the bounds, so that nan and inf are named as such rather than as out of range.
    @field_validator("budget_gib", mode="before")
    @classmethod
    def _finite_budget(cls, value: object) -> object:
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("must be a finite number of GiB")
        return value


class SourceArchiveConfig(ConfigModel):
    """A pinned llama.cpp source archive to build from (``engines.llama_cpp.source``)."""

    url: str | None = Field(
        default=None, description="https:// URL of the archive (tar.gz). Exclusive with file."
    )
    file: AbsolutePath | None = Field(
        default=None, description="Absolute path of a local archive. Exclusive with url."
    )
    sha256: Sha256Hex = Field(description="SHA-256 of the archive bytes; required.")
    strip_prefix: str | None = Field(
        default=None,
        description="Directory inside the archive that holds the llama.cpp tree (relative).",
    )
    tag: VersionTag | None = Field(
        default=None, description="Label of the source revision, recorded in the build identity."
    )

    @field_validator("url")
    @classmethod
    def _https_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("https://"):
            raise ValueError("must be an https:// URL")
        return value

    @field_validator("strip_prefix")
    @classmethod
    def _safe_prefix(cls, value: str | None) -> str | None:
        if value is None:
            return None
        check_path_text(value)
        parts = value.split("/")
        if value.startswith("/") or "\\" in value or any(p in ("..",) for p in parts):
            raise ValueError(
                "must be a relative path inside the archive without '..' or backslashes"
            )
        return value

    @model_validator(mode="after")
    def _one_location(self) -> SourceArchiveConfig:
        if (self.url is None) == (self.file is None):
            raise RuleViolation.at("url", "give exactly one of url or file")
        return self


class EngineConfig(ConfigModel):
    """``proxy.model_host.engines.<kind>``: how one engine is obtained and launched."""

    launch: Literal["binary", "container", "uv"] = Field(
        default="binary",
        description="binary (a native executable), uv (a pinned uv environment; vLLM only) "
        "or container (a digest-pinned image; vLLM only).",
    )
    version: VersionTag | None = Field(
        default=None, description="Exact release tag or package version, e.g. b9905 or 0.10.0."
    )
    path: AbsolutePath | None = Field(
        default=None, description="Absolute path of an operator-approved engine executable."
    )
    sha256: Sha256Hex | None = Field(
        default=None,
        description="SHA-256 pin of the release archive (or, with path, of the executable).",
    )
    image: ImageRef | None = Field(
        default=None, description="Container image as <repository>@sha256:<digest>."
    )
    acceleration: Literal["auto", "cuda", "metal", "vulkan", "cpu"] = Field(
        default="auto", description="Accelerator to build or run for."
    )
    shm_size_gib: int | None = Field(
        default=None, ge=1, le=1024, description="Container shared memory in GiB (1-1024)."
    )
    source: SourceArchiveConfig | None = Field(
        default=None, description="Pinned source archive for a llama.cpp build on this node."
    )

    @model_validator(mode="after")
    def _launch_rules(self) -> EngineConfig:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        if self.launch == "container" and self.image is None:
            problems.append((("image",), "launch: container needs a digest-pinned image"))
        if self.launch != "container" and self.image is not None:
            problems.append((("image",), "image is only used with launch: container"))
        if self.launch != "container" and self.shm_size_gib is not None:
            problems.append((("shm_size_gib",), "shm_size_gib is only used with launch: container"))
        if problems:
            raise RuleViolation(problems)
        return self


class EnginesConfig(ConfigModel):
    """``proxy.model_host.engines``: the engines this host may run."""

    llama_cpp: EngineConfig | None = Field(default=None, description="llama.cpp llama-server.")
    vllm: EngineConfig | None = Field(default=None, description="vLLM (CUDA workers only).")

    @model_validator(mode="before")
    @classmethod
    def _known_kinds(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unsupported = [k for k in data if k in ("sglang", "mistralrs")]
            if unsupported:
                raise RuleViolation(
                    [
                        (
                            (k,),
                            f"engine {k} is not available in this version; use llama_cpp or vllm",
                        )
                        for k in unsupported
                    ]
                )
        return data

    @model_validator(mode="after")
    def _per_kind_rules(self) -> EnginesConfig:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        if self.llama_cpp is not None and self.llama_cpp.launch != "binary":
            problems.append(
                (("llama_cpp", "launch"), "llama.cpp runs as a native binary; use launch: binary")
            )
        if self.vllm is not None and self.vllm.source is not None:
            problems.append(
                (("vllm", "source"), "source builds are for llama_cpp only; remove source")
            )
        if problems:
            raise RuleViolation(problems)
        return self


_NOT_WIRED = " Used under authority: cluster_authority."

JOIN_TOKEN_PATTERN: Final = r"^[a-z0-9]{8}\.[0-9a-f]{32}$"  # noqa: S105 - a pattern
"""A join token as ``sbproxy nodes token create`` prints it: ``<id>.<secret>``."""

FENCE_ASKS: Final = 2
"""Asks in a row that reach no peer before a host that cannot renew fences as a minority
partition (one slow answer on a busy host is not a partition)."""


def peer_ask_timeout_ms(heartbeat_ms: int) -> int:
    """How long a host that cannot renew waits for one peer's answer to its fence ask, in
    ms: one heartbeat period, at least 250 ms and at most 2 s (a peer on a loaded machine
    answers in milliseconds; one that does not within a period counts as not reached)."""
    return max(250, min(2_000, heartbeat_ms))


def fence_bound_ms(*, heartbeat_ms: int, fence_after_ms: int) -> int:
    """The longest a host cut off from the database keeps its engines, in ms after its last
    successful renewal: ``fence_after_ms``, then :data:`FENCE_ASKS` asks of at most
    :func:`peer_ask_timeout_ms` each, one heartbeat apart (a minority partition fences on
    the last; a host whose peers renewed fences on the first). The fence decision runs on
    its own clock, so no call in flight delays it (ARCHITECTURE.md "Several hosts")."""
    asks = FENCE_ASKS * peer_ask_timeout_ms(heartbeat_ms)
    return fence_after_ms + asks + (FENCE_ASKS - 1) * heartbeat_ms


def _check_label_key(value: str) -> str:
    if not _LABEL_RE.match(value):
        raise ValueError(
            f"label {value!r} must be 1-128 characters of letters, digits, '.', '_', '/' or '-'"
        )
    return value


LabelKey = Annotated[str, AfterValidator(_check_label_key)]


class NodeConfig(ConfigModel):
    """``proxy.model_host.node``: this host as a member of a fleet."""

    id: Identifier | None = Field(
        default=None,
        description="Stable node id ([A-Za-z0-9._-], at most 128 characters); omitted: a "
        "ULID generated once and kept in the cache." + _NOT_WIRED,
    )
    labels: dict[LabelKey, NonBlank] = Field(
        default_factory=dict,
        description="Labels deployments' required_labels match against, e.g. "
        "{gpu: a100, zone: eu-1}; keys 1-128 characters of [A-Za-z0-9._/-]." + _NOT_WIRED,
    )
    advertise_url: str | None = Field(
        default=None,
        description="http(s)://host:port where the other hosts reach this host's gateway "
        "(peer dispatch); no credentials, query or fragment; omitted: the listener's "
        "address." + _NOT_WIRED,
    )

    @field_validator("advertise_url")
    @classmethod
    def _peer_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            parts = urlsplit(value)
            port = parts.port
        except ValueError as exc:
            # The value is not echoed: it may carry a password.
            raise ValueError(f"is not a valid URL ({exc})") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                "must be an http:// or https:// URL with a host, e.g. http://10.0.0.5:8080"
            )
        if parts.username is not None or parts.password is not None:
            # Peers authenticate with the fleet credential; a password in a URL would be
            # shown in every membership listing.
            raise ValueError(
                "must not carry credentials (user:password@); peers use the fleet credential"
            )
        if parts.query or parts.fragment:
            raise ValueError("must not have a query or fragment")
        if port == 0:
            raise ValueError("port 0 is not a reachable port")
        return value


class FleetConfig(ConfigModel):
    """``proxy.model_host.fleet``: membership timing and placement policy of a fleet."""

    heartbeat_ms: int = Field(
        default=2_000,
        ge=1,
        le=_ONE_DAY_MS,
        description="How often each node renews its membership lease on database time, in "
        "milliseconds; a renewal late by more than half a period makes the node suspect."
        + _NOT_WIRED,
    )
    fence_after_ms: int = Field(
        default=10_000,
        ge=1,
        le=_ONE_DAY_MS,
        description="A node that could not renew for this long stops taking traffic and "
        "stops its engines itself, in milliseconds; must exceed heartbeat_ms." + _NOT_WIRED,
    )
    lost_after_ms: int = Field(
        default=20_000,
        ge=1,
        le=_ONE_DAY_MS,
        description="Milliseconds without a renewal after which the fleet declares a node "
        "lost and re-places its replicas; must exceed fence_after_ms, so the node has fenced "
        "itself first." + _NOT_WIRED,
    )
    placement_timeout_ms: int = Field(
        default=600_000,
        ge=1,
        le=_ONE_DAY_MS,
        description="Milliseconds a placement may stay pending (pulling, loading) before the "
        "fleet moves it to another node that fits, keeping that deployment off the node it "
        "was stuck on for as long again; a node reporting the load failed or the engine in a "
        "crash loop is moved at once. No other node fits: it stays, reported. Must exceed "
        "lost_after_ms." + _NOT_WIRED,
    )
    rejoin_grace_ms: int | None = Field(
        default=None,
        ge=1,
        le=_ONE_DAY_MS,
        description="Milliseconds a host that stopped gracefully (SIGTERM, marked leaving: "
        "out of rotation at once) keeps its placements for a restart; past it its replicas "
        "are re-placed. At most lost_after_ms; default half of lost_after_ms." + _NOT_WIRED,
    )
    placement: PlacementStrategy = Field(
        default=PlacementStrategy.SPREAD,
        description="Node scoring: spread (fewest replicas and most free memory first) or "
        "binpack (fullest node that fits first)." + _NOT_WIRED,
    )
    max_replacements_in_flight: int = Field(
        default=2,
        ge=1,
        le=_MILLION,
        description="Re-placements of replicas from lost nodes started but not yet ready, "
        "at most, across the fleet (a network blip must not restart every replica at once)."
        + _NOT_WIRED,
    )
    credential: SecretStr | None = Field(
        default=None,
        description="Shared secret the hosts of a fleet present to each other's gateways "
        "(Authorization: Bearer, with the X-Sbproxy-Peer-Hop header), at least 16 "
        "characters; give it as ${ENV} interpolation, never in clear. Never the admin "
        "password. Absent: this host takes no peer hops (401 peer_unauthorized) and sends "
        "none.",
    )
    join_token: SecretStr | None = Field(
        default=None,
        description="The join token (`sbproxy nodes token create`, <id>.<secret>) this host "
        "redeems when it joins the fleet without a node credential of its own; give it as "
        "${ENV} interpolation (or leave it out and set $SBPROXY_JOIN_TOKEN). Once joined, the "
        "host keeps its own node credential in its cache and rejoins with it: the token is not "
        "needed again.",
    )
    accept_shared_credential: bool = Field(
        default=True,
        description="Deprecated migration path: while true and credential is set, the shared "
        "credential still admits a host into the fleet without a join token and is accepted "
        "from peers beside each node's own credential. Set false once every member joined "
        'with its own node credential (docs/cluster.md, "Admitting nodes").',
    )
    peer_artifacts: bool = Field(
        default=True,
        description="Whether this host's pulls ask the fleet's members that hold an artifact "
        "for its files before the upstream (over the peer listener, verified like any pull). "
        "false: every pull goes to the upstream, as on a single host. Other members still "
        'fetch from this one (docs/cluster.md, "Artifacts from peers").',
    )
    peer_cooldown_ms: int = Field(
        default=5_000,
        ge=1,
        le=_ONE_DAY_MS,
        description="How long a peer that failed a dispatched request before its first byte "
        "stays out of this gateway's rotation, in milliseconds (membership notices a dead "
        "node later, after lost_after_ms).",
    )

    @field_validator("credential")
    @classmethod
    def _long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value().strip()) < 16:
            # The value is not echoed: it is a secret.
            raise ValueError(
                "must be at least 16 characters (a short shared secret lets anyone on the "
                "network in as a peer); generate one, e.g. `openssl rand -hex 32`"
            )
        return value

    @field_validator("join_token")
    @classmethod
    def _join_token_shape(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not re.match(JOIN_TOKEN_PATTERN, value.get_secret_value().strip()):
            # The value is not echoed: it is a secret.
            raise ValueError(
                "is not a join token: `sbproxy nodes token create` prints one as "
                "<8 characters of a-z0-9>.<32 hex digits>"
            )
        return value

    @model_validator(mode="after")
    def _timing_order(self) -> FleetConfig:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        if self.fence_after_ms <= self.heartbeat_ms:
            problems.append(
                (
                    ("fence_after_ms",),
                    f"fence_after_ms {self.fence_after_ms} must be greater than heartbeat_ms "
                    f"{self.heartbeat_ms}: a node would fence itself between two renewals",
                )
            )
        if self.lost_after_ms <= self.fence_after_ms:
            problems.append(
                (
                    ("lost_after_ms",),
                    f"lost_after_ms {self.lost_after_ms} must be greater than fence_after_ms "
                    f"{self.fence_after_ms}: a node must stop its own engines before the fleet "
                    "starts its replicas elsewhere",
                )
            )
        bound = fence_bound_ms(heartbeat_ms=self.heartbeat_ms, fence_after_ms=self.fence_after_ms)
        if (
            self.lost_after_ms > self.fence_after_ms
            and bound + self.heartbeat_ms > self.lost_after_ms
        ):
            problems.append(
                (
                    ("lost_after_ms",),
                    f"lost_after_ms {self.lost_after_ms} is too short for this timing: a host "
                    f"cut off from the database may keep its engines up to {bound} ms "
                    f"(fence_after_ms {self.fence_after_ms} + {FENCE_ASKS} peer asks of "
                    f"{peer_ask_timeout_ms(self.heartbeat_ms)} ms, a heartbeat apart), and "
                    "the fleet must not start its replicas elsewhere before that plus one "
                    f"heartbeat; raise lost_after_ms to at least {bound + self.heartbeat_ms} "
                    "or lower fence_after_ms or heartbeat_ms",
                )
            )
        if self.rejoin_grace_ms is not None and self.rejoin_grace_ms > self.lost_after_ms:
            problems.append(
                (
                    ("rejoin_grace_ms",),
                    f"rejoin_grace_ms {self.rejoin_grace_ms} must be at most lost_after_ms "
                    f"{self.lost_after_ms}: a host that said it is leaving is not waited for "
                    "longer than a silent one",
                )
            )
        if self.placement_timeout_ms <= self.lost_after_ms:
            problems.append(
                (
                    ("placement_timeout_ms",),
                    f"placement_timeout_ms {self.placement_timeout_ms} must be greater than "
                    f"lost_after_ms {self.lost_after_ms}: a slow load must not be taken for "
                    "a lost node, and a node is judged lost before its placements stuck",
                )
            )
        if problems:
            raise RuleViolation(problems)
        return self


class ChunkedPrefillConfig(ConfigModel):
    """vLLM chunked prefill tuning."""

    max_batched_tokens: int | None = Field(
        default=None, ge=1, description="Tokens per prefill batch."
    )
    target_ttft_ms: int | None = Field(
        default=None, ge=1, description="Target time to first token, in milliseconds."
    )


_VLLM_ONLY = ("chunked_prefill", "tool_call_parser", "swap_space_gib", "cpu_offload_gib")


class DeploymentConfig(ConfigModel):
    """``proxy.model_host.deployments.<id>``: one operator-named managed model deployment."""

    model: NonBlank = Field(description="Catalog v2 logical model id, e.g. qwen2.5-0.5b-instruct.")
    variant: Identifier | None = Field(
        default=None,
        description="Pins one exact catalog artifact; omitted lets the worker choose.",
    )
    heterogeneous_variants: bool = Field(
        default=False,
        description="Allow replicas to resolve to different variants (per node's hardware, "
        "fleet placement intent).",
    )
    replicas: Annotated[int, Field(ge=1, le=_MAX_U32)] | ReplicaRange = Field(
        default=1,
        description="Replica count; a fleet places each on its own node or devices. This "
        "single-node authorities serve one; cluster_authority places each on its own node. "
        "A mapping {min, max, target, ...} (cluster_authority only) scales the count with "
        "the requests in flight.",
    )
    tensor_parallel: int | None = Field(
        default=None, ge=1, le=1024, description="Devices per replica; default: planner's choice."
    )
    devices: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="Device indexes this deployment's engine runs on (distinct, each >= 0; "
        "with tensor_parallel, exactly that many). Omitted: the runtime picks the devices "
        "with the most free memory. A fleet placement sets it for the replica it places on a "
        "node.",
    )
    required_labels: dict[NonBlank, NonBlank] = Field(
        default_factory=dict,
        description="Node labels (proxy.model_host.node.labels) a replica's node must carry, "
        "every key with the same value (used by cluster_authority's placement).",
    )
    spread_by: list[str] = Field(
        default_factory=list,
        max_length=8,
        description="Label keys to spread replicas across (cluster intent); at most 8, unique.",
    )
    pull: PullPolicy = Field(
        default=PullPolicy.ON_DEMAND,
        description="Cache-miss policy: on_boot, on_demand or manual.",
    )
    warm: bool = Field(
        default=False, description="Start the engine before the revision becomes active."
    )
    cold_start: ColdStart = Field(
        default=ColdStart.WAIT,
        description="Request behaviour with no ready replica: wait, reject (503) or fallback.",
    )
    pinned: bool = Field(
        default=False, description="Never evict this deployment's generation for another one."
    )
    keep_alive_secs: int | None = Field(
        default=None,
        ge=1,
        le=_ONE_YEAR_SECS,
        description="Idle seconds before the engine is stopped; omitted: never idle-stop.",
    )
    max_concurrency: int = Field(
        default=1, ge=1, le=_MILLION, description="Requests the engine runs at once."
    )
    max_queue_depth: int = Field(
        default=128, ge=0, le=_MILLION, description="Requests that may wait; 0 means no queue."
    )
    queue_timeout_ms: int = Field(
        default=30_000,
        ge=1,
        le=_ONE_DAY_MS,
        description="Longest a request waits for admission, in milliseconds.",
    )
    max_output_tokens: int = Field(
        default=512,
        ge=1,
        le=_MAX_U32,
        description="Tokens an answer may generate when the request sets no max_tokens "
        "(max_completion_tokens, n_predict); never more than the context length. Keeps an "
        "answer that would not end from running to the context limit.",
    )
    request_timeout_ms: int = Field(
        default=300_000,
        ge=1,
        le=_ONE_DAY_MS,
        description="Longest an admitted request may run at the engine, stream included, in "
        "milliseconds; past it the client gets 504 engine_timeout and the engine request is "
        "cancelled.",
    )
    first_token_timeout_ms: int = Field(
        default=120_000,
        ge=1,
        le=_ONE_DAY_MS,
        description="Streams only: longest wait for the first event from the engine, in "
        "milliseconds (prompt processing counts here).",
    )
    stall_timeout_ms: int = Field(
        default=30_000,
        ge=1,
        le=_ONE_DAY_MS,
        description="Streams only: longest gap between two events from the engine, in "
        "milliseconds.",
    )
    unhealthy_after: int = Field(
        default=3,
        ge=1,
        le=_MILLION,
        description="Consecutive engine timeouts after which the generation is marked "
        "unhealthy, drained and restarted.",
    )
    start_timeout_ms: int = Field(
        default=300_000,
        ge=1,
        le=_ONE_DAY_MS,
        description="Longest an engine launch may take to answer /health, in milliseconds; "
        "past it the deployment is failed with start_timeout until the next request or a "
        "reset.",
    )
    restart_backoff_initial_ms: int = Field(
        default=1_000,
        ge=1,
        le=_ONE_DAY_MS,
        description="First delay before an automatic relaunch (a failed launch, an unhealthy "
        "generation), in milliseconds; it doubles per consecutive failure, with jitter.",
    )
    restart_backoff_max_ms: int = Field(
        default=60_000,
        ge=1,
        le=_ONE_DAY_MS,
        description="Longest delay between automatic relaunches, in milliseconds.",
    )
    max_launch_attempts: int = Field(
        default=5,
        ge=1,
        le=1_000,
        description="Consecutive failed launches before the deployment is held in crash_loop "
        "until reset.",
    )
    max_context: int | None = Field(
        default=None,
        ge=1,
        le=_MAX_U32,
        description="Context length in tokens; default: the catalog context length.",
    )
    kv_quant: KvQuant = Field(default=KvQuant.AUTO, description="KV-cache element type.")
    engine: EngineChoice = Field(default=EngineChoice.AUTO, description="auto, llama_cpp or vllm.")
    rollout: Rollout = Field(
        default=Rollout.ROLLING, description="rolling (overlap) or recreate (stop old first)."
    )
    routing: RoutingPolicy = Field(
        default=RoutingPolicy.LEAST_OUTSTANDING,
        description="How a request picks among the replicas: least_outstanding (fewest in "
        "flight and queued) or prefix (the replica whose prompt cache most likely holds the "
        "request's prefix, by rendezvous hashing, bounded by load; docs/cluster.md).",
    )
    split: SplitMode = Field(
        default=SplitMode.AUTO,
        description="Fleet only (cluster_authority), llama.cpp only: auto (a replica no "
        "single node holds is split over several nodes' ggml-rpc-server workers, and the "
        "placement says so), rpc (always split, over the fewest nodes that hold it) or none "
        '(never; it stays unplaced). docs/cluster.md, "One model over several hosts".',
    )
    extra_args: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Allowlisted engine tuning flags; runtime-owned flags are refused.",
    )
    chunked_prefill: ChunkedPrefillConfig | None = Field(
        default=None, description="vLLM only: chunked prefill."
    )
    tool_call_parser: NonBlank | None = Field(
        default=None, description="vLLM only: tool-call parser name."
    )
    swap_space_gib: float | None = Field(
        default=None, ge=0, le=1024, description="vLLM only: CPU swap space in GiB."
    )
    cpu_offload_gib: float | None = Field(
        default=None, ge=0, le=1024, description="vLLM only: CPU weight offload in GiB."
    )
    engine_version: VersionTag | None = Field(
        default=None, description="Per-deployment engine version override."
    )
    engine_image: ImageRef | None = Field(
        default=None, description="Per-deployment container image override (digest-pinned)."
    )
    engine_sha256: Sha256Hex | None = Field(
        default=None, description="Per-deployment engine archive digest override."
    )

    @property
    def replica_range(self) -> ReplicaRange | None:
        """The autoscaling range, or ``None`` for a fixed count."""
        return self.replicas if isinstance(self.replicas, ReplicaRange) else None

    @property
    def max_replicas(self) -> int:
        """The most replicas this deployment may have: the fixed count, or the range's
        ``max``."""
        return self.replicas.max if isinstance(self.replicas, ReplicaRange) else self.replicas

    @property
    def replica_count(self) -> int:
        """The replicas to run before any scaling decision: the fixed count, or the range's
        :meth:`~sbproxy.config.autoscale.ReplicaRange.initial`."""
        if isinstance(self.replicas, ReplicaRange):
            return self.replicas.initial()
        return self.replicas

    @property
    def scale_target(self) -> float:
        """Requests in flight per replica an autoscaled deployment aims at: the range's
        ``target``, else ``max_concurrency``."""
        target = self.replicas.target if isinstance(self.replicas, ReplicaRange) else None
        return float(target if target is not None else self.max_concurrency)

    @field_validator("replicas", mode="before")
    @classmethod
    def _replica_form(cls, value: Any) -> Any:
        # Validated here rather than by the union, so that an error names the range's own
        # field (``replicas.max``), not both branches of the union.
        if isinstance(value, dict):
            return range_or_problems(value)
        if isinstance(value, bool) or not isinstance(value, int | ReplicaRange):
            raise ValueError("must be a whole number or a range {min, max, ...}")
        if isinstance(value, int) and value < 1:
            raise ValueError("Input should be greater than or equal to 1")
        if isinstance(value, int) and value > _MAX_U32:
            raise ValueError(f"Input should be less than or equal to {_MAX_U32}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            found = [k for k in data if k in UNSUPPORTED_DEPLOYMENT_FIELDS]
            if found:
                raise RuleViolation(
                    [((k,), f"{k}: {UNSUPPORTED_DEPLOYMENT_FIELDS[k]}") for k in found]
                )
        return data

    @field_validator("spread_by")
    @classmethod
    def _spread_labels(cls, value: list[str]) -> list[str]:
        for label in value:
            if not _LABEL_RE.match(label):
                raise ValueError(
                    f"label {label!r} must be 1-128 characters of letters, digits, '.', '_', "
                    "'/' or '-'"
                )
        if len(set(value)) != len(value):
            raise ValueError("labels must be unique (duplicate label)")
        return value

    @field_validator("devices")
    @classmethod
    def _distinct_devices(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError(f"device indexes must be distinct (duplicate device in {value})")
        return value

    def _split_problems(self) -> list[tuple[tuple[str | int, ...], str]]:
        if self.split != SplitMode.RPC:
            return []
        if self.engine == EngineChoice.VLLM:
            return [
                (
                    ("split",),
                    "split: rpc runs llama.cpp's RPC workers; vLLM has no such split here: "
                    "use engine: llama_cpp (or auto) or drop split",
                )
            ]
        if (self.tensor_parallel or 1) > 1:
            return [
                (
                    ("split",),
                    f"split: rpc puts one device of each node in the split; tensor_parallel "
                    f"{self.tensor_parallel} asks for several on one node: drop one of the two",
                )
            ]
        return []

    @model_validator(mode="after")
    def _cross_field(self) -> DeploymentConfig:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        if (
            self.devices is not None
            and self.tensor_parallel is not None
            and len(self.devices) != self.tensor_parallel
        ):
            problems.append(
                (
                    ("devices",),
                    f"devices lists {len(self.devices)} device(s) but tensor_parallel is "
                    f"{self.tensor_parallel}; list exactly tensor_parallel devices or drop "
                    "one of the two",
                )
            )
        if self.max_replicas > 1 and self.variant is None and not self.heterogeneous_variants:
            problems.append(
                (
                    ("replicas",),
                    f"replicas: {self.max_replicas} needs a pinned `variant` (or "
                    "heterogeneous_variants: true) so every replica serves the same artifact",
                )
            )
        if self.max_context is not None and self.max_output_tokens > self.max_context:
            problems.append(
                (
                    ("max_output_tokens",),
                    f"max_output_tokens {self.max_output_tokens} exceeds max_context "
                    f"{self.max_context}: an answer cannot be longer than the context",
                )
            )
        if self.restart_backoff_initial_ms > self.restart_backoff_max_ms:
            problems.append(
                (
                    ("restart_backoff_initial_ms",),
                    f"restart_backoff_initial_ms {self.restart_backoff_initial_ms} exceeds "
                    f"restart_backoff_max_ms {self.restart_backoff_max_ms}",
                )
            )
        problems.extend(self._split_problems())
        if self.engine == EngineChoice.LLAMA_CPP:
            problems.extend(
                ((name,), f"{name} is a vLLM setting; remove it or use engine: vllm")
                for name in _VLLM_ONLY
                if getattr(self, name) is not None
            )
        kinds: tuple[EngineKind, ...]
        if self.engine == EngineChoice.LLAMA_CPP:
            kinds = ("llama_cpp",)
        elif self.engine == EngineChoice.VLLM:
            kinds = ("vllm",)
        else:
            kinds = ("llama_cpp", "vllm")
        seen: set[int] = set()
        for kind in kinds:
            for index, message in check_engine_args(kind, self.extra_args):
                if index not in seen:
                    seen.add(index)
                    suffix = " (engine: auto must accept it for llama_cpp and vllm)"
                    problems.append(
                        (
                            ("extra_args", index),
                            message + (suffix if self.engine == EngineChoice.AUTO else ""),
                        )
                    )
        if problems:
            raise RuleViolation(problems)
        return self


class JournalConfig(ConfigModel):
    """``proxy.model_host.journal``: where the job journal lives when not in the cache."""

    url: SecretStr = Field(
        description="PostgreSQL URL of the shared job journal, "
        "postgresql://user@host:port/dbname (libpq parameters such as sslmode, service, "
        "passfile apply). The password comes from ${ENV} interpolation or a pgpass/service "
        "file. Behind PgBouncer's transaction pooling add prepare_threshold=none (no "
        "server-side prepared statements). Absent: the SQLite journal in the cache directory.",
    )

    @field_validator("url")
    @classmethod
    def _postgres_url(cls, value: SecretStr) -> SecretStr:
        problem = journal_url_problem(value.get_secret_value())
        if problem is not None:
            # Its own error type: the loader reports it as ``invalid_journal_url``.
            raise PydanticCustomError(
                INVALID_JOURNAL_URL,
                "not a usable journal URL (invalid_journal_url): it {problem}; write {form}",
                {"problem": problem, "form": JOURNAL_URL_FORM},
            )
        return value


class ModelHostConfig(ConfigModel):
    """``proxy.model_host``: the managed runtime of this node."""

    authority: Authority = Field(
        default=Authority.FILE_MANAGED,
        description="Owner of deployment definitions: file_managed (sb.yml), admin_managed (a "
        "revision store) or cluster_authority (the fleet's revision store in the shared "
        "PostgreSQL journal, placed across its hosts).",
    )
    store_path: str | None = Field(
        default=None,
        description="Revision store file for admin_managed; relative to sb.yml's directory.",
    )
    catalog_file: str | None = Field(
        default=None,
        description="Operator catalog replacing the built-in one; relative to sb.yml's directory.",
    )
    max_parallel_prepares: int = Field(
        default=2, ge=1, le=1024, description="Artifact and engine preparations run at once."
    )
    cpu_devices: int = Field(
        default=1,
        ge=1,
        le=256,
        description="On a CPU host, split the CPU memory budget (and the cores) into this "
        "many equal devices, so that several engines -- e.g. two replicas of one deployment "
        "the fleet places on this node -- run side by side, each with its share. Ignored on "
        "a GPU host, whose devices are its GPUs.",
    )
    safety_margin: float = Field(
        default=0.10,
        ge=0,
        lt=1,
        description="Fraction added to each memory estimate before admission, in [0, 1).",
    )
    shutdown_deadline_ms: int = Field(
        default=30_000,
        ge=1,
        le=_ONE_DAY_MS,
        description="Drain grace for active requests, in milliseconds. On SIGTERM or "
        "SIGINT, requests still running after it are ended with 503 shutting_down and the "
        "process exits within it plus 2 s.",
    )
    handoff_timeout_ms: int = Field(
        default=60_000,
        ge=1,
        le=_ONE_DAY_MS,
        description="Rolling handoff timeout, in milliseconds.",
    )
    node: NodeConfig = Field(
        default_factory=NodeConfig,
        description="This host as a fleet member (authority: cluster_authority).",
    )
    fleet: FleetConfig = Field(
        default_factory=FleetConfig,
        description="Fleet membership timing and placement policy (authority: cluster_authority).",
    )
    cache: CacheConfig = Field(default_factory=CacheConfig, description="Artifact cache.")
    journal: JournalConfig | None = Field(
        default=None,
        description="The job journal on PostgreSQL, shared by several hosts; absent: SQLite "
        "in the cache directory.",
    )
    engines: EnginesConfig = Field(default_factory=EnginesConfig, description="Engine policy.")
    deployments: dict[Identifier, DeploymentConfig] = Field(
        default_factory=dict,
        description="Deployments by operator id ([A-Za-z0-9._-], at most 128 characters).",
    )

    _resolve_paths = field_validator("store_path", "catalog_file")(resolve_relative)

    @field_validator("safety_margin")
    @classmethod
    def _finite_margin(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number in [0, 1)")
        return value

    @model_validator(mode="after")
    def _authority_rules(self) -> ModelHostConfig:
        if self.authority == Authority.CLUSTER_AUTHORITY and self.journal is None:
            raise RuleViolation.at(
                "authority",
                "cluster_authority needs the shared PostgreSQL journal "
                "(proxy.model_host.journal.url); the SQLite journal serves one host only",
            )
        if self.authority != Authority.CLUSTER_AUTHORITY:
            split = sorted(d for d, c in self.deployments.items() if c.split == SplitMode.RPC)
            if split:
                raise RuleViolation(
                    [
                        (
                            ("deployments", d, "split"),
                            "split: rpc spreads one replica over several hosts and needs "
                            "authority: cluster_authority on the shared PostgreSQL journal; a "
                            "single host runs the whole model: drop split",
                        )
                        for d in split
                    ]
                )
            ranged = sorted(d for d, c in self.deployments.items() if c.replica_range)
            if ranged:
                raise RuleViolation(
                    [
                        (
                            ("deployments", d, "replicas"),
                            "replicas as a range {min, max} (autoscaling) needs authority: "
                            "cluster_authority on the shared PostgreSQL journal; a single "
                            "host runs one replica: give replicas a number",
                        )
                        for d in ranged
                    ]
                )
        if self.authority == Authority.ADMIN_MANAGED and self.store_path is None:
            raise RuleViolation.at(
                "store_path",
                "authority: admin_managed requires store_path (the revision store file)",
            )
        return self
