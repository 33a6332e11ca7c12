"""Catalog v2 document models: what a catalog file may say, and the rules it must obey.

A catalog maps a logical model id (``qwen3-8b``) to an entry; a v2 entry lists immutable
artifact *variants*, each an exact set of files (relative path, SHA-256, size) at an exact
source revision, with the hardware it needs and the engines that can serve it.

Every model is frozen and rejects unknown fields. Rules that span fields (a stable ``hf:``
variant needs a commit revision; a ``gguf`` variant needs a ``.gguf`` file) raise
:func:`field_error` so the loader can name the exact dotted path of the offending field.

Source of the rules and bounds: the reference inventory of the catalog v2 schema
(``MH/src/artifact_spec.rs`` and ``MH/src/catalog.rs`` in the anchor implementation).
"""

from __future__ import annotations

import re
from collections.abc import Sized
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)
from pydantic_core import PydanticCustomError

from sbproxy.errors import CatalogError

__all__ = [
    "MAX_DIGESTED_INT",
    "MAX_ENGINES_PER_VARIANT",
    "MAX_ID_BYTES",
    "MAX_MODELS",
    "MAX_REVISION_BYTES",
    "MAX_VARIANTS_PER_MODEL",
    "Accelerator",
    "ArtifactFile",
    "ArtifactFormat",
    "ArtifactVariant",
    "Catalog",
    "CatalogEntry",
    "ComputeCapability",
    "EngineKind",
    "PullPolicy",
    "Stability",
    "VariantRequirements",
    "field_error",
]

MAX_MODELS = 1024
"""Most logical models one catalog document may declare."""
MAX_VARIANTS_PER_MODEL = 128
"""Most artifact variants one logical model may declare."""
MAX_ENGINES_PER_VARIANT = 16
"""Most entries in one variant's ``engines`` list."""
MAX_ID_BYTES = 128
"""Longest model id, variant id or catalog revision, in UTF-8 bytes."""
MAX_REVISION_BYTES = 128
"""Longest source revision, in UTF-8 bytes."""

MAX_DIGESTED_INT = 2**53 - 1
"""Largest integer a field that goes into an artifact digest may hold.

The digest hashes RFC 8785 canonical JSON, which writes every number as an IEEE 754 double
(RFC 8785 section 3.2.2.3); past 2**53 - 1 an integer has no exact double, so the ``rfc8785``
library refuses it (``IntegerDomainError``) and two different sizes could share one digest.
As a file size it is 8 PiB, far beyond any real artifact.
"""

LEGACY_CATALOG_REVISION = "legacy-v1"
"""The ``catalog_revision`` a schema-1 document gets when it does not name one."""

_ID_RE = re.compile(r"[A-Za-z0-9._-]+")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_COMMIT_RE = re.compile(r"[0-9a-f]{40}")
_HF_SOURCE_RE = re.compile(r"hf:[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_HF_REPO_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_ENV_REF_RE = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}")
_CONTROL_OR_SPACE_RE = re.compile(r"[\s\x00-\x1f\x7f]")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


