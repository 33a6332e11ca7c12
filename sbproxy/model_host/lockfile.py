"""The model lockfile: the exact artifacts a configuration resolves to, written down.

``sbproxy models lock`` records, for every configured deployment, which catalog artifact it
resolves to (digest, source, revision, every file's SHA-256 and size) and which engine
serves it. ``sbproxy models verify-lock`` and ``sbproxy serve --locked`` compare the lock
with what the configuration and catalog resolve to now and with what the cache holds, so a
catalog pin or a config change that would serve other bytes is caught before it is served.

The file (reference 1.8; ``schema_version`` 1)::

    {"schema_version": 1, "generated_at_ms": 1767225600000, "catalog_revision": "...",
     "models": [{"name": "qwen3-8b", "variant_id": "q4_k_m", "artifact_digest": "<64 hex>",
                 "source": "hf:Org/Repo", "revision": "<commit>",
                 "files": [{"path": "...", "sha256": "<64 hex>", "size_bytes": 123}],
                 "engine": {"kind": "llama_cpp", "version": "b9905"}}]}

``name`` is the catalog model id; models are sorted by (``name``, ``variant_id``) and appear
once each however many deployments share them. ``engine.version`` and ``engine.image`` come
from ``proxy.model_host.engines.<kind>`` and are left out when the config does not pin them.
Nothing in the file is a credential: sources are ``hf:Org/Repo`` or ``file:/abs/path`` as the
catalog pins them, and tokens (``HF_TOKEN``, a catalog's ``hf_token``) are never read here.

Errors are :class:`LockfileError` with codes ``lockfile_not_found``, ``invalid_lockfile``
(bad input) and ``lockfile_write_failed`` (an I/O failure while writing).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Final, Literal

import anyio.to_thread
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    model_validator,
)

from sbproxy.catalog import (
    MAX_DIGESTED_INT,
    Catalog,
    EngineKind,
    ResolvedArtifact,
    pinned_artifact,
)
from sbproxy.config import CompiledConfig
from sbproxy.errors import CatalogError, ResolutionError, SbproxyError
from sbproxy.model_host.artifacts import ArtifactCache
from sbproxy.model_host.artifacts.cache import CacheState, fsync_dir
from sbproxy.model_host.artifacts.errors import CacheCorrupt
from sbproxy.model_host.service import ModelHostService, Selection

__all__ = [
    "DEFAULT_LOCKFILE_NAME",
    "LOCK_SCHEMA_VERSION",
    "LockCheck",
    "LockReport",
    "LockStatus",
    "LockedEngine",
    "LockedFile",
    "LockedModel",
    "Lockfile",
    "LockfileError",
    "build_lock",
    "default_lock_path",
    "lock_guard",
    "read_lock",
    "verify_lock",
    "write_lock",
]

LOCK_SCHEMA_VERSION: Final = 1
DEFAULT_LOCKFILE_NAME = "sbproxy-models.lock"

Hex64 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
NonEmpty = Annotated[str, StringConstraints(min_length=1)]

_STRICT = ConfigDict(frozen=True, extra="forbid", strict=True)


class LockfileError(SbproxyError):
    """A lockfile that cannot be read, is not a valid lockfile, or cannot be written.

    Codes: ``lockfile_not_found``, ``invalid_lockfile`` (default) and
    ``lockfile_write_failed``. ``details`` carries ``path`` and, for a bad field, ``field``
    (dotted, e.g. ``models.0.artifact_digest``).
    """

    default_code = "invalid_lockfile"


# --- the file -------------------------------------------------------------------------------


class LockedFile(BaseModel):
    """One file of a locked artifact, as the catalog pins it."""

    model_config = _STRICT

    path: NonEmpty = Field(description="Path relative to the artifact's snapshot.")
    sha256: Hex64 = Field(description="Lowercase hex SHA-256 of the file's bytes.")
    size_bytes: int = Field(
        ge=0, le=MAX_DIGESTED_INT, description="Exact size in bytes (as the catalog bounds it)."
    )


class LockedEngine(BaseModel):
    """The engine that serves a locked artifact."""

    model_config = _STRICT

    kind: EngineKind = Field(description="Engine kind, e.g. llama_cpp or vllm.")
    version: NonEmpty | None = Field(
        default=None, description="Release tag or package version the config pins, if any."
    )
    image: NonEmpty | None = Field(
        default=None, description="Container image <repo>@sha256:<digest> the config pins."
    )


class LockedModel(BaseModel):
    """One locked artifact."""

    model_config = _STRICT

    name: NonEmpty = Field(description="Catalog model id.")
    variant_id: NonEmpty = Field(description="Catalog variant id.")
    artifact_digest: Hex64 = Field(description="Artifact digest (64 lowercase hex).")
    source: NonEmpty = Field(description="hf:Org/Repo or file:/abs/path.")
    revision: NonEmpty = Field(description="Source revision.")
    files: tuple[LockedFile, ...] = Field(description="Every file, in catalog order.")
    engine: LockedEngine = Field(description="The engine that serves it.")


class Lockfile(BaseModel):
    """The whole lockfile (see the module docstring for its shape)."""

    model_config = _STRICT

    schema_version: Literal[1] = Field(description="Lockfile format version; always 1.")
    generated_at_ms: int = Field(
        ge=0, le=2**63 - 1, description="When it was written, ms since the epoch."
    )
    catalog_revision: NonEmpty = Field(description="Revision of the catalog it was made from.")
    models: tuple[LockedModel, ...] = Field(description="Locked artifacts by (name, variant_id).")

    @model_validator(mode="after")
    def _one_entry_per_variant(self) -> Lockfile:
        seen: set[tuple[str, str]] = set()
        for index, model in enumerate(self.models):
            key = (model.name, model.variant_id)
            if key in seen:
                raise ValueError(
                    f"models.{index}: {model.name}:{model.variant_id} is listed more than once"
                )
            seen.add(key)
        return self

    def to_json(self) -> str:
        """The file's text: pretty JSON, unset engine fields left out, newline-terminated."""
        return json.dumps(self.model_dump(mode="json", exclude_none=True), indent=2) + "\n"


