"""``sbproxy run CATALOG_ID``: the fastest route to the canonical runtime on this machine.

It accepts certified catalog ids only (raw ``hf:`` references, paths and anything with
``/`` or ``:`` bypass the catalog identity and are refused), resolves the exact artifact for
this worker, generates a high-entropy admin credential, writes an owner-only temporary
configuration (``pull: on_boot``, ``warm: true``) that is removed on every exit path, serves
it, and prints the endpoint, the admin credential, a curl request, ``OPENAI_BASE_URL`` and
``OPENAI_API_KEY`` only once the deployment is ready. Ctrl-C drains and stops, as ``sbproxy
serve`` does (within ``shutdown_deadline_ms`` plus 2 s); a second Ctrl-C stops at once.

Exit status: 0 after a clean stop, 1 when serving or readiness fails, 2 when the request
cannot be resolved (unknown id, raw reference, nothing fits this worker).
"""

from __future__ import annotations

import contextlib
import copy
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import click
import yaml

from sbproxy.catalog import ArtifactRequest, load_builtin_catalog, resolve_artifact
from sbproxy.cli._output import (
    EXIT_INVALID,
    EXIT_RUNTIME,
    configure_server_logging,
    exit_status,
    fail,
    freeze_startup_heap,
)
from sbproxy.errors import SbproxyError
from sbproxy.model_host.artifacts.proxies import proxy_settings
from sbproxy.model_host.artifacts.sources import hf_endpoint
from sbproxy.model_host.runtime import probe_worker
from sbproxy.model_host.runtime.upstream import free_port
from sbproxy.telemetry import configure_from_environment

__all__ = ["build_run_config", "run_command"]

DEPLOYMENT = "local"
# A local run keeps the context modest: Gemma 3 and Qwen declare 32k+ tokens, which would
# reserve gigabytes of KV cache per slot on a laptop for no benefit in a first completion.
RUN_CONTEXT_TOKENS = 4096


def build_run_config(
    *,
    model: str,
    variant: str,
    engine: str,
    name: str,
    port: int,
    admin_port: int,
    password: str,
    cache_dir: Path | None,
) -> dict[str, Any]:
    """The configuration ``sbproxy run`` serves (see the module docstring)."""
    model_host: dict[str, Any] = {
        "engines": {"llama_cpp": {"launch": "binary", "acceleration": "auto"}},
        "deployments": {
            DEPLOYMENT: {
                "model": model,
                "variant": variant,
                "engine": engine,
                "pull": "on_boot",
                "warm": True,
                "max_context": RUN_CONTEXT_TOKENS,
                "max_concurrency": 2,
            }
        },
    }
    if cache_dir is not None:
        model_host["cache"] = {"directory": str(cache_dir)}
    provider = {
        "name": "local",
        "provider_type": "managed_model",
        "deployment": DEPLOYMENT,
        "models": [name],
        "default_model": name,
    }
    action = {"type": "ai_proxy", "providers": [provider]}
    return {
        "proxy": {
            "http_bind_port": port,
            "bind_address": "127.0.0.1",
            "admin": {
                "enabled": True,
                "bind": "127.0.0.1",
                "port": admin_port,
                "username": "admin",
                "password": password,
            },
            "model_host": model_host,
        },
        "origins": {host: {"action": copy.deepcopy(action)} for host in ("127.0.0.1", "localhost")},
    }


@contextlib.contextmanager
def private_config(document: dict[str, Any]) -> Iterator[Path]:
    """Write ``document`` to an owner-only temporary file; remove it on every exit path."""
    directory = Path(tempfile.mkdtemp(prefix=f"sbproxy-run-{os.getpid()}-"))
    try:
        path = directory / "sb.yml"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            yaml.safe_dump(document, handle, sort_keys=False)
        yield path
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _refuse_raw(model: str) -> None:
    if model.startswith("hf:") or "/" in model or ":" in model:
        fail(
            "run",
            SbproxyError(
                f"{model!r} is a raw model reference, which bypasses the catalog's pinned identity",
                code="raw_reference_refused",
                remediation="Add it to an operator catalog and serve it with `sbproxy serve`; "
                "`sbproxy models list` shows the certified ids.",
            ),
            output_format="text",
        )