ChatTemplate = Annotated[
    str,
    StringConstraints(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$"),
]
"""``embedded``, ``none``, or an engine's built-in template name (1-64 of a-z, 0-9, ., _, -)."""


class ArtifactFormat(StrEnum):
    """On-disk weight format of a variant."""

    SAFETENSORS = "safetensors"
    GGUF = "gguf"
    PICKLE = "pickle"


class EngineKind(StrEnum):
    """Inference engines a variant can be served by."""

    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMA_CPP = "llama_cpp"
    MISTRALRS = "mistralrs"


class Accelerator(StrEnum):
    """Kinds of device a worker computes on."""

    CPU = "cpu"
    METAL = "metal"
    CUDA = "cuda"


class Stability(StrEnum):
    """How far a variant is trusted: ``stable`` ones must pin an exact commit."""

    STABLE = "stable"
    PREVIEW = "preview"
    CONFIG_ONLY = "config_only"
    UNSUPPORTED = "unsupported"


class PullPolicy(StrEnum):
    """When the host fetches a model's weights (legacy manifest field ``pull``)."""

    ON_BOOT = "on_boot"
    ON_DEMAND = "on_demand"
    MANUAL = "manual"


# Extensions that count as the weights of each format; a variant must ship at least one.
FORMAT_EXTENSIONS: dict[ArtifactFormat, tuple[str, ...]] = {
    ArtifactFormat.SAFETENSORS: (".safetensors",),
    ArtifactFormat.GGUF: (".gguf",),
    ArtifactFormat.PICKLE: (".bin", ".pt", ".pth"),
}


def field_error(field: str, message: str) -> PydanticCustomError:
    """Build a validation error that the loader reports at ``<model path>.<field>``.

    Args:
        field: Dotted suffix below the model being validated, e.g. ``revision`` or
            ``files[2].path``.
        message: What is wrong and what is allowed.

    Returns:
        An error to ``raise`` from a model validator.
    """
    return PydanticCustomError("catalog_field", "{message}", {"field": field, "message": message})


def _check_schema_version(value: int) -> int:
    if value not in (1, 2):
        raise ValueError(f"{value} is not a catalog schema version; use 1 (legacy) or 2")
    return value


def _utf8_len(value: str) -> int:
    return len(value.encode("utf-8"))


def _check_identifier(value: str) -> str:
    if not value:
        raise ValueError("must not be empty")
    if _utf8_len(value) > MAX_ID_BYTES:
        raise ValueError(f"is {_utf8_len(value)} bytes; at most {MAX_ID_BYTES} are allowed")
    if not _ID_RE.fullmatch(value):
        raise ValueError(
            f"{value!r} may contain only letters, digits, '.', '_' and '-' (A-Z a-z 0-9 . _ -)"
        )
    return value


def _check_non_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be blank")
    return value


def _check_revision(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be blank; use a 40-hex commit, or a branch/tag for previews")
    if _utf8_len(value) > MAX_REVISION_BYTES:
        raise ValueError(f"is {_utf8_len(value)} bytes; at most {MAX_REVISION_BYTES} are allowed")
    if _CONTROL_OR_SPACE_RE.search(value):
        raise ValueError("must not contain whitespace or control characters")
    return value


def _check_catalog_revision(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be blank")
    if _utf8_len(value) > MAX_ID_BYTES:
        raise ValueError(f"is {_utf8_len(value)} bytes; at most {MAX_ID_BYTES} are allowed")
    if _CONTROL_OR_SPACE_RE.search(value):
        raise ValueError("must not contain whitespace or control characters")
    return value


def _check_sha256(value: str) -> str:
    if not _SHA256_RE.fullmatch(value):
        raise ValueError(f"{value!r} is not a SHA-256 digest; expected 64 lowercase hex characters")
    return value


def _check_source(value: str) -> str:
    if value.startswith("hf:"):
        if not _HF_SOURCE_RE.fullmatch(value):
            raise ValueError(f"{value!r} is not a Hugging Face source; expected hf:Org/Repo")
        return value
    if value.startswith("file:"):
        path = value.removeprefix("file:")
        if not path.startswith("/"):
            raise ValueError(f"{value!r} must name an absolute path, e.g. file:/models/qwen")
        if _CONTROL_RE.search(path):
            raise ValueError(f"{value!r} must not contain control characters")
        if ".." in path.split("/"):
            raise ValueError(f"{value!r} must not contain '..' components")
        return value
    raise ValueError(f"{value!r} has an unknown scheme; expected hf:Org/Repo or file:/abs/path")


def _check_relative_path(value: str) -> str:
    """A path inside an artifact: relative, '/'-separated, with no way to climb out of it."""
    if not value:
        raise ValueError("must not be empty")
    if value.startswith("/"):
        raise ValueError(f"{value!r} is absolute; file paths are relative to the artifact root")
    for bad, label in (("\\", "a backslash"), ("?", "'?'"), ("#", "'#'")):
        if bad in value:
            raise ValueError(f"{value!r} contains {label}; use plain '/'-separated names")
    if _CONTROL_RE.search(value):
        raise ValueError(f"{value!r} contains control characters")
    for part in value.split("/"):
        if part in ("", ".", ".."):
            raise ValueError(
                f"{value!r} has an empty, '.' or '..' component; "
                "paths must stay inside the artifact root"
            )
    return value


def _check_env_reference(value: str) -> str:
    if not _ENV_REF_RE.fullmatch(value):
        raise ValueError(
            "must be an environment reference of the form ${NAME} (e.g. ${HF_TOKEN}); "
            "never put a token itself in a catalog"
        )
    return value


def _check_digested_int(value: int) -> int:
    if value > MAX_DIGESTED_INT:
        raise ValueError(
            f"{value} is too large; at most {MAX_DIGESTED_INT} (2**53 - 1) is allowed, the "
            "largest integer the artifact digest's canonical JSON (RFC 8785) holds exactly"
        )
    return value


def _check_hf_repo(value: str) -> str:
    if not _HF_REPO_RE.fullmatch(value):
        raise ValueError(f"{value!r} is not a Hugging Face repository; expected Org/Repo")
    return value


def _count(minimum: int, maximum: int | None, noun: str) -> AfterValidator:
    """Bound a collection's length; runs after its items validated, so counts are exact."""

    def check(value: Sized) -> Sized:
        if len(value) < minimum:
            raise ValueError(f"must list at least {minimum} {noun}")
        if maximum is not None and len(value) > maximum:
            raise ValueError(f"lists {len(value)} {noun}s; at most {maximum} are allowed")
        return value

    return AfterValidator(check)


Identifier = Annotated[str, AfterValidator(_check_identifier)]
NonBlank = Annotated[str, AfterValidator(_check_non_blank)]
Revision = Annotated[str, AfterValidator(_check_revision)]
Sha256Hex = Annotated[str, AfterValidator(_check_sha256)]
Source = Annotated[str, AfterValidator(_check_source)]
RelativePath = Annotated[str, AfterValidator(_check_relative_path)]
EnvReference = Annotated[str, AfterValidator(_check_env_reference)]
CatalogRevision = Annotated[str, AfterValidator(_check_catalog_revision)]
HfRepo = Annotated[str, AfterValidator(_check_hf_repo)]
SchemaVersion = Annotated[int, AfterValidator(_check_schema_version)]
DigestedInt = Annotated[int, AfterValidator(_check_digested_int)]

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class ComputeCapability(BaseModel):
    """A CUDA compute capability, e.g. ``{major: 8, minor: 0}`` for sm_80."""

    model_config = _FROZEN

    major: int = Field(ge=0, strict=True, description="Major version (the 8 of 8.0).")
    minor: int = Field(ge=0, strict=True, description="Minor version (the 0 of 8.0).")

    def as_tuple(self) -> tuple[int, int]:
        """Return ``(major, minor)`` for ordering comparisons."""
        return (self.major, self.minor)

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"


class ArtifactFile(BaseModel):
    """One file of an artifact, pinned by digest and size."""

    model_config = _FROZEN

    path: RelativePath = Field(
        description="Path relative to the artifact root, '/'-separated, e.g. 'model.gguf'."
    )
    sha256: Sha256Hex = Field(description="Lowercase hex SHA-256 of the file's bytes (64 chars).")
    # Hashed into the artifact digest as canonical JSON: bounded to what RFC 8785 can write.
    size_bytes: DigestedInt = Field(
        gt=0,
        strict=True,
        description="Exact file size in bytes (at most 2**53 - 1, the RFC 8785 integer limit).",
    )


class VariantRequirements(BaseModel):
    """The hardware a variant needs on the worker that runs it."""

    model_config = _FROZEN

    accelerators: Annotated[tuple[Accelerator, ...], _count(1, None, "accelerator")] = Field(
        description="Device kinds this variant can run on (cpu, metal, cuda)."
    )
    min_compute_capability: ComputeCapability | None = Field(
        default=None,
        description="Lowest CUDA compute capability accepted; only checked on CUDA workers.",
    )
    min_memory_bytes: int = Field(
        ge=0, strict=True, description="Device memory the variant needs, in bytes."
    )


class ArtifactVariant(BaseModel):
    """One immutable, exactly pinned way to serve a logical model."""

    model_config = _FROZEN

    id: Identifier = Field(description="Variant id, unique within its model, e.g. 'q4_k_m'.")
    format: ArtifactFormat = Field(description="Weight format: safetensors, gguf or pickle.")
    quant: NonBlank = Field(description="Quantisation label, e.g. 'Q4_K_M' or 'BF16'.")
    engines: Annotated[tuple[EngineKind, ...], _count(1, MAX_ENGINES_PER_VARIANT, "engine")] = (
        Field(
            description="Engines that can serve this variant, most preferred first (1 to 16).",
        )
    )
    source: Source = Field(description="Where the files come from: hf:Org/Repo or file:/abs/path.")
    revision: Revision = Field(
        description=(
            "Source revision. A stable hf: variant must pin a 40-hex commit; previews may use a "
            "branch or tag, in which case the file digests alone pin the bytes."
        )
    )
    files: Annotated[tuple[ArtifactFile, ...], _count(1, None, "file")] = Field(
        description="Every file of the artifact, each pinned by SHA-256 and size."
    )
    requirements: VariantRequirements = Field(description="Hardware the variant needs.")
    stability: Stability = Field(description="stable, preview, config_only or unsupported.")
    certification: NonBlank = Field(
        description="Label of the certification run that checked this variant."
    )
    chat_template: ChatTemplate = Field(
        default="embedded",
        description=(
            "How chat requests are turned into a prompt: 'embedded' (the weights carry a chat "
            "template the engine uses), a template name the engine knows (llama.cpp's "
            "--chat-template, e.g. 'chatml'), or 'none' for a completion-only (base) model, "
            "whose chat requests are refused with chat_not_supported."
        ),
    )

    @property
    def can_chat(self) -> bool:
        """Whether chat completions have a known template (see ``chat_template``)."""
        return self.chat_template != "none"

    @model_validator(mode="after")
    def _check_cross_field_rules(self) -> ArtifactVariant:
        if (
            self.stability is Stability.STABLE
            and self.source.startswith("hf:")
            and not _COMMIT_RE.fullmatch(self.revision)
        ):
            raise field_error(
                "revision",
                f"{self.revision!r} is not a commit; a stable hf: variant must pin a "
                "40-character lowercase hex commit (or be marked stability: preview)",
            )
        seen: dict[str, int] = {}
        for index, item in enumerate(self.files):
            if item.path in seen:
                raise field_error(
                    f"files[{index}].path",
                    f"{item.path!r} is listed twice (first at files[{seen[item.path]}])",
                )
            seen[item.path] = index
        extensions = FORMAT_EXTENSIONS[self.format]
        if not any(item.path.endswith(extensions) for item in self.files):
            raise field_error(
                "files",
                f"no file ends in {' or '.join(extensions)}, "
                f"which a {self.format.value} variant needs for its weights",
            )
        return self

    @property
    def total_size_bytes(self) -> int:
        """Sum of the sizes of every file, in bytes."""
        return sum(item.size_bytes for item in self.files)


class CatalogEntry(BaseModel):
    """One logical model: descriptive fields, v2 variants, and legacy v1/manifest fields."""

    model_config = _FROZEN

    params: NonBlank = Field(description="Parameter count as people write it, e.g. '8B'.")
    license: NonBlank = Field(description="License identifier, e.g. 'apache-2.0'.")
    family: NonBlank = Field(description="Model family, e.g. 'qwen3'.")
    modality: Identifier = Field(default="chat", description="What the model serves, e.g. chat.")
    context_length: int | None = Field(
        default=None,
        gt=0,
        strict=True,
        description="Longest context in tokens; required when the entry has variants.",
    )
    variants: Annotated[
        tuple[ArtifactVariant, ...], _count(0, MAX_VARIANTS_PER_MODEL, "variant")
    ] = Field(
        default=(),
        description="Artifact variants in preference order (at most 128, unique ids).",
    )
    allow_pickle: bool = Field(
        default=False,
        strict=True,
        description="Allow pickle variants; off by default because unpickling can run code.",
    )
    # Legacy v1 fields: an entry without variants still describes the model, but cannot
    # resolve to an exact artifact (it is "preview-incomplete").
    hf_repo: HfRepo | None = Field(
        default=None, description="Legacy v1: Hugging Face repository, e.g. 'Qwen/Qwen3-8B'."
    )
    quants: tuple[NonBlank, ...] = Field(
        default=(), description="Legacy v1: quantisations published, most preferred first."
    )
    min_vram_hint_gib: float | None = Field(
        default=None, ge=0, description="Legacy v1: coarse memory hint in GiB."
    )
    # Legacy manifest fields.
    source: Source | None = Field(
        default=None, description="Manifest: weight source, hf:Org/Repo or file:/abs/path."
    )
    revision: Revision | None = Field(default=None, description="Manifest: source revision.")
    sha256: dict[RelativePath, Sha256Hex] = Field(
        default_factory=dict, description="Manifest: file path -> lowercase hex SHA-256."
    )
    hf_token: EnvReference | None = Field(
        default=None,
        description="Manifest: Hugging Face token as an environment reference, '${NAME}'.",
    )
    engine: EngineKind | None = Field(default=None, description="Manifest: preferred engine.")
    pull: PullPolicy = Field(
        default=PullPolicy.ON_DEMAND, description="Manifest: when to fetch the weights."
    )

    @model_validator(mode="after")
    def _check_cross_field_rules(self) -> CatalogEntry:
        seen: dict[str, int] = {}
        for index, variant in enumerate(self.variants):
            if variant.id in seen:
                raise field_error(
                    f"variants[{index}].id",
                    f"{variant.id!r} is declared twice (first at variants[{seen[variant.id]}]); "
                    "variant ids must be unique within a model",
                )
            seen[variant.id] = index
        if self.variants and self.context_length is None:
            raise field_error(
                "context_length", "is required (a positive token count) when variants exist"
            )
        if not self.variants and (self.hf_repo is None or not self.quants):
            raise field_error(
                "variants",
                "an entry needs catalog v2 variants, or at least the legacy hf_repo and quants",
            )
        return self

    @property
    def is_preview_incomplete(self) -> bool:
        """True for a legacy entry that has no v2 variants and so cannot resolve an artifact."""
        return not self.variants

    def variant(self, variant_id: str) -> ArtifactVariant | None:
        """Return the variant called ``variant_id``, or ``None``."""
        return next((v for v in self.variants if v.id == variant_id), None)

    def unknown_variant_message(self, model_id: str, variant_id: str) -> str:
        """``model 'm' has no variant 'v' (available: a, b)``, ids sorted."""
        available = ", ".join(sorted(v.id for v in self.variants)) or "none"
        return f"model '{model_id}' has no variant '{variant_id}' (available: {available})"

    def listed_quants(self) -> tuple[str, ...]:
        """Quantisations this entry offers: its variants' quants, else the legacy list."""
        if self.variants:
            return tuple(dict.fromkeys(v.quant for v in self.variants))
        return self.quants


class Catalog(BaseModel):
    """A whole catalog file.

    ``schema_version`` 1 (the default) is the legacy format; its ``catalog_revision``
    defaults to ``legacy-v1``. Version 2 requires a non-blank ``catalog_revision``, which is
    pinned into every artifact digest.
    """

    model_config = _FROZEN

    schema_version: SchemaVersion = Field(
        default=1, strict=True, description="Catalog format: 1 (legacy) or 2 (artifact variants)."
    )
    catalog_revision: CatalogRevision = Field(
        default=LEGACY_CATALOG_REVISION,
        description="Identity of this catalog's content, pinned into artifact digests.",
    )
    models: Annotated[dict[Identifier, CatalogEntry], _count(0, MAX_MODELS, "model")] = Field(
        default_factory=dict,
        description="Logical model id -> entry (at most 1024).",
    )

    @model_validator(mode="before")
    @classmethod
    def _require_revision_for_v2(cls, data: object) -> object:
        if (
            isinstance(data, dict)
            and data.get("schema_version") == 2
            and data.get("catalog_revision") is None
        ):
            raise field_error(
                "catalog_revision", "is required for schema_version 2 (e.g. 'acme-2026-07-01')"
            )
        return data

    @model_validator(mode="after")
    def _variants_need_v2(self) -> Catalog:
        if self.schema_version == 1:
            for model_id, entry in self.models.items():
                if entry.variants:
                    raise field_error(
                        f"models.{model_id}.variants",
                        "artifact variants need schema_version: 2 at the top of the catalog",
                    )
        return self

    def entry(self, model_id: str) -> CatalogEntry:
        """Return the entry for ``model_id``.

        Raises:
            CatalogError: code ``unknown_catalog_model`` if the catalog has no such model.
        """
        found = self.models.get(model_id)
        if found is None:
            raise CatalogError(
                f"'{model_id}' is not in the catalog.",
                code="unknown_catalog_model",
                remediation="Run `sbproxy models list` to see the ids it has.",
                details={"model": model_id, "catalog_revision": self.catalog_revision},
            )
        return found

    def check_reference(
        self, model_id: str, variant_id: str | None = None
    ) -> tuple[Literal["model", "variant"], str] | None:
        """Say what is wrong with a deployment's ``model``/``variant`` reference, if anything.

        For config validation: it checks only that the names exist, not that they fit a
        worker (that is :func:`sbproxy.catalog.resolve_artifact`'s job).

        Returns:
            ``None`` when the model (and the variant, if given) exist; otherwise the field
            at fault and a message: ``("model", "model 'x' is not in the catalog (revision
            r)")`` or ``("variant", "model 'x' has no variant 'y' (available: a, b)")``.
        """
        found = self.models.get(model_id)
        if found is None:
            return (
                "model",
                f"model '{model_id}' is not in the catalog (revision {self.catalog_revision}); "
                "`sbproxy models list` shows the ids it has",
            )
        if variant_id is not None and found.variant(variant_id) is None:
            return ("variant", found.unknown_variant_message(model_id, variant_id))
        return None
