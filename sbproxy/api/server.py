"""``sbproxy serve``: the gateway and admin listeners, the runtime and the job worker in one
process and one event loop.

Why uvicorn: it is the ASGI server Litestar documents and tests against, runs inside an
event loop we already own (``Server.serve()`` is a coroutine, so two listeners, the runtime
manager and the worker loop share one anyio task group and one loop -- the manager's state
has one owner), supports graceful shutdown with a deadline
(``timeout_graceful_shutdown``) and TLS for the admin listener, and with uvloop and
httptools (``uvicorn[standard]``) it measured as fast as Granian for this proxy
(``measured-here.md``). uvicorn picks uvloop only for loops it creates itself; we own the
loop, so :func:`run_served` asks anyio for a uvloop loop where uvloop is installed.
Multi-process servers are ruled out: engines and admission live in this one process.

Shutdown (SIGTERM, SIGINT): both listeners stop accepting and let in-flight requests finish
within ``shutdown_deadline_ms``; then the runtime drains every deployment within the same
deadline and stops its engine; the worker loop is cancelled and unfinished jobs stay in the
journal, to resume at the next start. A second SIGINT forces the listeners closed.

Reload: ``SIGHUP`` and, when ``watch_config`` is on, a change of the configuration file
(watched with ``watchfiles``, which coalesces an editor's bursts of writes and renames) run
the reload transaction (``model_host/runtime/reload.py``) against the file, as
``POST /admin/reload`` and ``sbproxy apply`` do. A file that does not validate, or a
candidate that cannot be prepared, is logged with its reason and leaves everything running
as it was. A committed reload hands the gateway its new routes and keys.
"""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import logging
import signal
from collections.abc import Callable, Coroutine, Generator
from pathlib import Path
from typing import Any

import anyio
import uvicorn

from sbproxy.api.admin import Admin, create_admin_app
from sbproxy.api.gateway import Gateway, Routing, create_gateway_app
from sbproxy.api.host import ServedHost, open_host
from sbproxy.api.keys import KeyPlane
from sbproxy.api.metrics import Disconnects, Rejections
from sbproxy.config import CompiledConfig
from sbproxy.errors import SbproxyError
from sbproxy.model_host.lockfile import lock_guard
from sbproxy.model_host.runtime.reload import reload_from_source

__all__ = ["Listener", "build_servers", "loop_options", "run_served", "serve"]

logger = logging.getLogger(__name__)


class Listener(uvicorn.Server):
    """A uvicorn server that leaves signals to :func:`serve` (two servers share them)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    @property
    def address(self) -> str:
        """``http(s)://host:port`` of this listener."""
        config = self.config
        scheme = "https" if config.ssl_certfile else "http"
        host = config.host
        if ":" in host:
            host = f"[{host}]"
        return f"{scheme}://{host}:{config.port}"


def _url_host(bind: str) -> str:
    return str(ipaddress.ip_address(bind)) if bind else "127.0.0.1"


def build_servers(
    compiled: CompiledConfig, host: ServedHost
) -> tuple[list[Listener], Gateway, Admin | None]:
    """The gateway listener and, when enabled, the admin listener of ``compiled``."""
    proxy = compiled.config.proxy
    deadline_s = max(1, round(host.manager.shutdown_deadline_s))
    rejections = Rejections()
    disconnects = Disconnects()
    gateway = Gateway(
        manager=host.manager,
        routing=Routing(compiled.routes),
        keys=KeyPlane(list(proxy.api_keys)),
        rejections=rejections,
        disconnects=disconnects,
    )

    def swap(candidate: CompiledConfig) -> None:
        keys = KeyPlane(list(candidate.config.proxy.api_keys))
        gateway.routing = Routing(candidate.routes)
        gateway.keys = keys
        # The ledger re-sums each key's window under its new budget (pending usage first).
        host.manager.background(lambda: gateway.usage.reconfigure(keys.budgets))

    host.manager.on_commit.append(swap)
    common = {
        "lifespan": "on",
        "log_level": "warning",
        "access_log": False,
        "timeout_graceful_shutdown": deadline_s,
        "server_header": False,
    }
    servers = [
        Listener(
            uvicorn.Config(
                create_gateway_app(gateway),
                host=_url_host(proxy.bind_address),
                port=proxy.http_bind_port,
                **common,  # type: ignore[arg-type]
            )
        )
    ]
    admin: Admin | None = None
    settings = proxy.admin
    if settings.enabled:
        assert settings.password is not None  # noqa: S101 - config requires it when enabled
        admin = Admin(
            manager=host.manager,
            username=settings.username,
            password=settings.password.get_secret_value(),
            rejections=rejections,
            allowlist=tuple(settings.ip_allowlist),
            usage=gateway.usage,
            disconnects=disconnects,
        )
        tls = settings.tls
        servers.append(
            Listener(
                uvicorn.Config(
                    create_admin_app(admin),
                    host=_url_host(settings.bind),
                    port=settings.port,
                    ssl_certfile=tls.cert_file if tls else None,
                    ssl_keyfile=tls.key_file if tls else None,
                    **common,  # type: ignore[arg-type]
                )
            )
        )
    return servers, gateway, admin


