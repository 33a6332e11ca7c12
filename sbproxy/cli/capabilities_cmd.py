"""``sbproxy capabilities``: the capability matrix (engines x accelerators x features).

The matrix is derived from the code (the engine planners and the configuration's rules) and
the certification ledger (``sbproxy certify``); ``--format markdown`` prints
``docs/capabilities.md``, which a test holds equal to the command's output.
"""

from __future__ import annotations

from pathlib import Path

import click

from sbproxy.cli._output import emit_json, fail
from sbproxy.model_host.capabilities import (
    ENGINES,
    FEATURES,
    LedgerError,
    accelerators,
    capability_matrix,
    default_ledger_dir,
    matrix_markdown,
    read_ledger,
)

__all__ = ["capabilities_command"]

LEDGER_FILE = "certification.jsonl"


@click.command("capabilities")
@click.option(
    "--format",
    "output_format",
    type=click.Choice(["text", "json", "markdown"]),
    default="text",
    show_default=True,
    help="text for people; json prints one object on stdout for scripts; markdown prints "
    "docs/capabilities.md.",
)
@click.option(
    "--ledger-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Directory holding certification.jsonl (default: the checkout's docs/).",
)
def capabilities_command(output_format: str, ledger_dir: Path | None) -> None:
    """Show each engine x accelerator x feature as live, planned or unsupported (with why)."""
    command = "capabilities"
    ledger_path = (ledger_dir or default_ledger_dir()) / LEDGER_FILE
    try:
        ledger = read_ledger(ledger_path)
    except LedgerError as exc:
        fail(command, exc, output_format="json" if output_format == "json" else "text")
    cells = capability_matrix(ledger)
    if output_format == "json":
        emit_json(
            command,
            {
                "engines": list(ENGINES),
                "accelerators": list(accelerators()),
                "features": list(FEATURES),
                "ledger": str(ledger_path),
                "cells": [cell.to_dict() for cell in cells],
            },
        )
        return
    if output_format == "markdown":
        click.echo(matrix_markdown(cells), nl=False)
        return
    for cell in cells:
        why = f" ({cell.reason_code}: {cell.detail})" if cell.reason_code else ""
        click.echo(f"{cell.engine} {cell.accelerator} {cell.feature}: {cell.status.value}{why}")
