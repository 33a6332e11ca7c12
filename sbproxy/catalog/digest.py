"""The artifact digest: one SHA-256 that names exactly which bytes a deployment serves.

The digest covers the catalog revision, the logical model, the variant and everything that
determines the bytes (format, quant, source, revision, and each file's path, SHA-256 and
size). It deliberately leaves out the engine and the modality: the same bytes served by a
different engine are the same artifact, and share one cache snapshot.

Canonical form: RFC 8785 (JSON Canonicalization Scheme) via the ``rfc8785`` library, so the
digest is independent of key order and whitespace and matches the reference implementation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import rfc8785

from sbproxy.catalog.schema import ArtifactFile, ArtifactFormat, ArtifactVariant

__all__ = ["artifact_digest", "canonical_artifact_json", "variant_digest"]


def canonical_artifact_json(
    *,
    catalog_revision: str,
    logical_model: str,
    variant_id: str,
    format: ArtifactFormat,  # noqa: A002 - the field is called format in the contract
    quant: str,
    source: str,
    revision: str,
    files: Sequence[ArtifactFile],
) -> bytes:
    """Return the RFC 8785 canonical JSON bytes that :func:`artifact_digest` hashes.

    The object is ``{catalog_revision, logical_model, variant_id, format, quant, source,
    revision, files: [{path, sha256, size_bytes}, ...]}`` with files in declaration order.
    """
    listed: list[dict[str, str | int]] = [
        {"path": item.path, "sha256": item.sha256, "size_bytes": item.size_bytes} for item in files
    ]
    document: dict[str, str | list[dict[str, str | int]]] = {
        "catalog_revision": catalog_revision,
        "logical_model": logical_model,
        "variant_id": variant_id,
        "format": format.value,
        "quant": quant,
        "source": source,
        "revision": revision,
        "files": listed,
    }
    encoded: bytes = rfc8785.dumps(document)
    return encoded


def artifact_digest(
    *,
    catalog_revision: str,
    logical_model: str,
    variant_id: str,
    format: ArtifactFormat,  # noqa: A002 - the field is called format in the contract
    quant: str,
    source: str,
    revision: str,
    files: Sequence[ArtifactFile],
) -> str:
    """Return the artifact digest: lowercase hex SHA-256 (64 chars) of the canonical JSON.

    Example: ``qwen2.5-0.5b-instruct``/``q4_k_m`` in catalog ``builtin-2026-07-10`` has the
    digest ``830f2915...0591`` (pinned by the test suite; it matches the reference ledger).
    """
    canonical = canonical_artifact_json(
        catalog_revision=catalog_revision,
        logical_model=logical_model,
        variant_id=variant_id,
        format=format,
        quant=quant,
        source=source,
        revision=revision,
        files=files,
    )
    return hashlib.sha256(canonical).hexdigest()


def variant_digest(*, catalog_revision: str, logical_model: str, variant: ArtifactVariant) -> str:
    """Artifact digest of ``variant`` of ``logical_model`` in catalog ``catalog_revision``."""
    return artifact_digest(
        catalog_revision=catalog_revision,
        logical_model=logical_model,
        variant_id=variant.id,
        format=variant.format,
        quant=variant.quant,
        source=variant.source,
        revision=variant.revision,
        files=variant.files,
    )
