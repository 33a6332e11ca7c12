"""``sbproxy certify``: run the live checks this machine can run and append them to the ledger.

Exit status: 0 when every check that ran passed, 1 when one failed (it is recorded as
failed), 2 when there is nothing to certify with (no built engine or no cached model:
``certify_inputs_missing``, naming what to run first) or the ledger is corrupt.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import anyio
import click

from sbproxy.cli._options import cache_dir_option, config_option, load_cli_config, resolve_layout
from sbproxy.cli._output import EXIT_RUNTIME, emit_json, fail, format_option
from sbproxy.cli.capabilities_cmd import LEDGER_FILE
from sbproxy.errors import SbproxyError
from sbproxy.model_host.capabilities import append_entry, default_ledger_dir, read_ledger
from sbproxy.model_host.certify import certify, plan_checks
from sbproxy.model_host.runtime import probe_devices

__all__ = ["certify_command"]

MARKDOWN_FILE = "certification.md"


@click.command("certify")
@config_option
@cache_dir_option
@format_option
@click.option("--dry-run", is_flag=True, help="Say what would run and be skipped; run nothing.")
@click.option(
    "--ledger-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Directory of certification.md and certification.jsonl (default: the checkout's docs/).",
)
def certify_command(
    config_path: Path | None,
    cache_dir: Path | None,
    output_format: str,
    dry_run: bool,
    ledger_dir: Path | None,
) -> None:
    """Run the live checks this machine can run (load, chat, stream, stop) and record them."""
    command = "certify"
    config = load_cli_config(command, config_path, output_format=output_format)
    layout = resolve_layout(command, cache_dir, config, output_format=output_format)
    engine = config.model_host.engines.llama_cpp if config and config.model_host else None
    directory = ledger_dir or default_ledger_dir()
    json_path, markdown_path = directory / LEDGER_FILE, directory / MARKDOWN_FILE
    try:
        read_ledger(json_path)
        gpus = probe_devices()
        targets = plan_checks(layout, config=engine, gpus=gpus)
    except SbproxyError as exc:
        fail(command, exc, output_format=output_format)
    if dry_run:
        if output_format == "json":
            emit_json(command, {"dry_run": True, "targets": [t.to_dict() for t in targets]})
            return
        for target in targets:
            what = f"skip ({target.skip_reason})" if target.skip_reason else "run"
            click.echo(f"{target.engine} on {target.accelerator}: {what}")
        return
    with tempfile.TemporaryDirectory(prefix="sbproxy-certify-") as scratch:
        entries = anyio.run(lambda: certify(targets, scratch=Path(scratch), gpus=gpus))
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for entry in entries:
            append_entry(entry, json_path=json_path, markdown_path=markdown_path)
    except (SbproxyError, OSError) as exc:
        error = exc if isinstance(exc, SbproxyError) else SbproxyError(str(exc))
        fail(command, error, output_format=output_format, exit_code=EXIT_RUNTIME)
    failed = any(entry["outcome"] == "failed" for entry in entries)
    if output_format == "json":
        emit_json(command, {"ok": not failed, "ledger": str(json_path), "entries": entries})
    else:
        for entry in entries:
            reason = f" ({entry['reason']})" if entry.get("reason") else ""
            click.echo(f"{entry['engine']} on {entry['accelerator']}: {entry['outcome']}{reason}")
        click.echo(f"recorded in {markdown_path} and {json_path}")
    if failed:
        sys.exit(EXIT_RUNTIME)
