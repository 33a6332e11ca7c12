"""Artifact resolution: pick the exact catalog variant a deployment serves on a worker.

Resolution is pure policy (no I/O). Given a catalog, a request (model, optional variant,
engine choice, replica count) and a :class:`WorkerProfile`, it returns a
:class:`Resolution`: the chosen :class:`ResolvedArtifact` plus every candidate it skipped
and why. Checks run in a fixed order (reference ``Catalog::resolve_artifact``):

1. the model must exist (``unknown_catalog_model``);
2. more than one replica needs a pinned variant unless ``heterogeneous_variants`` is set
   (``variant_not_pinned``);
3. the entry must have catalog v2 variants (``preview_incomplete``);
4. an explicit variant must exist (``unknown_catalog_variant``);
5. candidates (the pinned variant, or every variant in declaration order with pickle ones
   moved last) are tried in turn: pickle needs ``allow_pickle``; the worker's accelerator
   must be listed; its memory must cover ``min_memory_bytes``; a CUDA worker must meet
   ``min_compute_capability``; and an engine must be available. The first candidate that
   passes wins; if none does, :class:`NoCompatibleVariantError` lists each reason.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sbproxy.catalog.digest import variant_digest
from sbproxy.catalog.schema import (
    Accelerator,
    ArtifactFile,
    ArtifactFormat,
    ArtifactVariant,
    Catalog,
    CatalogEntry,
    EngineKind,
    Stability,
)
from sbproxy.errors import ResolutionError

__all__ = [
    "DEFAULT_WORKER_ENGINES",
    "ArtifactRequest",
    "EngineChoice",
    "NoCompatibleVariantError",
    "RejectedCandidate",
    "RejectionKind",
    "Resolution",
    "ResolvedArtifact",
    "WorkerProfile",
    "pinned_artifact",
    "resolve_artifact",
]

DEFAULT_WORKER_ENGINES: frozenset[EngineKind] = frozenset({EngineKind.LLAMA_CPP, EngineKind.VLLM})
"""Engines a worker offers to ``engine: auto`` unless told otherwise. SGLang and mistral.rs
are opt-in only (an explicit ``engine:``), so automatic selection never picks them."""

EngineChoice = Literal["auto", "vllm", "sglang", "llama_cpp", "mistralrs"]
"""``auto`` or the name of one :class:`~sbproxy.catalog.schema.EngineKind`."""

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class WorkerProfile(BaseModel):
    """The device a deployment would run on, as the probe found it."""

    model_config = _FROZEN

    accelerator: Accelerator = Field(description="cpu, cuda or metal.")
    memory_bytes: int = Field(
        ge=0, description="Memory available to a model on this device, in bytes."
    )
    compute_capability: tuple[int, int] | None = Field(
        default=None, description="CUDA compute capability (major, minor); None when unknown."
    )
    engines: frozenset[EngineKind] = Field(
        default=DEFAULT_WORKER_ENGINES,
        description="Engines the worker offers to automatic engine selection.",
    )

    def describe(self) -> str:
        """One human line, e.g. ``cuda (compute 9.0), 140.4 GiB available``."""
        kind = self.accelerator.value
        if self.compute_capability is not None:
            major, minor = self.compute_capability
            kind += f" (compute {major}.{minor})"
        return f"{kind}, {self.memory_bytes / 2**30:.1f} GiB available"


class ArtifactRequest(BaseModel):
    """What a deployment asks the catalog for."""

    model_config = _FROZEN

    model: str = Field(description="Logical model id, e.g. 'qwen3-8b'.")
    variant: str | None = Field(default=None, description="Pinned variant id; None for auto.")
    engine: EngineChoice = Field(default="auto", description="Engine, or auto.")
    replicas: int = Field(default=1, ge=1, description="Number of replicas deployed.")
    heterogeneous_variants: bool = Field(
        default=False, description="Let each replica pick its own variant for its worker."
    )


class RejectionKind(StrEnum):
    """Why a candidate variant was skipped, as a stable machine-readable label."""

    PICKLE_REFUSED = "pickle_refused"
    ACCELERATOR_UNSUPPORTED = "accelerator_unsupported"
    INSUFFICIENT_MEMORY = "insufficient_memory"
    COMPUTE_CAPABILITY = "compute_capability"
    ENGINE_UNAVAILABLE = "engine_unavailable"


class RejectedCandidate(BaseModel):
    """A variant that was considered and skipped."""

    model_config = _FROZEN

    variant_id: str = Field(description="The skipped variant's id.")
    kind: RejectionKind = Field(description="Machine-readable reason.")
    reason: str = Field(description="Human-readable reason.")

    def render(self) -> str:
        """``<variant_id>: <reason>``."""
        return f"{self.variant_id}: {self.reason}"


class ResolvedArtifact(BaseModel):
    """The exact artifact chosen for a deployment on a worker."""

    model_config = _FROZEN

    logical_model: str = Field(description="Logical model id.")
    variant_id: str = Field(description="Chosen variant id.")
    format: ArtifactFormat = Field(description="Weight format.")
    quant: str = Field(description="Quantisation label.")
    source: str = Field(description="hf:Org/Repo or file:/abs/path.")
    revision: str = Field(description="Source revision.")
    files: tuple[ArtifactFile, ...] = Field(description="Files with SHA-256 and size.")
    catalog_revision: str = Field(description="Revision of the catalog it came from.")
    digest: str = Field(description="Artifact digest, lowercase hex SHA-256 (64 chars).")
    engine: EngineKind = Field(description="Engine selected to serve it.")
    stability: Stability = Field(description="Stability of the variant.")
    context_length: int = Field(description="Model context length in tokens.")
    min_memory_bytes: int = Field(description="Memory the variant needs, in bytes.")
    chat_template: str = Field(
        default="embedded",
        description="embedded, none (completion only) or an engine template name.",
    )

    @property
    def can_chat(self) -> bool:
        """Whether chat completions have a known template."""
        return self.chat_template != "none"

    @property
    def total_size_bytes(self) -> int:
        """Sum of the file sizes, in bytes."""
        return sum(item.size_bytes for item in self.files)


class Resolution(BaseModel):
    """Outcome of a successful resolution."""

    model_config = _FROZEN

    artifact: ResolvedArtifact = Field(description="The chosen artifact.")
    rejected: tuple[RejectedCandidate, ...] = Field(
        default=(), description="Candidates tried before it, in order, with reasons."
    )


class NoCompatibleVariantError(ResolutionError):
    """Every candidate variant was rejected (code ``no_compatible_variant``).

    Attributes:
        model: The logical model id.
        rejected: Each candidate with its reason, in the order tried.
    """

    default_code = "no_compatible_variant"

    def __init__(self, model: str, rejected: tuple[RejectedCandidate, ...]) -> None:
        self.model = model
        self.rejected = rejected
        reasons = "; ".join(candidate.render() for candidate in rejected)
        super().__init__(
            f"model '{model}' has no compatible artifact variant on this worker: {reasons}.",
            remediation="Pick a variant this worker can run, or run it on a worker that fits.",
            details={"model": model},
        )


def resolve_artifact(
    catalog: Catalog, request: ArtifactRequest, worker: WorkerProfile
) -> Resolution:
    """Choose the catalog variant ``request`` runs as on ``worker``.

    Args:
        catalog: A validated catalog document.
        request: Model, optional variant, engine choice and replica settings.
        worker: The device profile to resolve for.

    Returns:
        The resolved artifact and the candidates rejected before it.

    Raises:
        ResolutionError: code ``unknown_catalog_model``, ``variant_not_pinned``,
            ``preview_incomplete`` or ``unknown_catalog_variant``.
        NoCompatibleVariantError: code ``no_compatible_variant`` when every candidate is
            rejected; its ``rejected`` attribute lists them.
    """
    model = request.model
    entry = catalog.models.get(model)
    if entry is None:
        raise ResolutionError(
            f"model '{model}' is not in the catalog (revision {catalog.catalog_revision}).",
            code="unknown_catalog_model",
            remediation="Run `sbproxy models list` to see the ids the catalog has.",
            details={"model": model},
        )
    if request.replicas > 1 and request.variant is None and not request.heterogeneous_variants:
        raise ResolutionError(
            f"model '{model}' is deployed with {request.replicas} replicas but no variant, so "
            "replicas on different hardware could serve different artifacts; pin a variant or "
            "set heterogeneous_variants: true.",
            code="variant_not_pinned",
            details={"model": model, "replicas": request.replicas},
        )
    if entry.is_preview_incomplete:
        raise ResolutionError(
            f"model '{model}' has no complete catalog v2 artifact variant: its entry lacks "
            "exact files, digests, sizes, a source revision and hardware requirements.",
            code="preview_incomplete",
            remediation="Describe it with catalog v2 variants in a catalog file.",
            details={"model": model},
        )
    candidates = _candidates(model, entry, request.variant)
    rejected: list[RejectedCandidate] = []
    for variant in candidates:
        outcome = _check_candidate(entry, variant, request.engine, worker)
        if isinstance(outcome, RejectedCandidate):
            rejected.append(outcome)
            continue
        artifact = pinned_artifact(catalog, model, entry, variant, engine=outcome)
        return Resolution(artifact=artifact, rejected=tuple(rejected))
    raise NoCompatibleVariantError(model, tuple(rejected))


def pinned_artifact(
    catalog: Catalog,
    model: str,
    entry: CatalogEntry,
    variant: ArtifactVariant,
    *,
    engine: EngineKind,
) -> ResolvedArtifact:
    """The artifact ``variant`` of ``entry`` names, served by ``engine``, with no worker check.

    :func:`resolve_artifact` builds its answer with this once a candidate passes; callers
    that already know the exact variant (a lockfile) use it to name the same bytes.
    """
    return ResolvedArtifact(
        logical_model=model,
        variant_id=variant.id,
        format=variant.format,
        quant=variant.quant,
        source=variant.source,
        revision=variant.revision,
        files=variant.files,
        catalog_revision=catalog.catalog_revision,
        digest=variant_digest(
            catalog_revision=catalog.catalog_revision, logical_model=model, variant=variant
        ),
        engine=engine,
        stability=variant.stability,
        # A validated entry with variants always has a context length.
        context_length=entry.context_length or 0,
        min_memory_bytes=variant.requirements.min_memory_bytes,
        chat_template=variant.chat_template,
    )


def _candidates(
    model: str, entry: CatalogEntry, variant_id: str | None
) -> tuple[ArtifactVariant, ...]:
    if variant_id is not None:
        pinned = entry.variant(variant_id)
        if pinned is None:
            raise ResolutionError(
                entry.unknown_variant_message(model, variant_id) + ".",
                code="unknown_catalog_variant",
                details={"model": model, "variant": variant_id},
            )
        return (pinned,)
    # Pickle weights can run code when loaded: prefer any other format, whatever the order.
    return tuple(sorted(entry.variants, key=lambda v: v.format is ArtifactFormat.PICKLE))


def _check_candidate(
    entry: CatalogEntry,
    variant: ArtifactVariant,
    engine: EngineChoice,
    worker: WorkerProfile,
) -> RejectedCandidate | EngineKind:
    """Return the engine to use, or why ``variant`` cannot run on ``worker``."""
    refusal = _refuse_for_policy_or_hardware(entry, variant, worker)
    if refusal is not None:
        return RejectedCandidate(variant_id=variant.id, kind=refusal[0], reason=refusal[1])
    offered = ", ".join(e.value for e in variant.engines)
    if engine != "auto":
        forced = EngineKind(engine)
        if forced in variant.engines:
            return forced
        reason = f"engine {forced.value} was requested but the variant is served by {offered}"
    else:
        chosen = next((e for e in variant.engines if e in worker.engines), None)
        if chosen is not None:
            return chosen
        runs = ", ".join(sorted(e.value for e in worker.engines)) or "none"
        reason = (
            f"no compatible engine on worker: variant is served by {offered}, automatic "
            f"selection offers {runs} (name an engine explicitly to opt in)"
        )
    return RejectedCandidate(
        variant_id=variant.id, kind=RejectionKind.ENGINE_UNAVAILABLE, reason=reason
    )


def _refuse_for_policy_or_hardware(
    entry: CatalogEntry, variant: ArtifactVariant, worker: WorkerProfile
) -> tuple[RejectionKind, str] | None:
    """Why ``variant`` may not run on ``worker`` regardless of engine, or ``None``."""
    needs = variant.requirements
    if variant.format is ArtifactFormat.PICKLE and not entry.allow_pickle:
        return (
            RejectionKind.PICKLE_REFUSED,
            "pickle weights require allow_pickle: true on the model (unpickling can run code)",
        )
    if worker.accelerator not in needs.accelerators:
        listed = ", ".join(a.value for a in needs.accelerators)
        return (
            RejectionKind.ACCELERATOR_UNSUPPORTED,
            f"variant runs on {listed}; worker is {worker.accelerator.value}",
        )
    if worker.memory_bytes < needs.min_memory_bytes:
        return (
            RejectionKind.INSUFFICIENT_MEMORY,
            f"worker has {worker.memory_bytes} bytes but variant needs {needs.min_memory_bytes}",
        )
    return _compute_capability_refusal(variant, worker)


def _compute_capability_refusal(
    variant: ArtifactVariant, worker: WorkerProfile
) -> tuple[RejectionKind, str] | None:
    """Why a CUDA ``worker`` is too old for ``variant``, or ``None``; other workers pass."""
    minimum = variant.requirements.min_compute_capability
    if worker.accelerator is not Accelerator.CUDA or minimum is None:
        return None
    if worker.compute_capability is None:
        return (
            RejectionKind.COMPUTE_CAPABILITY,
            f"variant needs CUDA compute capability {minimum} or newer; the worker's is unknown",
        )
    if worker.compute_capability < minimum.as_tuple():
        major, minor = worker.compute_capability
        return (
            RejectionKind.COMPUTE_CAPABILITY,
            f"worker CUDA compute capability {major}.{minor} is below the variant's "
            f"minimum {minimum}",
        )
    return None