def banner(*, name: str, port: int, admin_port: int, password: str, chat: bool = True) -> str:
    """What ``run`` prints once the deployment is ready; the Try: line is a chat request, or
    a completion for a completion-only (base) model (``chat``: false)."""
    base = f"http://127.0.0.1:{port}"
    if chat:
        example = (
            f"Try: curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{name}", "messages": [{{"role": "user", '
            '"content": "Hello"}]}\'\n'
        )
    else:
        example = (
            f"{name} completes text (it has no chat template): use /v1/completions\n"
            f"Try: curl -s {base}/v1/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{name}", "prompt": "Once upon a time"}}\'\n'
        )
    return (
        f"\n{name} is ready on {base}\n"
        f"Admin: http://127.0.0.1:{admin_port}\n"
        "Admin username: admin\n"
        f"Admin password: {password}\n"
        f"export OPENAI_BASE_URL={base}/v1\n"
        "export OPENAI_API_KEY=local\n" + example
    )


@click.command("run")
@click.argument("model")
@click.option("--variant", default=None, help="Exact catalog variant (default: best fit here).")
@click.option("--name", default=None, help="Public model name (default: MODEL).")
@click.option("--port", type=int, default=8080, show_default=True, help="Gateway port.")
@click.option("--admin-port", type=int, default=None, help="Admin port (default: a free one).")
@click.option(
    "--engine", type=click.Choice(["auto", "llama_cpp", "vllm"]), default="auto", show_default=True
)
@click.option(
    "--cache-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
    help="Cache root (default: $SBPROXY_CACHE_DIR or the platform's).",
)  # fmt: skip
@click.option("--dry-run", is_flag=True, help="Print the generated configuration and exit.")
def run_command(
    model: str,
    variant: str | None,
    name: str | None,
    port: int,
    admin_port: int | None,
    engine: str,
    cache_dir: Path | None,
    dry_run: bool,
) -> None:
    """Serve one certified catalog MODEL on this machine with the canonical runtime."""
    _refuse_raw(model)
    try:
        request = ArtifactRequest.model_validate(
            {"model": model, "variant": variant, "engine": engine}
        )
        artifact = resolve_artifact(load_builtin_catalog(), request, probe_worker()).artifact
        hf_endpoint()  # credentials in HF_ENDPOINT: refused before anything is written
        proxy_settings()  # a proxy variable that cannot be used: refused the same way
    except SbproxyError as exc:
        fail("run", exc, output_format="text", exit_code=EXIT_INVALID)
    public = name or model
    admin = admin_port or free_port()
    if admin == port:
        fail(
            "run",
            SbproxyError("--admin-port must differ from --port", code="invalid_port"),
            output_format="text",
        )
    password = secrets.token_hex(32)
    document = build_run_config(
        model=model,
        variant=artifact.variant_id,
        engine=str(artifact.engine),
        name=public,
        port=port,
        admin_port=admin,
        password=password,
        cache_dir=cache_dir.absolute() if cache_dir else None,
    )
    if dry_run:
        click.echo(f"# resolved {model}:{artifact.variant_id} with {artifact.engine}")
        from sbproxy.model_host.artifacts import resolve_cache_root

        click.echo(f"# cache: {resolve_cache_root(cache_dir).root}")
        shown = yaml.safe_dump(document, sort_keys=False).replace(
            password, "<generated at run time>"
        )
        click.echo(shown, nl=False)
        return
    click.echo(
        f"Preparing {model}:{artifact.variant_id} with {artifact.engine}. "
        "Artifact and engine progress follows on stderr.",
        err=True,
    )
    with private_config(document) as path:
        outcome = _serve(path, public=public, port=port, admin_port=admin, password=password)
    sys.exit(outcome)


def _serve(path: Path, *, public: str, port: int, admin_port: int, password: str) -> int:
    """Serve the generated configuration until Ctrl-C; the exit status."""
    # The server stack is imported only for a real run: --dry-run and refusals stay fast.
    from sbproxy.api.host import ServedHost
    from sbproxy.api.server import run_served, serve
    from sbproxy.cli._discovery import RunRecord, published
    from sbproxy.config import load_config
    from sbproxy.model_host.runtime.state import DeploymentState
    from sbproxy.workflows import process_start_ticks

    failure: list[str] = []
    discovery = contextlib.ExitStack()

    async def watch(host: ServedHost) -> None:
        status = host.manager.snapshot(DEPLOYMENT)
        followed: str | None = None
        while status.state != DeploymentState.READY:
            if status.job_id and status.job_id != followed:
                followed = status.job_id
                host.group.start_soon(_follow, host, followed)
            if status.state == DeploymentState.FAILED:
                failure.append(f"{status.reason_code}: {status.last_error}")
                if host.stop is not None:  # drains and stops the listeners, as SIGTERM would
                    host.stop.stop_self(f"{DEPLOYMENT} failed to load ({status.reason_code})")
                return
            await anyio.sleep(0.2)
            status = host.manager.snapshot(DEPLOYMENT)
        record = RunRecord(
            admin_url=f"http://127.0.0.1:{admin_port}",
            username="admin",
            password=password,
            gateway_url=f"http://127.0.0.1:{port}",
            pid=os.getpid(),
            start_ticks=process_start_ticks(os.getpid()) or "0",
        )
        # Found by `models ps|load|stop` and `apply` while this run serves; removed on exit.
        discovery.enter_context(published(record))
        click.echo(
            banner(
                name=public,
                port=port,
                admin_port=admin_port,
                password=password,
                chat=host.manager.can_chat(DEPLOYMENT),
            )
        )
        freeze_startup_heap()

    configure_server_logging()
    configure_from_environment()  # OTLP traces when OTEL_EXPORTER_OTLP_ENDPOINT is set
    try:
        compiled = load_config(path)
        fields = {"proxy.http_bind_port": "--port", "proxy.admin.port": "--admin-port"}
        with discovery:
            run_served(lambda: serve(compiled, watch=watch, listener_fields=fields))
    except SbproxyError as exc:
        click.echo(f"sbproxy run: {exc}", err=True)
        return exit_status(exc)
    if failure:
        click.echo(f"sbproxy run: {failure[0]}", err=True)
        return EXIT_RUNTIME
    return 0


async def _follow(host: Any, job_id: str) -> None:
    from sbproxy.cli._event_view import open_view
    from sbproxy.cli._live import follow
    from sbproxy.store import wall_clock_ms

    await follow(
        host.engine, job_id, after_seq=0, view=open_view(job_id, live_from_ms=wall_clock_ms())
    )
