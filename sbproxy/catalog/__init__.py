"""The model catalog: catalog v2 documents, the built-in catalog, artifact resolution and
the artifact digest.

Typical use::

    catalog = load_catalog(catalog_file)          # operator file, else the built-in one
    resolution = resolve_artifact(catalog, ArtifactRequest(model="qwen3-8b"), worker)
    resolution.artifact.digest                    # 64-hex artifact digest

Errors are :class:`~sbproxy.errors.CatalogError` (``invalid_catalog``,
``unknown_catalog_model``) and :class:`~sbproxy.errors.ResolutionError`
(``unknown_catalog_model``, ``variant_not_pinned``, ``preview_incomplete``,
``unknown_catalog_variant``, ``no_compatible_variant``).
"""

from __future__ import annotations

from sbproxy.catalog.digest import artifact_digest, canonical_artifact_json, variant_digest
from sbproxy.catalog.loader import (
    load_builtin_catalog,
    load_catalog,
    load_catalog_file,
    parse_catalog,
)
from sbproxy.catalog.resolve import (
    DEFAULT_WORKER_ENGINES,
    ArtifactRequest,
    EngineChoice,
    NoCompatibleVariantError,
    RejectedCandidate,
    RejectionKind,
    Resolution,
    ResolvedArtifact,
    WorkerProfile,
    pinned_artifact,
    resolve_artifact,
)
from sbproxy.catalog.schema import (
    MAX_DIGESTED_INT,
    MAX_ENGINES_PER_VARIANT,
    MAX_ID_BYTES,
    MAX_MODELS,
    MAX_REVISION_BYTES,
    MAX_VARIANTS_PER_MODEL,
    Accelerator,
    ArtifactFile,
    ArtifactFormat,
    ArtifactVariant,
    Catalog,
    CatalogEntry,
    ComputeCapability,
    EngineKind,
    PullPolicy,
    Stability,
    VariantRequirements,
)

__all__ = [
    "DEFAULT_WORKER_ENGINES",
    "MAX_DIGESTED_INT",
    "MAX_ENGINES_PER_VARIANT",
    "MAX_ID_BYTES",
    "MAX_MODELS",
    "MAX_REVISION_BYTES",
    "MAX_VARIANTS_PER_MODEL",
    "Accelerator",
    "ArtifactFile",
    "ArtifactFormat",
    "ArtifactRequest",
    "ArtifactVariant",
    "Catalog",
    "CatalogEntry",
    "ComputeCapability",
    "EngineChoice",
    "EngineKind",
    "NoCompatibleVariantError",
    "PullPolicy",
    "RejectedCandidate",
    "RejectionKind",
    "Resolution",
    "ResolvedArtifact",
    "Stability",
    "VariantRequirements",
    "WorkerProfile",
    "artifact_digest",
    "canonical_artifact_json",
    "load_builtin_catalog",
    "load_catalog",
    "load_catalog_file",
    "parse_catalog",
    "pinned_artifact",
    "resolve_artifact",
    "variant_digest",
]
