"""Desired-state routes: ``GET|PUT /admin/model-host/deployments`` and ``POST /admin/reload``.

Both mutations run the reload transaction (``model_host/runtime/reload.py``) and answer when
it ends: 200 ``{schema_version: 1, revision, content_digest, plan: {added, changed, removed,
preserved}, job_id}``.

``PUT /admin/model-host/deployments`` (``admin_managed`` only) replaces the whole map: body
``{expected_revision: null | int, deployments: {id: deployment}}``, unknown fields and
duplicate keys refused. Errors (body ``{code, error, ...}``): 403 ``authority_read_only``;
400 ``invalid_body`` / ``invalid_desired`` (with the dotted ``path``) /
``unknown_catalog_model`` / ``unknown_catalog_variant``; 409 ``revision_conflict`` (with
``expected_revision`` and ``actual_revision``); 422 when the candidate cannot be prepared
(``prepare_failed``, ``insufficient_capacity``, ``crash_loop``, ``manual_artifact_missing``,
...; the store is unchanged); 502 ``runtime_commit_failed`` with
``durable_state_advanced: true``, ``revision`` and ``content_digest`` when the store moved
but the runtime could not commit (the next start converges to the store).

``POST /admin/reload`` re-reads the configuration file the server started from (an optional
body ``{"source": path}`` must name that file: 409 ``source_mismatch`` otherwise, which is
how ``sbproxy apply -f`` makes sure it reloads what it validated). 400 ``invalid_config``
lists the file's problems with their dotted paths; 409 ``restart_required`` /
``foundation_change``; 422 as above. Nothing changes on any failure.

On a ``cluster_authority`` host the deployments are the fleet's, not the host's: the
reload compare-and-sets them as the fleet's next revision (when they changed) and answers
``fleet`` (:func:`fleet_change`: the revision this write committed -- never one read
afterwards, which may be another writer's -- and the deployments added, removed and
changed, with replica counts). There the body may carry the desired-state document,
``{"source": path, "deployments": {id: deployment}}`` (what ``sbproxy apply -f`` sends for
a file that declares ``authority: cluster_authority``): its deployments become the fleet's
next revision through any member, whatever file that member serves; only when ``source``
is the member's own file does the member also reload its own settings (routes, keys) from
it. Without ``deployments``, a ``source`` other than the served file is ``source_mismatch``
as on a single host (where the refusal keeps a reload from applying a file nobody
validated).

Every attempt is recorded in the host's :class:`~sbproxy.api.config_state.ConfigState`
(``GET /admin/model-host/status``'s ``config.last_reload``): a reload with a body naming the
file -- what ``sbproxy apply`` sends -- as source ``apply``, one without as ``admin``, a
``PUT`` as ``admin_put``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import anyio.to_thread
from litestar import Request, Response, get, post, put
from litestar.handlers import HTTPRouteHandler
from pydantic import TypeAdapter, ValidationError

from sbproxy.api.config_state import ConfigState, ReloadSource
from sbproxy.api.errors import InvalidBody, admin_error, status_for
from sbproxy.config import CompiledConfig, DeploymentConfig, load_config
from sbproxy.config._rules import Identifier
from sbproxy.config.model_host import Authority
from sbproxy.errors import ConfigError, SbproxyError
from sbproxy.fleet.routing import replica_id_clashes
from sbproxy.model_host.runtime.desired_store import MAX_REVISION, DeploymentRevision, RevisionStore
from sbproxy.model_host.runtime.manager import RuntimeManager, desired_digest, desired_of
from sbproxy.model_host.runtime.reload import (
    ReloadReport,
    refuse_restart_changes,
    reload,
    reload_from_source,
    revision_store,
    with_deployments,
)
from sbproxy.model_host.service import ModelHostService
from sbproxy.workflows.faults import fault_point

__all__ = ["desired_handlers", "fleet_change"]

# Failures to prepare a candidate are the caller's to fix (422), whatever status the same
# code has on the gateway (where insufficient capacity or a crash loop is a 503).
_PREPARE: Final[frozenset[str]] = frozenset(
    {
        "prepare_failed",
        "insufficient_capacity",
        "crash_loop",
        "engine_early_exit",
        "engine_not_ready",
        "engine_blocked",
        "engine_incompatible",
        "engine_not_found",
        "artifact_not_ready",
        "manual_artifact_missing",
        "offline_artifact_missing",
        "digest_mismatch",
        "no_compatible_variant",
        "unsafe_argument",
    }
)
_STATUS: Final[dict[str, int]] = {
    "authority_read_only": 403,
    "invalid_desired": 400,
    "invalid_config": 400,
    "unknown_catalog_model": 400,
    "unknown_catalog_variant": 400,
    "revision_conflict": 409,
    "restart_required": 409,
    "foundation_change": 409,
    "superseded": 409,
    "source_mismatch": 409,
    "no_config_source": 409,
    "lock_drift": 409,
}
_DEPLOYMENTS: Final = TypeAdapter(dict[Identifier, DeploymentConfig])
MAX_DEPLOYMENTS = 1024


def _status(code: str) -> int:
    if code in _PREPARE:
        return 422
    return _STATUS.get(code) or status_for(SbproxyError("", code=code))


def _failure(exc: SbproxyError) -> Response[dict[str, object]]:
    response = admin_error(
        status=_status(exc.code), code=exc.code, message=exc.message, details=exc.details
    )
    if isinstance(exc, ConfigError) and isinstance(response.content, dict):
        # Every problem with its dotted path (and line), as `sbproxy config validate` lists.
        response.content["errors"] = [issue.to_dict() for issue in exc.issues]
        response.content["error"] = "; ".join(issue.render() for issue in exc.issues[:5]) or (
            exc.message
        )
    return response


def _answer(job_id: str, report: ReloadReport) -> dict[str, object]:
    return {
        "schema_version": 1,
        "revision": report.store_revision or report.revision,
        "content_digest": report.store_digest or report.content_digest,
        "runtime_revision": report.revision,
        "plan": report.plan.to_dict(),
        "job_id": job_id,
    }


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise InvalidBody(f"duplicate key {key!r} in the body")
        seen[key] = value
    return seen


def parse_put(body: bytes) -> tuple[int | None, dict[str, DeploymentConfig]]:
    """``(expected_revision, deployments)`` of a PUT body.

    Raises:
        InvalidBody: ``invalid_body`` -- not a JSON object, an unknown or missing field, a
            duplicate key, an ``expected_revision`` that is not null or an integer in
            [0, 2^53 - 1], more than 1024 deployments.
        SbproxyError: ``invalid_desired`` naming the dotted path of the first problem.
    """
    try:
        document = json.loads(body, object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, InvalidBody):
            raise
        raise InvalidBody("invalid JSON body; expected {expected_revision, deployments}") from None
    if not isinstance(document, dict):
        raise InvalidBody("invalid JSON body; expected {expected_revision, deployments}")
    unknown = sorted(set(document) - {"expected_revision", "deployments"})
    if unknown:
        raise InvalidBody(f"unknown field(s) {', '.join(unknown)}")
    if "expected_revision" not in document or "deployments" not in document:
        raise InvalidBody("expected_revision and deployments are required")
    expected = document["expected_revision"]
    if expected is not None and (
        isinstance(expected, bool) or not isinstance(expected, int) or expected < 0
    ):
        raise InvalidBody("expected_revision must be null or a non-negative integer")
    if expected is not None and expected > MAX_REVISION:
        raise InvalidBody(f"expected_revision must be at most {MAX_REVISION}")
    return expected, _deployments(document["deployments"])


def _deployments(raw: object) -> dict[str, DeploymentConfig]:
    """The deployment definitions of a body's ``deployments`` object.

    Raises:
        InvalidBody: ``invalid_body`` -- not an object, more than 1024 deployments.
        SbproxyError: ``invalid_desired`` naming the dotted path of the first problem.
    """
    if not isinstance(raw, dict):
        raise InvalidBody("deployments must be an object of deployment definitions by id")
    if len(raw) > MAX_DEPLOYMENTS:
        raise InvalidBody(f"at most {MAX_DEPLOYMENTS} deployments")
    try:
        return _DEPLOYMENTS.validate_python(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        path = ".".join(str(part) for part in ("deployments", *first["loc"]))
        raise SbproxyError(
            f"{path}: {first['msg']}",
            code="invalid_desired",
            remediation="Fix the named field; GET /admin/model-host/deployments shows the "
            "current definitions.",
            details={"path": path},
        ) from None


def _refuse_ranges(deployments: dict[str, DeploymentConfig]) -> None:
    """Refuse autoscaled replicas on a single host.

    Raises:
        SbproxyError: ``invalid_desired`` naming ``deployments.<id>.replicas``.
    """
    ranged = sorted(d for d, c in deployments.items() if c.replica_range is not None)
    if ranged:
        path = f"deployments.{ranged[0]}.replicas"
        raise SbproxyError(
            f"{path}: replicas as a range (autoscaling) needs a fleet "
            "(authority: cluster_authority); a single host runs one replica",
            code="invalid_desired",
            remediation="Give replicas a number.",
            details={"path": path},
        )


async def _add_store_details(exc: SbproxyError, store: RevisionStore, expected: int | None) -> None:
    """Name the store's revision in a conflict or a post-store commit failure."""
    if exc.code not in ("revision_conflict", "runtime_commit_failed"):
        return
    now = await anyio.to_thread.run_sync(store.load)
    if exc.code == "revision_conflict":
        exc.details.update(
            {"expected_revision": expected, "actual_revision": now.revision if now else None}
        )
    else:
        exc.details.update(
            {
                "durable_state_advanced": True,
                "revision": now.revision if now else None,
                "content_digest": now.content_digest if now else None,
            }
        )