def default_lock_path(config_path: Path | None) -> Path:
    """``sbproxy-models.lock`` next to ``config_path``, else in the working directory."""
    directory = config_path.absolute().parent if config_path is not None else Path.cwd()
    return directory / DEFAULT_LOCKFILE_NAME


# --- lock -----------------------------------------------------------------------------------


def _engine_of(config: CompiledConfig | None, kind: EngineKind) -> LockedEngine:
    host = config.model_host if config is not None else None
    pinned = getattr(host.engines, kind.value, None) if host is not None else None
    if pinned is None:
        return LockedEngine(kind=kind)
    return LockedEngine(kind=kind, version=pinned.version, image=pinned.image)


def _locked(artifact: ResolvedArtifact, engine: LockedEngine) -> LockedModel:
    return LockedModel(
        name=artifact.logical_model,
        variant_id=artifact.variant_id,
        artifact_digest=artifact.digest,
        source=artifact.source,
        revision=artifact.revision,
        files=tuple(
            LockedFile(path=f.path, sha256=f.sha256, size_bytes=f.size_bytes)
            for f in artifact.files
        ),
        engine=engine,
    )


def build_lock(service: ModelHostService, *, generated_at_ms: int | None = None) -> Lockfile:
    """Lock every configured deployment of ``service.config`` as it resolves on this worker.

    Deployments that share a (model, variant) are locked once, with the engine of the
    first by deployment id.

    Args:
        service: An open service whose ``config`` declares ``proxy.model_host``.
        generated_at_ms: The timestamp to record (default: now).

    Raises:
        SbproxyError: ``no_model_host`` when the service has no config with a model host.
        ResolutionError: a deployment's model or variant is unknown, or nothing fits here.
        CatalogError: ``unknown_catalog_model``.
    """
    config = service.config
    if config is None or config.model_host is None:
        raise SbproxyError(
            "the configuration declares no proxy.model_host (and no serve: entries), so "
            "there is nothing to lock.",
            code="no_model_host",
            remediation="Add deployments under proxy.model_host, then lock again.",
        )
    chosen: dict[tuple[str, str], LockedModel] = {}
    for deployment_id in sorted(config.deployments):
        artifact = service.deployment_selection(deployment_id).artifact
        key = (artifact.logical_model, artifact.variant_id)
        if key not in chosen:
            chosen[key] = _locked(artifact, _engine_of(config, artifact.engine))
    return Lockfile(
        schema_version=LOCK_SCHEMA_VERSION,
        generated_at_ms=(
            time.time_ns() // 1_000_000 if generated_at_ms is None else generated_at_ms
        ),
        catalog_revision=service.catalog.catalog_revision,
        models=tuple(chosen[key] for key in sorted(chosen)),
    )


