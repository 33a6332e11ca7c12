"""Options several verb groups share, and the settings they select.

``-f/--config`` (env ``SB_CONFIG_FILE``), ``--cache-dir`` and ``--catalog-file`` mean the same
thing on every verb that takes them:

* the cache root is ``--cache-dir``, else the config's ``proxy.model_host.cache.directory``,
  else the platform default (:func:`~sbproxy.model_host.artifacts.resolve_cache_root`);
* the catalog is ``--catalog-file``, else the config's ``proxy.model_host.catalog_file``, else
  the built-in one. One node loads one catalog, so a ``--catalog-file`` that differs from the
  config's own ``catalog_file`` is refused (``catalog_conflict``);
* the journal is the config's ``proxy.model_host.journal.url``, else ``$SBPROXY_JOURNAL_URL``,
  else the SQLite file of the cache root (:func:`select_journal`, through
  :func:`~sbproxy.store.journal_location`, as ``serve`` and ``open_service`` choose it), even
  under ``--cache-dir``.

Problems with any of them are bad input: exit status 2.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, SupportsFloat, SupportsIndex, TypeVar, get_args

import click

from sbproxy.cli._output import fail
from sbproxy.errors import ConfigError, SbproxyError
from sbproxy.model_host.artifacts import CacheLayout, resolve_cache_root

if TYPE_CHECKING:
    from sbproxy.config import CompiledConfig

__all__ = [
    "FiniteFloatRange",
    "JournalChoice",
    "cache_dir_option",
    "catalog_file_option",
    "check_catalog_choice",
    "config_option",
    "engine_option",
    "load_cli_config",
    "resolve_layout",
    "select_journal",
]

config_option = click.option(
    "-f",
    "--config",
    "config_path",
    type=click.Path(path_type=Path, dir_okay=False),
    envvar="SB_CONFIG_FILE",
    default=None,
    help="sb.yml naming the cache directory, the catalog file and the configured "
    "deployments (env SB_CONFIG_FILE).",
)

cache_dir_option = click.option(
    "--cache-dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Cache root (default: the config's proxy.model_host.cache.directory, else the "
    "platform's).",
)

catalog_file_option = click.option(
    "--catalog-file",
    type=click.Path(path_type=Path),
    default=None,
    help="Catalog YAML that replaces the built-in catalog entirely.",
)

F = TypeVar("F", bound=Callable[..., Any])


def engine_option(fn: F) -> F:
    """``--engine``: the engine the artifact must suit (a choice of ``EngineChoice``)."""
    # The catalog (pydantic models) is imported by the verbs that take this option, not by
    # every verb that reads these shared options (`jobs list` needs no catalog).
    from sbproxy.catalog import EngineChoice

    option = click.option(
        "--engine",
        type=click.Choice(list(get_args(EngineChoice))),
        default="auto",
        show_default=True,
        help="Engine the artifact must suit; auto takes the variant's first engine.",
    )
    return option(fn)


class FiniteFloatRange(click.FloatRange):
    """A ``FloatRange`` that also refuses ``nan``, ``inf`` and ``-inf`` as a usage error.

    ``click.FloatRange`` lets ``nan`` through (every comparison with it is false), and an
    open upper end lets ``inf`` through; neither is an amount of anything.
    """

    def convert(
        self,
        value: SupportsFloat | SupportsIndex,
        param: click.Parameter | None,
        ctx: click.Context | None,
    ) -> float:
        number: float = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        converted: float = super().convert(number, param, ctx)
        return converted


def load_cli_config(
    command: str, config_path: Path | None, *, output_format: str
) -> CompiledConfig | None:
    """The configuration ``-f`` names, or ``None`` without one (exit 2 when invalid)."""
    if config_path is None:
        return None
    # The config models load only when a verb is given a config file.
    from sbproxy.config import load_config

    try:
        return load_config(config_path)
    except ConfigError as exc:
        fail(command, exc, output_format=output_format)


def resolve_layout(
    command: str,
    cache_dir: Path | None,
    config: CompiledConfig | None,
    *,
    output_format: str,
) -> CacheLayout:
    """The cache root the options select (exit 2 when it is not absolute)."""
    host = config.model_host if config is not None else None
    configured = host.cache.directory if host is not None else None
    try:
        # A flag is relative to this process's working directory, which is well defined.
        return resolve_cache_root(
            cache_dir.absolute() if cache_dir is not None else None, configured=configured
        )
    except SbproxyError as exc:
        fail(command, exc, output_format=output_format)


@dataclass(frozen=True)
class JournalChoice:
    """The journal a verb's options select.

    Attributes:
        layout: The cache root (its SQLite journal, its node id file).
        location: The SQLite file, or a checked ``postgresql://`` URL (never printed: it may
            hold a password; :func:`~sbproxy.store.journal_display` shows it).
        configured_node: ``proxy.model_host.node.id`` of the config, if any.
    """

    layout: CacheLayout
    location: Path | str
    configured_node: str | None = None

    @property
    def on_postgres(self) -> bool:
        """Whether the journal is a PostgreSQL database (created by whoever used it first)."""
        return isinstance(self.location, str)

    def node(self) -> str | None:
        """The node id this cache's jobs record (:func:`~sbproxy.store.journal_node_id`).

        Raises:
            SbproxyError: ``store_failed`` when the cache's node id file cannot be used.
        """
        from sbproxy.store import journal_node_id

        return journal_node_id(self.location, self.layout.root, self.configured_node)


def select_journal(
    command: str,
    layout: CacheLayout,
    config: CompiledConfig | None,
    *,
    output_format: str,
) -> JournalChoice:
    """The journal of ``layout`` under ``config`` (exit 2, ``invalid_journal_url``, when the
    URL chosen names no PostgreSQL server)."""
    from sbproxy.store import journal_location

    host = config.model_host if config is not None else None
    try:
        location = journal_location(layout.journal, host)
    except SbproxyError as exc:
        fail(command, exc, output_format=output_format)
    return JournalChoice(
        layout=layout, location=location, configured_node=host.node.id if host else None
    )


def check_catalog_choice(
    command: str,
    catalog_file: Path | None,
    config: CompiledConfig | None,
    *,
    output_format: str,
) -> None:
    """Refuse a ``--catalog-file`` that contradicts the config's ``catalog_file`` (exit 2)."""
    host = config.model_host if config is not None else None
    if catalog_file is None or host is None or host.catalog_file is None:
        return
    if Path(host.catalog_file).absolute() == catalog_file.absolute():
        return
    fail(
        command,
        SbproxyError(
            f"--catalog-file {catalog_file} conflicts with the config's "
            f"proxy.model_host.catalog_file ({host.catalog_file}); one node loads one catalog.",
            code="catalog_conflict",
            remediation="Drop --catalog-file, or change the config's catalog_file.",
        ),
        output_format=output_format,
    )