@dataclass(frozen=True)
class _ReloadBody:
    """What a reload body names: the file (``source``) and, from ``sbproxy apply`` of a
    cluster file, the deployments it validated (``deployments``, raw JSON)."""

    source: str | None
    deployments: object | None


def _reload_body(body: bytes) -> _ReloadBody:
    """The parts of a reload body (empty, ``{}``, ``{"source": path}`` or ``{"source":
    path, "deployments": {...}}``).

    Raises:
        InvalidBody: ``invalid_body`` for anything else.
    """
    if not body.strip():
        return _ReloadBody(None, None)
    try:
        document = json.loads(body, object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, InvalidBody):
            raise
        raise InvalidBody("invalid JSON body; expected {} or {source[, deployments]}") from None
    if not isinstance(document, dict) or set(document) - {"source", "deployments"}:
        raise InvalidBody("invalid JSON body; expected {} or {source[, deployments]}")
    wanted = document.get("source")
    if wanted is not None and (not isinstance(wanted, str) or not wanted):
        raise InvalidBody("source must be a file path")
    if "deployments" in document and wanted is None:
        raise InvalidBody("deployments come with the source file they were read from")
    return _ReloadBody(wanted, document.get("deployments"))


def _source_mismatch(wanted: str | None, served: CompiledConfig) -> SbproxyError | None:
    """``source_mismatch`` when a reload names another file than the one served."""
    if wanted is None:
        return None
    running = served.source
    if running is not None and Path(wanted).resolve() == running.resolve():
        return None
    return SbproxyError(
        f"this server runs {running.resolve() if running else 'no file'}, not {wanted}",
        code="source_mismatch",
        remediation="Edit the file the server was started with (`sbproxy serve -f`), or "
        "restart it with this one.",
        details={"source": str(running.resolve()) if running else None},
    )


