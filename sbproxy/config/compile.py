"""Compile a validated ``sb.yml`` into the desired state the runtime consumes.

Compilation lowers every compatibility ``serve:`` block into canonical deployments, merges
legacy host policy into ``proxy.model_host``, and collects the public routes of every origin.
Any conflict rejects the whole file: the runtime never picks "the first origin".

Lowered deployment ids follow the reference implementation (reference section 3.5):
``legacy-<provider>-<public model>-<8 hex>``, where the hex is the start of the SHA-256 of the
RFC 8785 canonical JSON of ``{provider, public_model, entry}``. Equivalent declarations in
several origins therefore produce one id and one deployment.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import rfc8785
from pydantic import ValidationError

from sbproxy.config._rules import dotted
from sbproxy.config.document import SbConfig
from sbproxy.config.model_host import (
    Authority,
    CacheConfig,
    DeploymentConfig,
    ModelHostConfig,
)
from sbproxy.config.origins import ServeBlock, ServeEntry, parse_duration_secs
from sbproxy.errors import ConfigError, ConfigIssue

__all__ = ["CompiledConfig", "Route", "compile_config", "legacy_deployment_id"]

Loc = tuple[str | int, ...]

_FRAG_RE = re.compile(r"[^a-z0-9._]+")
# Legacy entries kept 128 waiting requests; the reference lowers to the same bound.
_LEGACY_QUEUE_DEPTH = 128


@dataclass(frozen=True)
class Route:
    """One public model name of one origin, routed to one deployment.

    Attributes:
        origin: Host the route belongs to.
        provider: Provider name inside the origin.
        public_model: Model name clients send.
        deployment: Canonical deployment id that serves it.
        default: Whether requests naming no model use this route.
    """

    origin: str
    provider: str
    public_model: str
    deployment: str
    default: bool = False


@dataclass(frozen=True)
class CompiledConfig:
    """The desired state of one ``sb.yml``.

    Attributes:
        config: The validated document as written.
        model_host: Effective host policy with canonical and lowered deployments, or ``None``
            when the file declares no model host.
        routes: Every public route, sorted by (origin, provider, public_model).
        lowered_from: Lowered deployment id -> dotted path of the first serve entry behind it.
        source: File the configuration came from, if any.
        content_sha256: SHA-256 (lowercase hex) of the bytes of ``source`` this was compiled
            from, as ``sha256sum`` prints it; ``None`` when it did not come from a file.
    """

    config: SbConfig
    model_host: ModelHostConfig | None
    routes: tuple[Route, ...]
    lowered_from: Mapping[str, str] = field(default_factory=dict)
    source: Path | None = None
    content_sha256: str | None = None

    @property
    def deployments(self) -> Mapping[str, DeploymentConfig]:
        """All deployments by id (empty without a model host)."""
        return self.model_host.deployments if self.model_host else {}


def _frag(text: str) -> str:
    frag = _FRAG_RE.sub("-", text.lower()).strip("-")
    return frag or "unnamed"


def legacy_deployment_id(provider: str, public_model: str, entry: ServeEntry) -> str:
    """Deterministic id of a lowered ``serve:`` entry (see module docstring)."""
    body: dict[str, object] = {
        "provider": provider,
        "public_model": public_model,
        "entry": entry.model_dump(mode="json", exclude_defaults=True),
    }
    digest = hashlib.sha256(rfc8785.dumps(body)).hexdigest()  # type: ignore[arg-type]
    return f"legacy-{_frag(provider)}-{_frag(public_model)}-{digest[:8]}"


class _Compiler:
    def __init__(self, config: SbConfig) -> None:
        self.config = config
        self.issues: list[ConfigIssue] = []
        self.lowered: dict[str, DeploymentConfig] = {}
        self.lowered_from: dict[str, str] = {}

    def issue(self, loc: Loc, message: str) -> None:
        self.issues.append(ConfigIssue(dotted(loc), message))

    # -- serve: lowering -------------------------------------------------------------------

    def serve_blocks(self) -> list[tuple[Loc, str, ServeBlock]]:
        blocks = []
        for host, origin in self.config.origins.items():
            for index, provider in enumerate(origin.action.providers):
                if provider.serve is not None:
                    loc: Loc = ("origins", host, "action", "providers", index, "serve")
                    blocks.append((loc, provider.name, provider.serve))
        return blocks

    def host_policy(self, blocks: list[tuple[Loc, str, ServeBlock]]) -> ModelHostConfig | None:
        canonical = self.config.proxy.model_host
        if not blocks:
            return canonical
        policy_fields = (
            "cache_dir",
            "catalog_file",
            "cache_budget_gib",
            "eviction",
            "max_concurrent_requests",
            "queue_timeout_ms",
        )
        first_loc, _, first = blocks[0]
        for loc, _, block in blocks[1:]:
            for name in policy_fields:
                if getattr(block, name) != getattr(first, name):
                    self.issue(
                        (*loc, name),
                        f"conflicting legacy host policy: {name} differs from "
                        f"{dotted(first_loc)} ({getattr(first, name)!r} vs "
                        f"{getattr(block, name)!r}); every serve: block must agree, or move "
                        "host policy to proxy.model_host",
                    )
        host = canonical or ModelHostConfig()
        cache_updates: dict[str, Any] = {}
        pairs = (
            ("cache_dir", host.cache.directory, "directory", "proxy.model_host.cache.directory"),
            ("cache_budget_gib", host.cache.budget_gib, "budget_gib", "proxy.model_host.cache"),
        )
        for legacy_name, current, target, where in pairs:
            value = getattr(first, legacy_name)
            if value is None:
                continue
            if current is not None and current != value:
                self.issue(
                    (*first_loc, legacy_name),
                    f"conflicts with {where} ({current!r}); one node has one cache root and "
                    "budget: remove the legacy setting",
                )
            cache_updates[target] = value
        if first.eviction != "lru":
            cache_updates["eviction"] = first.eviction
        updates: dict[str, Any] = {}
        if first.catalog_file is not None:
            if host.catalog_file is not None and host.catalog_file != first.catalog_file:
                self.issue(
                    (*first_loc, "catalog_file"),
                    f"conflicts with proxy.model_host.catalog_file ({host.catalog_file!r}); "
                    "one node loads one catalog",
                )
            updates["catalog_file"] = first.catalog_file
        if cache_updates:
            cache = CacheConfig.model_validate({**host.cache.model_dump(), **cache_updates})
            updates["cache"] = cache
        return host.model_copy(update=updates) if updates else host

    def lower_entry(
        self, loc: Loc, provider: str, block: ServeBlock, entry: ServeEntry
    ) -> str | None:
        public = entry.name or entry.model
        deployment_id = legacy_deployment_id(provider, public, entry)
        extra_args = list(entry.extra_args)
        if entry.enable_prefix_caching:
            extra_args.append("--enable-prefix-caching")
        body: dict[str, Any] = {
            "model": entry.model,
            "variant": entry.variant,
            "engine": entry.engine,
            "pinned": entry.pinned,
            "kv_quant": entry.kv_quant,
            "max_context": entry.max_context,
            "extra_args": extra_args,
            "max_concurrency": block.max_concurrent_requests or 1,
            "max_queue_depth": _LEGACY_QUEUE_DEPTH,
            "queue_timeout_ms": block.queue_timeout_ms or 30_000,
        }
        if entry.keep_alive is not None:
            body["keep_alive_secs"] = parse_duration_secs(entry.keep_alive)
        try:
            deployment = DeploymentConfig.model_validate(body)
        except ValidationError as exc:
            for error in exc.errors():
                self.issue(loc, f"cannot be lowered: {error['msg']}")
            return None
        existing = self.lowered.get(deployment_id)
        if existing is not None and existing != deployment:
            self.issue(
                loc,
                f"lowers to deployment {deployment_id} which {self.lowered_from[deployment_id]} "
                "declares differently",
            )
            return None
        self.lowered[deployment_id] = deployment
        self.lowered_from.setdefault(deployment_id, dotted(loc))
        return deployment_id

    # -- routes ----------------------------------------------------------------------------

    def routes(self, host_config: ModelHostConfig | None) -> list[Route]:
        declared = set(host_config.deployments) if host_config else set()
        admin_managed = host_config is not None and host_config.authority in (
            Authority.ADMIN_MANAGED,
            Authority.CLUSTER_AUTHORITY,
        )
        routes: list[Route] = []
        owner: dict[tuple[str, str], tuple[str, Loc]] = {}
        for host, origin in self.config.origins.items():
            per_origin: dict[str, tuple[str, Loc]] = {}
            for index, provider in enumerate(origin.action.providers):
                ploc: Loc = ("origins", host, "action", "providers", index)
                targets: list[tuple[str, str, Loc]] = []
                if provider.serve is not None:
                    served: dict[str, str] = {}
                    for e_index, entry in enumerate(provider.serve.models):
                        eloc: Loc = (*ploc, "serve", "models", e_index)
                        lowered_id = self.lower_entry(eloc, provider.name, provider.serve, entry)
                        if lowered_id is not None:
                            served[entry.name or entry.model] = lowered_id
                            targets.append((entry.name or entry.model, lowered_id, eloc))
                    for m_index, name in enumerate(provider.models):
                        if name not in served:
                            self.issue(
                                (*ploc, "models", m_index),
                                f"{name!r} is not served by any serve: entry of this provider "
                                f"(served: {', '.join(sorted(served)) or 'none'})",
                            )
                elif provider.deployment is not None:
                    if provider.deployment not in declared and not admin_managed:
                        known = ", ".join(sorted(declared)) or "none declared"
                        self.issue(
                            (*ploc, "deployment"),
                            f"deployment {provider.deployment!r} is not declared under "
                            f"proxy.model_host.deployments ({known})",
                        )
                    targets.extend(
                        (name, provider.deployment, ploc) for name in provider.public_models()
                    )
                for public, deployment_id, tloc in targets:
                    previous = per_origin.get(public)
                    if previous is not None and previous[0] != deployment_id:
                        self.issue(
                            tloc,
                            f"conflicting route: public model {public!r} of origin {host!r} "
                            f"already goes to {previous[0]} ({dotted(previous[1])})",
                        )
                        continue
                    per_origin[public] = (deployment_id, tloc)
                    key = (provider.name, public)
                    prior = owner.get(key)
                    if prior is not None and prior[0] != deployment_id:
                        self.issue(
                            tloc,
                            f"conflicting route {provider.name}/{public}: {dotted(prior[1])} "
                            f"sends it to {prior[0]}, this one to {deployment_id}",
                        )
                        continue
                    owner[key] = (deployment_id, tloc)
                    routes.append(
                        Route(
                            origin=host,
                            provider=provider.name,
                            public_model=public,
                            deployment=deployment_id,
                            default=provider.default_model == public,
                        )
                    )
        unique = {(r.origin, r.provider, r.public_model): r for r in routes}
        return [unique[k] for k in sorted(unique)]

    def run(self, source: Path | None) -> CompiledConfig:
        blocks = self.serve_blocks()
        host_config = self.host_policy(blocks)
        routes = self.routes(host_config)
        if self.lowered and host_config is not None:
            merged = dict(host_config.deployments)
            for deployment_id, deployment in self.lowered.items():
                if deployment_id in merged and merged[deployment_id] != deployment:
                    self.issue(
                        ("proxy", "model_host", "deployments", deployment_id),
                        f"collides with the deployment lowered from "
                        f"{self.lowered_from[deployment_id]}",
                    )
                merged[deployment_id] = deployment
            host_config = host_config.model_copy(update={"deployments": merged})
        if self.issues:
            raise ConfigError(self.issues, source=str(source) if source else None)
        return CompiledConfig(
            config=self.config,
            model_host=host_config,
            routes=tuple(routes),
            lowered_from=dict(self.lowered_from),
            source=source,
        )


def compile_config(config: SbConfig, *, source: Path | None = None) -> CompiledConfig:
    """Lower ``serve:`` blocks, merge host policy and collect routes.

    Args:
        config: A validated document.
        source: File it came from, used in error messages.

    Returns:
        The compiled desired state.

    Raises:
        ConfigError: ``invalid_config`` listing every conflict (route, cache root, host
            policy, undeclared deployment) with its dotted path; nothing is partially applied.
    """
    return _Compiler(config).run(source)