async def reload_logged(host: ServedHost, *, source: str) -> None:
    """Reload from the configuration file; log the outcome (never raises a reload error)."""
    try:
        job_id, report = await reload_from_source(host.manager, source=source)
    except SbproxyError as exc:
        logger.error("reload (%s) refused, nothing changed: [%s] %s", source, exc.code, exc)
        return
    plan = report.plan
    logger.warning(
        "reload (%s) committed revision %d (job %s): added %s, changed %s, removed %s, "
        "preserved %s",
        source,
        report.revision,
        job_id,
        list(plan.added),
        list(plan.changed),
        list(plan.removed),
        list(plan.preserved),
    )


async def _watch_config(host: ServedHost) -> None:
    import watchfiles

    source = host.manager.compiled.source
    if source is None:
        return
    path = source.resolve()
    async for changes in watchfiles.awatch(path.parent, recursive=False):
        if any(Path(changed).resolve() == path for _, changed in changes):
            await reload_logged(host, source="watch")


async def _on_signals(servers: list[Listener], host: ServedHost) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for received in signals:
            if received == signal.SIGHUP:
                host.manager.background(lambda: reload_logged(host, source="sighup"))
                continue
            if received == signal.SIGINT and all(s.should_exit for s in servers):
                for server in servers:
                    server.force_exit = True
            logger.info("received %s: shutting down", signal.Signals(received).name)
            for server in servers:
                server.should_exit = True


def loop_options() -> dict[str, Any]:
    """anyio ``backend_options`` for the server's loop: uvloop when it is installed."""
    return {"use_uvloop": True} if importlib.util.find_spec("uvloop") is not None else {}


def run_served(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``main`` (a :func:`serve` call) on a new event loop, uvloop where available."""
    anyio.run(main, backend="asyncio", backend_options=loop_options())


async def serve(
    compiled: CompiledConfig,
    *,
    cache_dir: Path | None = None,
    on_listening: Callable[[list[str]], None] | None = None,
    watch: Callable[[ServedHost], Coroutine[Any, Any, None]] | None = None,
    watch_config: bool = False,
    lockfile: Path | None = None,
) -> None:
    """Run the host of ``compiled`` until SIGTERM or SIGINT (see the module docstring).

    Args:
        compiled: The loaded configuration.
        cache_dir: Overrides ``proxy.model_host.cache.directory``.
        on_listening: Called once with the listeners' addresses when all are accepting.
        watch: Started beside the listeners once they accept (``sbproxy run`` follows its
            deployment's readiness with it); it may stop the server by sending this process
            SIGTERM.
        watch_config: Reload when the configuration file changes (``SIGHUP`` always
            reloads).
        lockfile: ``serve --locked``: every file reload must still match this lockfile
            (``lock_drift`` refuses it and changes nothing); the start was checked already.

    Raises:
        SbproxyError: ``listen_failed`` when a listener cannot start (port in use, ...).
    """
    failed = False
    async with open_host(compiled, cache_dir=cache_dir) as host:
        if lockfile is not None:
            host.manager.config_guard = lock_guard(lockfile, host.manager)
        servers, _, _ = build_servers(compiled, host)
        async with anyio.create_task_group() as group:
            group.start_soon(_on_signals, servers, host)
            if watch_config:
                group.start_soon(_watch_config, host)
            try:
                async with anyio.create_task_group() as listeners:
                    for server in servers:
                        listeners.start_soon(server.serve)
                    while not all(s.started for s in servers):
                        if any(s.should_exit for s in servers):
                            break
                        await anyio.sleep(0.05)
                    else:
                        if on_listening is not None:
                            on_listening([s.address for s in servers])
                        if watch is not None:
                            group.start_soon(watch, host)
            except* SystemExit:  # uvicorn exits when a socket cannot be bound
                failed = True
                for server in servers:
                    server.should_exit = True
            finally:
                group.cancel_scope.cancel()
    if failed:
        raise SbproxyError(
            "a listener could not start (is the port in use?)",
            code="listen_failed",
            remediation="Free the port or change proxy.http_bind_port / proxy.admin.port.",
        )