def _check_fleet_ids(deployments: dict[str, DeploymentConfig]) -> None:
    """Refuse what a fleet cannot run as written: an id another deployment's replicas may
    run under on a node, and ``devices`` (a placement chooses them).

    Raises:
        SbproxyError: ``invalid_desired`` with the dotted ``path``.
    """
    clashes = replica_id_clashes(deployments)
    if clashes:
        name, owner, replica = clashes[0]
        raise SbproxyError(
            f"deployment id {name!r} is the id a node runs replica {replica} of {owner!r} "
            "under (ids <deployment>.r<n> are kept for replicas), so the two would collide",
            code="invalid_desired",
            remediation=f"Rename deployment {name!r}, e.g. without the .r{replica} ending.",
            details={"path": f"proxy.model_host.deployments.{name}", "deployment": name},
        )
    for name, config in sorted(deployments.items()):
        if config.devices is not None:
            raise SbproxyError(
                f"deployment {name!r} names devices {config.devices}, but in a fleet each "
                "replica's devices are chosen by its placement",
                code="invalid_desired",
                remediation=f"Remove proxy.model_host.deployments.{name}.devices; use "
                "tensor_parallel for devices per replica and required_labels for where.",
                details={"path": f"proxy.model_host.deployments.{name}.devices"},
            )


def _definition(body: Mapping[str, Any]) -> dict[str, Any]:
    """A stored definition with every default filled in (fields compare one by one); the
    stored JSON itself when it no longer validates."""
    try:
        return DeploymentConfig.model_validate(body).model_dump(mode="json")
    except ValidationError:
        return dict(body)