def write_lock(lock: Lockfile, path: Path) -> None:
    """Write ``lock`` to ``path`` atomically.

    The text goes to a temporary file in the same directory, is ``fsync``-ed and renamed
    over ``path``, then the directory is ``fsync``-ed: a reader sees the old file or the new
    one, never a torn one, and a crash leaves no partial lockfile. The directory must exist.

    Raises:
        LockfileError: ``lockfile_write_failed`` (nothing at ``path`` changed).
    """
    directory = path.parent
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise LockfileError(
            f"cannot write lockfile {path}: it exists and is not a regular file.",
            code="lockfile_write_failed",
            remediation="Pass --out with a regular file path (links and devices are refused).",
            details={"path": str(path)},
        )
    try:
        handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise _write_failed(path, exc) from exc
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(lock.to_json().encode("utf-8"))
            out.flush()
            os.fsync(out.fileno())
        # mkstemp creates 0600; a lockfile is meant to be read (and committed) by others.
        Path(temporary).chmod(0o644)
        Path(temporary).replace(path)
        fsync_dir(directory)
    except OSError as exc:
        Path(temporary).unlink(missing_ok=True)
        raise _write_failed(path, exc) from exc
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _write_failed(path: Path, exc: OSError) -> LockfileError:
    return LockfileError(
        f"cannot write lockfile {path}: {exc.strerror or exc}.",
        code="lockfile_write_failed",
        remediation="Check that the directory exists and is writable, or pass --out.",
        details={"path": str(path)},
    )


# --- read -----------------------------------------------------------------------------------


def read_lock(path: Path) -> Lockfile:
    """Read and validate the lockfile at ``path``.

    Raises:
        LockfileError: ``lockfile_not_found`` when there is no such file;
            ``invalid_lockfile`` when it is unreadable, not JSON, not ``schema_version`` 1,
            or a field is missing or malformed (the message names the dotted field).
    """
    if path.exists() and not path.is_file():
        # A FIFO would block the read for ever, a device could stream without end.
        raise _invalid(path, None, "is not a regular file")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise LockfileError(
            f"lockfile {path} does not exist.",
            code="lockfile_not_found",
            remediation="Write one with `sbproxy models lock -f sb.yml`, or pass --lockfile.",
            details={"path": str(path)},
        ) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise _invalid(path, None, f"cannot be read ({exc})") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _invalid(
            path, None, f"is not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from exc
    except RecursionError:
        raise _invalid(path, None, "nests JSON too deeply to be a lockfile") from None
    if not isinstance(data, dict):
        raise _invalid(path, None, "is not a JSON object")
    version = data.get("schema_version")
    if version != LOCK_SCHEMA_VERSION or isinstance(version, bool):
        raise _invalid(
            path,
            "schema_version",
            f"has schema_version {json.dumps(version)}; this sbproxy reads schema_version "
            f"{LOCK_SCHEMA_VERSION}",
        )
    try:
        return Lockfile.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or None
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc']) or '(top level)'}: {error['msg']}"
            for error in exc.errors()[:5]
        )
        raise _invalid(path, field, f"is not a valid lockfile: {problems}") from None


def _invalid(path: Path, field: str | None, problem: str) -> LockfileError:
    details: dict[str, str | None] = {"path": str(path)}
    if field is not None:
        details["field"] = field
    return LockfileError(
        f"lockfile {path} {problem}.",
        code="invalid_lockfile",
        remediation="Regenerate it with `sbproxy models lock -f sb.yml`.",
        details=details,
    )


# --- verify ---------------------------------------------------------------------------------


