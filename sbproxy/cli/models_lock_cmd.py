"""``sbproxy models lock`` and ``sbproxy models verify-lock``: pin what a config serves.

``lock`` resolves every configured deployment of ``-f sb.yml`` on this machine and writes
the exact artifacts (digest, source, revision, files, engine) to ``sbproxy-models.lock``
next to the config (or ``--out``), atomically. ``verify-lock`` compares a lockfile with what
the config and catalog resolve to now and with the cache, and exits 2 on any drift, so CI
and deploy scripts can refuse to roll out other bytes than the ones reviewed. The domain
logic is :mod:`sbproxy.model_host.lockfile`; ``sbproxy serve --locked`` runs the same check.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from sbproxy.cli._host import choose_host, run_with_service
from sbproxy.cli._options import cache_dir_option, catalog_file_option, config_option
from sbproxy.cli._output import EXIT_INVALID, emit_json, fail, format_option
from sbproxy.errors import SbproxyError
from sbproxy.model_host.lockfile import (
    LockCheck,
    Lockfile,
    LockfileError,
    LockReport,
    build_lock,
    default_lock_path,
    read_lock,
    verify_lock,
    write_lock,
)
from sbproxy.model_host.service import ModelHostService

__all__ = ["check_line", "lock_command", "verify_lock_command"]


def check_line(check: LockCheck) -> str:
    """``name:variant status: detail``, one model of a verification for people."""
    return f"{check.name}:{check.variant} {check.status.value}: {check.detail}"


@click.command("lock")
@click.option(
    "--out",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Where to write the lockfile (default: sbproxy-models.lock next to the -f config).",
)
@config_option
@catalog_file_option
@cache_dir_option
@format_option
def lock_command(
    *,
    out: Path | None,
    config_path: Path | None,
    catalog_file: Path | None,
    cache_dir: Path | None,
    output_format: str,
) -> None:
    """Write the exact artifact every configured deployment resolves to on this machine.

    The lockfile lists, once per catalog model and variant, the artifact digest, source,
    revision, every file's SHA-256 and size, and the engine. It holds no credentials.
    Commit it next to sb.yml and check it with `sbproxy models verify-lock` or
    `sbproxy serve --locked`.

    Exit status: 0 written; 1 it could not be written; 2 bad input (no -f, a config
    without deployments' model host, a deployment that does not resolve).
    """
    command = "models.lock"
    if config_path is None:
        fail(
            command,
            SbproxyError(
                "models lock needs the configuration to lock.",
                code="config_required",
                remediation="Pass -f sb.yml (or set SB_CONFIG_FILE).",
            ),
            output_format=output_format,
        )
    host = choose_host(
        command,
        config_path=config_path,
        cache_dir=cache_dir,
        catalog_file=catalog_file,
        output_format=output_format,
    )
    path = out.absolute() if out is not None else default_lock_path(config_path)

    async def work(service: ModelHostService) -> Lockfile:
        lock = build_lock(service)
        write_lock(lock, path)
        return lock

    lock = run_with_service(command, output_format, host, work)
    if output_format == "json":
        emit_json(
            command,
            {
                "path": str(path),
                "catalog_revision": lock.catalog_revision,
                "models": [
                    {
                        "name": model.name,
                        "variant": model.variant_id,
                        "engine": model.engine.kind.value,
                        "artifact_digest": model.artifact_digest,
                    }
                    for model in lock.models
                ],
            },
        )
        return
    for model in lock.models:
        click.echo(
            f"{model.name}:{model.variant_id} via {model.engine.kind.value} "
            f"(sha256:{model.artifact_digest})"
        )
    click.echo(f"locked {len(lock.models)} model(s) from catalog {lock.catalog_revision} in {path}")


@click.command("verify-lock")
@click.option(
    "--lockfile",
    "lockfile",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Lockfile to check (default: sbproxy-models.lock next to the -f config, else in "
    "the working directory).",
)
@config_option
@catalog_file_option
@cache_dir_option
@format_option
def verify_lock_command(
    *,
    lockfile: Path | None,
    config_path: Path | None,
    catalog_file: Path | None,
    cache_dir: Path | None,
    output_format: str,
) -> None:
    """Check a lockfile against the config, the catalog and the cache.

    Each locked model is ok (it still resolves to the locked digest and is in the cache),
    missing (same digest, not in the cache), or digest_mismatch (the config or catalog now
    resolves to other bytes, or to nothing); a configured deployment the lock lacks is
    unlocked. Without -f, each locked model is checked against the catalog alone.

    Exit status: 0 no drift; 2 drift, or a lockfile that is missing or invalid.
    """
    command = "models.verify-lock"
    path = lockfile.absolute() if lockfile is not None else default_lock_path(config_path)
    try:
        lock = read_lock(path)
    except LockfileError as exc:
        fail(command, exc, output_format=output_format)
    host = choose_host(
        command,
        config_path=config_path,
        cache_dir=cache_dir,
        catalog_file=catalog_file,
        output_format=output_format,
    )

    async def work(service: ModelHostService) -> LockReport:
        return verify_lock(lock, service)

    report = run_with_service(command, output_format, host, work)
    if output_format == "json":
        emit_json(
            command,
            {
                "lockfile": str(path),
                "drift": report.drift,
                "models": [check.to_dict() for check in report.checks],
            },
        )
    else:
        for check in report.checks:
            click.echo(check_line(check))
        drifted = len(report.drifted)
        if drifted:
            click.echo(f"{path}: drift in {drifted} of {len(report.checks)} model(s)")
        else:
            click.echo(f"{path}: {len(report.checks)} model(s) match the lock")
    if report.drift:
        sys.exit(EXIT_INVALID)