def _replicas(definition: Mapping[str, Any]) -> int | str:
    """The fixed count, or an autoscaled range as ``"<min>..<max>"``."""
    count = definition.get("replicas", 1)
    if isinstance(count, dict):
        return f"{count.get('min', 1)}..{count.get('max', '?')}"
    return count if isinstance(count, int) else 1


def fleet_change(
    before: Mapping[str, Mapping[str, Any]], after: Mapping[str, Mapping[str, Any]]
) -> dict[str, list[Any]]:
    """What a new fleet revision changes, deployment by deployment (pure).

    Args:
        before: The previous revision's deployments (stored JSON by id; empty for none).
        after: The new revision's deployments (stored JSON by id).

    Returns:
        ``{added: [{deployment, replicas}], removed: [{deployment, replicas}], changed:
        [{deployment, fields, replicas}], unchanged: [id]}``, each sorted by id; ``fields``
        names the definition's fields that differ (defaults filled in, so ``replicas: 1``
        and no ``replicas`` are the same), ``replicas`` is ``{from, to}`` when the count
        changed, else ``null``.
    """
    change: dict[str, list[Any]] = {"added": [], "removed": [], "changed": [], "unchanged": []}
    for deployment in sorted(set(before) | set(after)):
        old, new = before.get(deployment), after.get(deployment)
        if old is None and new is not None:
            replicas = _replicas(_definition(new))
            change["added"].append({"deployment": deployment, "replicas": replicas})
            continue
        if new is None and old is not None:
            replicas = _replicas(_definition(old))
            change["removed"].append({"deployment": deployment, "replicas": replicas})
            continue
        assert old is not None and new is not None  # noqa: S101 - one of the two above
        was, now = _definition(old), _definition(new)
        fields = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))
        if not fields:
            change["unchanged"].append(deployment)
            continue
        counts = (_replicas(was), _replicas(now))
        change["changed"].append(
            {
                "deployment": deployment,
                "fields": fields,
                "replicas": (
                    {"from": counts[0], "to": counts[1]} if counts[0] != counts[1] else None
                ),
            }
        )
    return change


async def _fleet_write(
    manager: RuntimeManager,
    store: RevisionStore,
    expected: int | None,
    deployments: dict[str, DeploymentConfig],
) -> DeploymentRevision:
    """Validate ``deployments`` as a reload would (each resolves in the catalog) and
    compare-and-set them as the fleet's next revision; the fleet's controller places them.

    Returns:
        The revision this write committed (the compare-and-set's own result).

    Raises:
        SbproxyError: a resolution failure (``unknown_catalog_model``, ...),
            ``revision_conflict``, ``journal_unavailable``, ``invalid_desired`` (a
            deployment id that is another one's replica id on a node: ``chat.r1`` beside
            ``chat`` with two or more replicas).
    """
    catalog = ModelHostService.serving(manager).catalog
    for deployment in deployments.values():
        manager.resolve_config(deployment, catalog)
    _check_fleet_ids(deployments)
    return await anyio.to_thread.run_sync(
        lambda: store.compare_and_set(
            expected_revision=expected,
            catalog_revision=catalog.catalog_revision,
            deployments=_stored(deployments),
        )
    )


def _stored(deployments: Mapping[str, DeploymentConfig]) -> dict[str, Any]:
    """Deployments as a revision stores them (what the operator set, no defaults)."""
    return {d: c.model_dump(mode="json", exclude_unset=True) for d, c in deployments.items()}


def _fleet_answer(
    previous: DeploymentRevision | None, now: DeploymentRevision, *, written: bool
) -> dict[str, object]:
    """The ``fleet`` part of an answer: the revision this request committed (``written``)
    or found unchanged, the one before it, and what changed between the two."""
    before = dict(previous.deployments) if previous is not None else {}
    return {
        "schema_version": 1,
        "authority": Authority.CLUSTER_AUTHORITY.value,
        "revision": now.revision,
        "content_digest": now.content_digest,
        "previous_revision": previous.revision if previous is not None else None,
        "written": written,
        "change": fleet_change(before if written else dict(now.deployments), now.deployments),
        "placement": "the fleet's controller places the replicas (GET /admin/fleet/placements)",
        "job_id": None,
    }


