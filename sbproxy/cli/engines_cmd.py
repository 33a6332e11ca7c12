"""``sbproxy engines``: what engines can run here, and pinned source builds of llama.cpp."""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import click

from sbproxy.cli._live import run_followed
from sbproxy.cli._options import (
    JournalChoice,
    cache_dir_option,
    config_option,
    load_cli_config,
    resolve_layout,
    select_journal,
)
from sbproxy.cli._output import EXIT_INVALID, EXIT_RUNTIME, emit_json, fail, format_option
from sbproxy.config import CompiledConfig, EngineConfig
from sbproxy.errors import SbproxyError
from sbproxy.model_host.artifacts import ArtifactCache
from sbproxy.model_host.engines import (
    BuildInput,
    BuildOutput,
    build_identity,
    detect_llama_cpp,
    engine_build_workflow,
)
from sbproxy.model_host.engines.vllm import detect_vllm
from sbproxy.model_host.flows import registry
from sbproxy.model_host.runtime import probe_worker
from sbproxy.store import JobRecord, JobStatus
from sbproxy.workflows import WorkflowEngine

__all__ = ["engines_group"]


@click.group("engines")
def engines_group() -> None:
    """Inspect and provision inference engines."""


def _engine_config(config: CompiledConfig | None, kind: str) -> EngineConfig | None:
    host = config.model_host if config is not None else None
    if host is None:
        return None
    engine: EngineConfig | None = getattr(host.engines, kind)
    return engine


@engines_group.command("list")
@config_option
@cache_dir_option
@format_option
def list_command(config_path: Path | None, cache_dir: Path | None, output_format: str) -> None:
    """Show each engine's availability on this worker (available, acquirable, ...)."""
    command = "engines.list"
    config = load_cli_config(command, config_path, output_format=output_format)
    layout = resolve_layout(command, cache_dir, config, output_format=output_format)
    worker = probe_worker()
    detections = [
        detect_llama_cpp(_engine_config(config, "llama_cpp"), layout=layout),
        detect_vllm(
            _engine_config(config, "vllm"),
            accelerator=worker.accelerator.value,
            compute_capability=worker.compute_capability,
        ),
    ]
    if output_format == "json":
        emit_json(
            command,
            {"worker": worker.describe(), "engines": [d.to_dict() for d in detections]},
        )
        return
    click.echo(f"worker: {worker.describe()}")
    for detection in detections:
        where = f" ({detection.executable})" if detection.executable else ""
        click.echo(f"{detection.kind}: {detection.availability.value}{where} - {detection.reason}")
        if detection.version:
            click.echo(f"  version: {detection.version}")
        if detection.remediation and detection.availability.value != "available":
            click.echo(f"  to do: {detection.remediation}")


async def _build(journal: JournalChoice, request: BuildInput) -> JobRecord:
    cache = ArtifactCache(journal.layout)
    cache.ensure_dirs()
    engine = await WorkflowEngine.open(
        journal.location, registry, resources=[cache], node=journal.node()
    )
    try:
        submitted = await engine.submit(
            engine_build_workflow,
            request,
            idempotency_key=f"engine_build:{build_identity(request)}",
            subject=f"engine:llama_cpp:{build_identity(request)}",
        )
        return await run_followed(engine, submitted.job.id)
    finally:
        await engine.close()


@engines_group.command("build")
@click.argument("engine_kind", metavar="ENGINE", type=click.Choice(["llama_cpp"]))
@click.option(
    "--source-archive",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    default=None,
    help="Local source archive (tar.gz); default: engines.llama_cpp.source.file of -f.",
)
@click.option("--sha256", "sha256", default=None, help="Pinned SHA-256 of the archive.")
@click.option("--strip", "strip_prefix", default=None, help="Directory of the tree inside it.")
@click.option(
    "--acceleration", type=click.Choice(["cpu", "cuda"]), default=None, help="Default: cpu."
)
@click.option("--jobs", type=int, default=0, show_default=True, help="Compile jobs; 0: all CPUs.")
@config_option
@cache_dir_option
@format_option
def build_command(
    engine_kind: str,
    source_archive: Path | None,
    sha256: str | None,
    strip_prefix: str | None,
    acceleration: str | None,
    jobs: int,
    config_path: Path | None,
    cache_dir: Path | None,
    output_format: str,
) -> None:
    """Build ENGINE from a pinned source archive as a durable job and publish it.

    The archive must match --sha256: a source without a digest is refused. A build that is
    already published is reused; a crashed build restarts from a clean directory.
    """
    command = "engines.build"
    config = load_cli_config(command, config_path, output_format=output_format)
    layout = resolve_layout(command, cache_dir, config, output_format=output_format)
    journal = select_journal(command, layout, config, output_format=output_format)
    configured = _engine_config(config, engine_kind)
    source = configured.source if configured is not None else None
    archive = source_archive or (Path(source.file) if source and source.file else None)
    digest = sha256 or (source.sha256 if source else None)
    if archive is None or digest is None:
        fail(
            command,
            SbproxyError(
                "a source build needs --source-archive and --sha256 (or "
                "engines.llama_cpp.source with file and sha256 in -f)",
                code="engine_blocked",
                remediation="Pin the archive's SHA-256; unpinned sources are never built.",
            ),
            output_format=output_format,
        )
    try:
        request = BuildInput(
            archive=str(archive.absolute()),
            sha256=digest.lower(),
            strip_prefix=strip_prefix
            if strip_prefix is not None
            else (source.strip_prefix or "" if source else ""),
            acceleration=acceleration
            or (
                configured.acceleration
                if configured and configured.acceleration == "cuda"
                else "cpu"
            ),
            jobs=jobs,
        )
    except ValueError as exc:
        fail(
            command,
            SbproxyError(f"invalid build request: {exc}", code="engine_blocked"),
            output_format=output_format,
        )
    try:
        job = anyio.run(_build, journal, request)
    except SbproxyError as exc:
        fail(command, exc, output_format=output_format, exit_code=EXIT_RUNTIME)
    if job.status != JobStatus.SUCCEEDED:
        error = job.error
        message = f"build job {job.id} {job.status.value}: {error.message if error else ''}"
        if output_format == "json":
            emit_json(
                command,
                {
                    "ok": False,
                    "job_id": job.id,
                    "error": {"code": error.code, "message": error.message} if error else None,
                },
            )
        click.echo(f"sbproxy engines build: {message}", err=True)
        sys.exit(
            EXIT_RUNTIME if (error is None or error.code != "engine_blocked") else EXIT_INVALID
        )
    output = BuildOutput.model_validate(job.output)
    if output_format == "json":
        emit_json(command, {"engine": engine_kind, "job_id": job.id, **output.model_dump()})
    else:
        click.echo(f"{engine_kind} {output.identity}: {output.executable} ({output.version})")
