"""Deployment definitions as the runtime records them: the catalog request a definition
makes, the desired state as JSON, and the digests that tell a changed definition apart."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import rfc8785

from sbproxy.catalog import ArtifactRequest
from sbproxy.config import CompiledConfig, DeploymentConfig

__all__ = ["artifact_request", "deployment_digest", "desired_digest", "desired_of"]


def artifact_request(config: DeploymentConfig) -> ArtifactRequest:
    """What a deployment asks the catalog for (model, variant, engine, replicas)."""
    return ArtifactRequest.model_validate(
        {
            "model": config.model,
            "variant": config.variant,
            "engine": str(config.engine),
            "replicas": config.max_replicas,
            "heterogeneous_variants": config.heterogeneous_variants,
        }
    )


def desired_of(compiled: CompiledConfig) -> dict[str, Any]:
    """The desired deployments of ``compiled`` as JSON objects by id."""
    return {k: v.model_dump(mode="json") for k, v in compiled.deployments.items()}


def deployment_digest(config: DeploymentConfig) -> str:
    """SHA-256 hex of one deployment's definition (RFC 8785 canonical JSON): what a
    ``load`` job records, so that a host never runs a load its configuration changed."""
    return desired_digest({"deployment": config.model_dump(mode="json")})


def desired_digest(desired: Mapping[str, object]) -> str:
    """SHA-256 hex of the RFC 8785 canonical JSON of desired deployments (stable across key
    order and a JSON round trip)."""
    return hashlib.sha256(rfc8785.dumps(dict(desired))).hexdigest()  # type: ignore[arg-type]