async def _fleet_apply(
    manager: RuntimeManager, deployments: dict[str, DeploymentConfig]
) -> dict[str, object]:
    """``sbproxy apply`` on a cluster host: ``deployments`` become the fleet's next revision
    when they differ from the current one (the current one is answered otherwise).

    Raises:
        SbproxyError: as :func:`_fleet_write`; ``revision_conflict`` names the revision
            another writer committed meanwhile (``actual_revision``).
    """
    store = revision_store(ModelHostService.serving(manager).served)
    current = await anyio.to_thread.run_sync(store.load)
    if current is not None and dict(current.deployments) == _stored(deployments):
        return _fleet_answer(current, current, written=False)
    expected = current.revision if current is not None else None
    try:
        written = await _fleet_write(manager, store, expected, deployments)
    except SbproxyError as exc:
        await _add_store_details(exc, store, expected)
        raise
    # Tests stop the process here to let another writer commit before this one answers.
    fault_point("apply.fleet_written")
    return _fleet_answer(current, written, written=True)


async def _file_deployments(manager: RuntimeManager) -> dict[str, DeploymentConfig]:
    """The deployments of the file the host serves (re-read now).

    Raises:
        ConfigError: ``invalid_config``.
        SbproxyError: ``no_config_source``.
    """
    path = ModelHostService.serving(manager).served.source
    if path is None:
        raise SbproxyError(
            "this host was not started from a configuration file",
            code="no_config_source",
            remediation="Start it with `sbproxy serve -f sb.yml` to reload from the file.",
        )
    loaded = await anyio.to_thread.run_sync(load_config, path)
    return dict(loaded.deployments)


async def _refuse_restart_changes(manager: RuntimeManager) -> None:
    """Refuse, before the fleet's revision is written, a reload of the host's own file that
    its reload transaction would refuse (``restart_required``): nothing may change then.

    Raises:
        ConfigError: ``invalid_config``.
        SbproxyError: ``restart_required`` naming the dotted paths.
    """
    served = ModelHostService.serving(manager).served
    if served.source is not None:
        loaded = await anyio.to_thread.run_sync(load_config, served.source)
        refuse_restart_changes(served, loaded)


async def _fleet_put(
    manager: RuntimeManager,
    store: RevisionStore,
    previous: DeploymentRevision | None,
    deployments: dict[str, DeploymentConfig],
) -> Response[dict[str, object]]:
    """``PUT /admin/model-host/deployments`` on a cluster host (see :func:`_fleet_write`);
    ``previous`` is the revision ``expected`` names."""
    expected = previous.revision if previous is not None else None
    try:
        written = await _fleet_write(manager, store, expected, deployments)
    except SbproxyError as exc:
        await _add_store_details(exc, store, expected)
        return _failure(exc)
    return Response(_fleet_answer(previous, written, written=True), status_code=200)


async def _store_revision(manager: RuntimeManager, answer: dict[str, object]) -> None:
    """One meaning of "revision" on every route: the store's where deployments come from
    a store (the file supplies routes, keys and policy). Only for ``admin_managed``, whose
    reload from the file writes no revision (a cluster host answers its own write)."""
    served = ModelHostService.serving(manager).served  # as the reload left it
    host = served.model_host
    if host is None or host.authority == Authority.FILE_MANAGED:
        return
    stored = await anyio.to_thread.run_sync(revision_store(served).load)
    answer["revision"] = stored.revision if stored else None
    answer["content_digest"] = stored.content_digest if stored else None


async def _cluster_reload(
    manager: RuntimeManager,
    config: ConfigState,
    body: _ReloadBody,
    *,
    own_file: bool,
    source: ReloadSource,
) -> Response[dict[str, object]]:
    """A reload on a cluster host: the deployments (the body's, else the served file's)
    become the fleet's next revision; the host's own settings are reloaded from its
    file unless the body came from another one. ``revision`` is the fleet revision
    this request committed (or found unchanged), never one read afterwards."""
    try:
        if own_file:  # nothing is written when the host's own reload would be refused
            await _refuse_restart_changes(manager)
        deployments = (
            _deployments(body.deployments)
            if body.deployments is not None
            else await _file_deployments(manager)
        )
        fleet = await _fleet_apply(manager, deployments)
        if not own_file:
            return Response(
                {
                    "schema_version": 1,
                    "revision": fleet["revision"],
                    "content_digest": fleet["content_digest"],
                    "runtime_revision": None,
                    "plan": None,
                    "job_id": None,
                    "host_reloaded": False,
                    "fleet": fleet,
                },
                status_code=200,
            )
        job_id, report = await reload_from_source(manager, source=source.value)
    except SbproxyError as exc:
        if own_file:
            config.failed(source, exc)
        return _failure(exc)
    config.committed(source, job_id=job_id, revision=report.revision)
    answer = _answer(job_id, report)
    answer.update(
        revision=fleet["revision"],
        content_digest=fleet["content_digest"],
        host_reloaded=True,
        fleet=fleet,
    )
    return Response(answer, status_code=200)


