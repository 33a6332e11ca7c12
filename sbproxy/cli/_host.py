"""Opening the model host's service for one ``sbproxy models`` verb, and its exit codes.

A verb reads its options into a :class:`HostChoice` (config, cache root, catalog file; bad
input exits 2 before anything is created), then runs its work on an event loop with
:func:`run_with_service`, which opens the cache's journal and the catalog for it, or with
:func:`run_host` when it opens nothing. Both turn errors into exit codes: 2 for bad input
(unknown model or variant, invalid catalog or config, a blocked removal), 1 for anything that
went wrong while working, 130 when interrupted with Ctrl-C (a pull resumes under the same
job when run again).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import anyio

from sbproxy.cli._options import (
    JournalChoice,
    check_catalog_choice,
    load_cli_config,
    resolve_layout,
    select_journal,
)
from sbproxy.cli._output import EXIT_INVALID, exit_status, fail, interrupted
from sbproxy.errors import CatalogError, ResolutionError, SbproxyError, sole_error
from sbproxy.model_host.artifacts import CacheLayout

if TYPE_CHECKING:
    from sbproxy.config import CompiledConfig
    from sbproxy.model_host.service import ModelHostService

__all__ = [
    "HostChoice",
    "choose_host",
    "exit_code_for",
    "run_host",
    "run_with_service",
]

T = TypeVar("T")


@dataclass(frozen=True)
class HostChoice:
    """What the options of one verb select.

    Attributes:
        layout: The cache root.
        config: The ``-f`` configuration, if any.
        catalog_file: ``--catalog-file``, if given (else the config's, else built-in).
        journal: The journal the options select (``None``: as ``open_service`` selects it,
            for a choice made without :func:`choose_host`).
    """

    layout: CacheLayout
    config: CompiledConfig | None
    catalog_file: Path | None
    journal: JournalChoice | None = None

    def cache_used(self) -> bool:
        """Whether anything ever ran with this cache root: its SQLite journal exists, or,
        with the journal on PostgreSQL (shared, so no sign of this cache), its artifact
        directories do. A verb that only reports reads nothing, and creates nothing, when
        not."""
        if self.journal is not None and self.journal.on_postgres:
            return self.layout.metadata.is_dir() or self.layout.partials.is_dir()
        return self.layout.journal.is_file()

    @property
    def catalog_path(self) -> Path | None:
        """The catalog file in force (``None``: the built-in catalog)."""
        if self.catalog_file is not None:
            return self.catalog_file
        host = self.config.model_host if self.config is not None else None
        return Path(host.catalog_file) if host is not None and host.catalog_file else None


def choose_host(
    command: str,
    *,
    config_path: Path | None,
    cache_dir: Path | None,
    catalog_file: Path | None,
    output_format: str,
) -> HostChoice:
    """Read the shared options (exit 2 for an invalid config, cache root, catalog choice or
    journal URL)."""
    config = load_cli_config(command, config_path, output_format=output_format)
    check_catalog_choice(command, catalog_file, config, output_format=output_format)
    layout = resolve_layout(command, cache_dir, config, output_format=output_format)
    # The journal is chosen (and its URL checked, exit 2) before anything opens it.
    journal = select_journal(command, layout, config, output_format=output_format)
    return HostChoice(layout=layout, config=config, catalog_file=catalog_file, journal=journal)


def exit_code_for(error: SbproxyError) -> int:
    """2 for bad input or a refusal (:func:`~sbproxy.cli._output.exit_status`), 1 for a
    failure while working."""
    if isinstance(error, CatalogError | ResolutionError):
        return EXIT_INVALID
    return exit_status(error)


def run_host(command: str, output_format: str, work: Callable[[], Awaitable[T]]) -> T:
    """Run ``work`` on an event loop and return its result; errors exit (see module doc)."""
    try:
        return anyio.run(work)
    except SbproxyError as exc:
        fail(command, exc, output_format=output_format, exit_code=exit_code_for(exc))
    except ExceptionGroup as group:
        # A task group's wrapping (a job run beside its event follower): report the error
        # itself, by its code, like any other; a group holding anything else is a bug.
        error = sole_error(group)
        if error is None:
            raise
        fail(command, error, output_format=output_format, exit_code=exit_code_for(error))
    except KeyboardInterrupt:
        # Here, not in each verb: every model-host verb runs its work through this function.
        interrupted(command)


def run_with_service(
    command: str,
    output_format: str,
    host: HostChoice,
    work: Callable[[ModelHostService], Awaitable[T]],
) -> T:
    """Open the service ``host`` selects (creating the cache root), run ``work`` with it."""
    # The service (the workflow engine, the flows, the journal's database layer) loads with
    # the verbs that open it; `models list` reads the cache without it.
    from sbproxy.model_host.service import open_service

    async def main() -> T:
        async with open_service(
            host.layout, config=host.config, catalog_file=host.catalog_file
        ) as service:
            return await work(service)

    return run_host(command, output_format, main)
