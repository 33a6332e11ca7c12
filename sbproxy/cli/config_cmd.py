"""``sbproxy config``: validate an ``sb.yml``; print its JSON Schema or its reference page;
``status`` (in ``config_status_cmd``, imported when it runs: it needs the admin client) asks
a running server which configuration it serves."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from sbproxy.catalog import Catalog, load_catalog
from sbproxy.cli._lazy import LazyCommand, LazyGroup
from sbproxy.cli._output import EXIT_INVALID, emit_json, format_option
from sbproxy.config import (
    CompiledConfig,
    config_json_schema_text,
    config_reference_markdown,
    dotted,
    load_config,
)
from sbproxy.errors import CatalogError, ConfigError, ConfigIssue

__all__ = ["config_group"]


@click.group(
    "config",
    cls=LazyGroup,
    lazy_commands={
        "status": LazyCommand(
            "sbproxy.cli.config_status_cmd:status_command",
            "Show the running server's active config (path, SHA-256, revision) and its last "
            "reload (result, time, job, reason code and error).",
        )
    },
)
def config_group() -> None:
    """Check and describe configuration files; show the one a running server serves."""


def _catalog_issues(compiled: CompiledConfig) -> list[ConfigIssue]:
    """Check every deployment's model and variant against the catalog the file selects."""
    host = compiled.model_host
    if host is None or not host.deployments:
        return []
    catalog: Catalog
    try:
        catalog = load_catalog(Path(host.catalog_file) if host.catalog_file else None)
    except CatalogError as exc:
        return [ConfigIssue("proxy.model_host.catalog_file", str(exc))]
    issues = []
    for deployment_id, deployment in host.deployments.items():
        problem = catalog.check_reference(deployment.model, deployment.variant)
        if problem is None:
            continue
        field, message = problem
        path = compiled.lowered_from.get(deployment_id) or dotted(
            ("proxy", "model_host", "deployments", deployment_id)
        )
        issues.append(ConfigIssue(f"{path}.{field}", message))
    return issues


@config_group.command("validate")
@click.option(
    "-f",
    "--config",
    "config_path",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    envvar="SB_CONFIG_FILE",
    help="The sb.yml to check (env SB_CONFIG_FILE).",
)
@format_option
def validate_command(config_path: Path, output_format: str) -> None:
    """Validate an sb.yml: schema, cross-field rules, routes, serve: lowering and catalog ids.

    Exit status: 0 valid, 2 invalid (every problem listed with its dotted path).
    """
    issues: list[ConfigIssue]
    compiled: CompiledConfig | None = None
    try:
        compiled = load_config(config_path)
        issues = _catalog_issues(compiled)
    except ConfigError as exc:
        issues = exc.issues
    valid = not issues
    if output_format == "json":
        payload: dict[str, object] = {
            "file": str(config_path),
            "valid": valid,
            "errors": [issue.to_dict() for issue in issues],
        }
        if compiled is not None and valid:
            payload["deployments"] = sorted(compiled.deployments)
            payload["routes"] = [
                {
                    "origin": r.origin,
                    "provider": r.provider,
                    "model": r.public_model,
                    "deployment": r.deployment,
                    "default": r.default,
                }
                for r in compiled.routes
            ]
        emit_json("config.validate", payload)
    elif valid:
        assert compiled is not None  # noqa: S101 - valid implies loaded
        count = len(compiled.deployments)
        click.echo(
            f"{config_path}: valid ({count} deployment{'s' if count != 1 else ''}, "
            f"{len(compiled.routes)} route{'s' if len(compiled.routes) != 1 else ''})"
        )
    else:
        noun = "problem" if len(issues) == 1 else "problems"
        click.echo(f"{config_path}: invalid ({len(issues)} {noun})", err=True)
        for issue in issues:
            click.echo(f"  {issue.render(str(config_path))}", err=True)
    if not valid:
        sys.exit(EXIT_INVALID)


@config_group.command("schema")
def schema_command() -> None:
    """Print the JSON Schema of sb.yml (the same as schemas/sb-config.schema.json)."""
    click.echo(config_json_schema_text(), nl=False)


@config_group.command("docs")
def docs_command() -> None:
    """Print the configuration reference as Markdown (the same as docs/configuration.md),
    rendered from the JSON Schema: every field by dotted path, with type, default and
    description."""
    click.echo(config_reference_markdown(), nl=False)