def _is_cluster(manager: RuntimeManager) -> bool:
    host = ModelHostService.serving(manager).served.model_host
    return host is not None and host.authority == Authority.CLUSTER_AUTHORITY


def desired_handlers(manager: RuntimeManager, config: ConfigState) -> list[HTTPRouteHandler]:
    """The desired-state routes (under the admin router); reloads are recorded in
    ``config``."""

    @get("/model-host/deployments")
    async def get_deployments() -> dict[str, object]:
        """The authoritative desired deployments and their revision."""
        service = ModelHostService.serving(manager)
        host = service.served.model_host
        authority = host.authority if host else Authority.FILE_MANAGED
        if authority in (Authority.ADMIN_MANAGED, Authority.CLUSTER_AUTHORITY):
            stored = await anyio.to_thread.run_sync(revision_store(service.served).load)
            return {
                "schema_version": 1,
                "authority": authority.value,
                "read_only": False,
                "revision": stored.revision if stored else None,
                "content_digest": stored.content_digest if stored else None,
                "deployments": dict(stored.deployments) if stored else {},
            }
        desired = desired_of(service.served)
        return {
            "schema_version": 1,
            "authority": authority.value,
            "read_only": True,
            "revision": service.revision,
            "content_digest": desired_digest(desired),
            "deployments": desired,
        }

    @put("/model-host/deployments", status_code=200)
    async def put_deployments(request: Request[Any, Any, Any]) -> Response[dict[str, object]]:
        """Replace the ``admin_managed`` desired deployments (compare-and-set)."""
        served = ModelHostService.serving(manager).served
        try:
            store = revision_store(served)
        except SbproxyError as exc:
            return _failure(exc)
        body = await request.body()
        try:
            expected, deployments = parse_put(body)
            if not _is_cluster(manager):
                _refuse_ranges(deployments)
        except InvalidBody:
            raise
        except SbproxyError as exc:
            return _failure(exc)
        current = await anyio.to_thread.run_sync(store.load)
        actual = current.revision if current else None
        if actual != expected:
            return _failure(
                SbproxyError(
                    f"the store is at revision {'empty' if actual is None else actual}, "
                    f"not {'empty' if expected is None else expected}",
                    code="revision_conflict",
                    remediation="GET /admin/model-host/deployments and retry with its revision.",
                    details={"expected_revision": expected, "actual_revision": actual},
                )
            )
        if _is_cluster(manager):
            return await _fleet_put(manager, store, current, deployments)
        candidate = with_deployments(served, deployments)
        try:
            job_id, report = await reload(
                manager,
                candidate,
                source=ReloadSource.ADMIN_PUT.value,
                use_store=True,
                expected_revision=expected,
            )
        except SbproxyError as exc:
            config.failed(ReloadSource.ADMIN_PUT, exc)
            await _add_store_details(exc, store, expected)
            return _failure(exc)
        config.committed(ReloadSource.ADMIN_PUT, job_id=job_id, revision=report.revision)
        return Response(_answer(job_id, report), status_code=200)

    @post("/reload", status_code=200)
    async def reload_route(request: Request[Any, Any, Any]) -> Response[dict[str, object]]:
        """Re-read the configuration file and apply it through the reload transaction; on
        a cluster host, make a desired-state document's deployments the fleet's."""
        body = _reload_body(await request.body())
        source = ReloadSource.ADMIN if body.source is None else ReloadSource.APPLY
        mismatch = _source_mismatch(body.source, ModelHostService.serving(manager).served)
        cluster = _is_cluster(manager)
        if mismatch is not None and not (cluster and body.deployments is not None):
            return _failure(mismatch)  # not a reload of this host's file: nothing recorded
        if cluster:
            return await _cluster_reload(
                manager, config, body, own_file=mismatch is None, source=source
            )
        try:
            job_id, report = await reload_from_source(manager, source=source.value)
        except SbproxyError as exc:
            config.failed(source, exc)
            return _failure(exc)
        config.committed(source, job_id=job_id, revision=report.revision)
        answer = _answer(job_id, report)
        await _store_revision(manager, answer)
        return Response(answer, status_code=200)

    return [get_deployments, put_deployments, reload_route]