class LockStatus(StrEnum):
    """How one model compares with the lock.

    ``ok``: resolves to the locked digest, the entry and engine match, and the artifact is
    published and re-verified (size and BLAKE3). ``missing``: the locked digest still holds
    but the cache lacks it (or holds only part of it, or a damaged copy).
    ``digest_mismatch``: the config and catalog now resolve to other bytes (or to nothing),
    the configured engine pin changed, or the entry's files, source, revision or catalog
    revision do not match its digest (an edited lockfile). ``unlocked``: a configured
    deployment resolves to an artifact the lock does not list. Every status but ``ok`` is
    drift.
    """

    OK = "ok"
    MISSING = "missing"
    DIGEST_MISMATCH = "digest_mismatch"
    UNLOCKED = "unlocked"


@dataclass(frozen=True)
class LockCheck:
    """One row of a verification.

    Attributes:
        name: Catalog model id.
        variant: Variant id (the locked one; for ``unlocked``, the one resolved now).
        artifact_digest: The locked digest; for ``unlocked``, the digest resolved now
            (``None`` when the deployment does not resolve at all).
        status: See :class:`LockStatus`.
        detail: One sentence for people saying why.
    """

    name: str
    variant: str
    artifact_digest: str | None
    status: LockStatus
    detail: str

    def to_dict(self) -> dict[str, object]:
        """``{name, variant, artifact_digest, status, detail}`` for JSON output."""
        return {
            "name": self.name,
            "variant": self.variant,
            "artifact_digest": self.artifact_digest,
            "status": self.status.value,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class LockReport:
    """The outcome of :func:`verify_lock`: one check per model, sorted by (name, variant)."""

    checks: tuple[LockCheck, ...]

    @property
    def drift(self) -> bool:
        """Whether any model is not ``ok``."""
        return any(check.status is not LockStatus.OK for check in self.checks)

    @property
    def drifted(self) -> tuple[LockCheck, ...]:
        """The checks that are not ``ok``."""
        return tuple(check for check in self.checks if check.status is not LockStatus.OK)


@dataclass(frozen=True)
class _Current:
    """What the configured deployments of one model resolve to now."""

    deployments: list[str]
    selection: Selection


def _configured_now(
    service: ModelHostService, config: CompiledConfig
) -> tuple[dict[tuple[str, str], _Current], dict[str, list[tuple[str, SbproxyError]]]]:
    """Resolved (model, variant) -> deployments, and model -> deployments that fail to resolve."""
    resolved: dict[tuple[str, str], _Current] = {}
    failed: dict[str, list[tuple[str, SbproxyError]]] = {}
    for deployment_id in sorted(config.deployments):
        model = config.deployments[deployment_id].model
        try:
            selection = service.deployment_selection(deployment_id)
        except (ResolutionError, CatalogError) as exc:
            failed.setdefault(model, []).append((deployment_id, exc))
            continue
        key = (model, selection.artifact.variant_id)
        if key in resolved:
            resolved[key].deployments.append(deployment_id)
        else:
            resolved[key] = _Current(deployments=[deployment_id], selection=selection)
    return resolved, failed


def _in_catalog(catalog: Catalog, locked: LockedModel) -> ResolvedArtifact | str:
    """The artifact the catalog pins for a locked (name, variant) now, or why there is none."""
    entry = catalog.models.get(locked.name)
    if entry is None:
        return f"catalog {catalog.catalog_revision} no longer has model {locked.name}"
    variant = entry.variant(locked.variant_id)
    if variant is None:
        return f"catalog {catalog.catalog_revision} no longer has variant {locked.variant_id}"
    return pinned_artifact(catalog, locked.name, entry, variant, engine=locked.engine.kind)


def _cache_check(
    cache: ArtifactCache, locked: LockedModel, artifact: ResolvedArtifact
) -> LockCheck:
    """``ok`` or ``missing`` for an artifact whose digest matches the lock."""
    state = cache.lookup(artifact)
    label = f"sha256:{artifact.digest}"
    if state.kind == "ready" and state.metadata is not None:
        try:
            cache.verify(state.metadata)  # size and BLAKE3 of every file, as a cache hit does
        except CacheCorrupt as exc:
            state = CacheState("corrupt", reason=exc.message)
    if state.kind == "ready":
        status, detail = LockStatus.OK, f"{label} is published in the cache and verified"
    elif state.kind == "partial":
        status = LockStatus.MISSING
        detail = (
            f"{label} is only partly downloaded ({state.partial_bytes} of "
            f"{artifact.total_size_bytes} bytes); run `sbproxy models pull` to finish it"
        )
    elif state.kind == "corrupt":
        status = LockStatus.MISSING
        detail = f"{label} is in the cache but unusable ({state.reason}); remove and pull it again"
    else:
        status = LockStatus.MISSING
        detail = f"{label} is not in the cache at {cache.layout.root}; run `sbproxy models pull`"
    return LockCheck(locked.name, locked.variant_id, locked.artifact_digest, status, detail)


def _mismatch(locked: LockedModel, detail: str) -> LockCheck:
    return LockCheck(
        locked.name, locked.variant_id, locked.artifact_digest, LockStatus.DIGEST_MISMATCH, detail
    )


def _compare(
    cache: ArtifactCache,
    lock: Lockfile,
    locked: LockedModel,
    artifact: ResolvedArtifact,
    engine: LockedEngine | None,
) -> LockCheck:
    """Digest, then the entry's own fields and engine, then the cache.

    The digest alone is not enough: a hand-edited entry (other files, source or revision
    under the same digest) would pass, so the entry must equal what the artifact locks to.
    ``engine`` is what the configuration pins now (``None`` without a configuration).
    """
    if artifact.digest != locked.artifact_digest:
        return _mismatch(
            locked,
            f"locked sha256:{locked.artifact_digest} but catalog {artifact.catalog_revision} "
            f"now pins sha256:{artifact.digest}",
        )
    expected = _locked(artifact, engine or locked.engine)
    edited = [
        name
        for name in ("source", "revision", "files")
        if getattr(expected, name) != getattr(locked, name)
    ]
    if lock.catalog_revision != artifact.catalog_revision:
        edited.append("catalog_revision")
    if edited:
        return _mismatch(
            locked,
            f"the lockfile's {', '.join(edited)} for sha256:{locked.artifact_digest} do not "
            "match what that digest pins (was the lockfile edited?); regenerate it with "
            "`sbproxy models lock`",
        )
    if expected.engine != locked.engine:
        return _mismatch(
            locked,
            f"the engine changed: locked {_engine_text(locked.engine)}, the configuration now "
            f"pins {_engine_text(expected.engine)}",
        )
    return _cache_check(cache, locked, artifact)


def _engine_text(engine: LockedEngine) -> str:
    pins = [f"version {engine.version}"] if engine.version else []
    pins += [f"image {engine.image}"] if engine.image else []
    return f"{engine.kind.value} ({', '.join(pins) or 'no version pin'})"


def _names(deployments: Sequence[str]) -> str:
    return ", ".join(deployments)


def verify_lock(lock: Lockfile, service: ModelHostService) -> LockReport:
    """Compare ``lock`` with what ``service`` resolves now and with its cache.

    With a configuration (``service.config``), each locked (name, variant) is compared with
    what the configured deployments resolve to on this worker: a locked model no
    deployment resolves to any more (its variant changed, it fails to resolve, or it was
    removed) is ``digest_mismatch``, and a resolved one the lock lacks is ``unlocked``.
    Without one, each locked (name, variant) is looked up in the catalog directly. A
    matching digest is then ``ok`` or ``missing`` by the cache.

    Returns:
        One :class:`LockCheck` per locked model and per unlocked configured artifact,
        sorted by (name, variant). Never raises for drift; a deployment that fails to
        resolve is reported, not raised.
    """
    cache = service.cache
    config = service.config
    checks: list[LockCheck] = []
    if config is None:
        for locked in lock.models:
            found = _in_catalog(service.catalog, locked)
            checks.append(
                _mismatch(locked, found)
                if isinstance(found, str)
                else _compare(cache, lock, locked, found, None)
            )
    else:
        resolved, failed = _configured_now(service, config)
        locked_keys = {(m.name, m.variant_id) for m in lock.models}
        explained: set[tuple[str, str]] = set()
        for locked in lock.models:
            current = resolved.get((locked.name, locked.variant_id))
            if current is not None:
                artifact = current.selection.artifact
                engine = _engine_of(config, artifact.engine)
                checks.append(_compare(cache, lock, locked, artifact, engine))
                continue
            moved = {
                other: found
                for other, found in resolved.items()
                if other[0] == locked.name and other not in locked_keys
            }
            explained.update(moved)
            checks.append(_mismatch(locked, _why_gone(moved, failed.get(locked.name, []))))
        checks.extend(_unlocked(config, resolved, failed, locked_keys | explained, lock))
    return LockReport(checks=tuple(sorted(checks, key=lambda c: (c.name, c.variant))))


def _why_gone(
    moved: dict[tuple[str, str], _Current], failures: list[tuple[str, SbproxyError]]
) -> str:
    """Why no configured deployment resolves to a locked (name, variant) any more."""
    if moved:
        now = "; ".join(
            f"deployment {_names(found.deployments)} resolves to variant {other[1]} "
            f"(sha256:{found.selection.artifact.digest})"
            for other, found in sorted(moved.items())
        )
        return f"the lock has this variant but {now}"
    if failures:
        problems = "; ".join(f"deployment {d}: {error.message}" for d, error in failures)
        return f"no longer resolves: {problems}"
    return "no configured deployment resolves to it any more"


def _unlocked(
    config: CompiledConfig,
    resolved: dict[tuple[str, str], _Current],
    failed: dict[str, list[tuple[str, SbproxyError]]],
    accounted: set[tuple[str, str]],
    lock: Lockfile,
) -> list[LockCheck]:
    """Configured artifacts the lock does not account for (resolved or not)."""
    checks = [
        LockCheck(
            key[0],
            key[1],
            current.selection.artifact.digest,
            LockStatus.UNLOCKED,
            f"deployment {_names(current.deployments)} resolves to it but the lockfile "
            "does not list it; run `sbproxy models lock` to add it",
        )
        for key, current in sorted(resolved.items())
        if key not in accounted
    ]
    locked_names = {m.name for m in lock.models}
    checks.extend(
        LockCheck(
            model,
            config.deployments[deployment_id].variant or "auto",
            None,
            LockStatus.UNLOCKED,
            f"deployment {deployment_id} is not in the lockfile and does not resolve: "
            f"{error.message}",
        )
        for model, failures in sorted(failed.items())
        if model not in locked_names
        for deployment_id, error in failures
    )
    return checks


def lock_guard(
    path: Path, service: ModelHostService
) -> Callable[[CompiledConfig], Awaitable[None]]:
    """A reload guard for ``serve --locked``: a configuration that drifts from the lock is refused.

    ``service`` is the serving host's facade (its cache root and journal); each candidate is
    checked under its own catalog (:meth:`ModelHostService.with_config`).

    The lock holds for the server's whole life, not only at start: every file reload
    (``SIGHUP``, the watcher, ``POST /admin/reload``, ``sbproxy apply``) first verifies the
    candidate file against the lockfile at ``path``, as ``verify-lock`` would (which includes
    re-verifying the cached artifacts' sizes and BLAKE3 fingerprints).

    Raises (from the guard):
        SbproxyError: ``lock_drift`` naming each drifted model; a lockfile that became
            unreadable raises its own ``LockfileError``.
    """

    def check(candidate: CompiledConfig) -> LockReport:
        return verify_lock(read_lock(path), service.with_config(candidate))

    async def guard(candidate: CompiledConfig) -> None:
        report = await anyio.to_thread.run_sync(check, candidate)
        if report.drift:
            drifted = "; ".join(
                f"{c.name}:{c.variant} {c.status.value} ({c.detail})" for c in report.drifted
            )
            raise SbproxyError(
                f"the configuration drifts from the lockfile {path}, and this server runs "
                f"--locked: {drifted}",
                code="lock_drift",
                remediation="Review the change and rewrite the lock with `sbproxy models lock "
                "-f sb.yml`, pull what is missing, or restart without --locked.",
            )

    return guard
