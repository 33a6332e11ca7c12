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

Shutdown (SIGTERM, SIGINT; :mod:`sbproxy.api.shutdown`): one deadline, computed when the
signal arrives, bounds the whole stop. Both listeners stop accepting; requests in flight get
until ``shutdown_deadline_ms``; what is left then is ended with a clean 503
``shutting_down`` (or a last error event on a stream); the runtime stops the engines in
what remains of the budget; the worker loop is cancelled and unfinished jobs stay in the
journal, to resume at the next start. The process ends within the deadline plus 2 s, with no
traceback. A second SIGINT or SIGTERM ends everything at once and kills the engines. Stop
signals are handled from before the host starts until after its engines are stopped.

Reload: ``SIGHUP`` and, when ``watch_config`` is on, a change of the configuration file's
content (:mod:`sbproxy.api.config_watch`: every directory its path leads through is
watched -- a ConfigMap's symlink swap, a rename, an edit in place -- and the content's
SHA-256 compared with the active one) run the reload transaction
(``model_host/runtime/reload.py``) against the file, as ``POST /admin/reload`` and
``sbproxy apply`` do. A file that does not validate, or a candidate that cannot be
prepared, is logged with its reason and leaves everything running as it was. A committed
reload hands the gateway its new routes and keys. Every attempt is recorded in the host's
:class:`~sbproxy.api.config_state.ConfigState` (the status route's ``config`` object).
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import ipaddress
import logging
import signal
import socket
from collections.abc import Callable, Coroutine, Generator, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import uvicorn
from litestar.handlers import HTTPRouteHandler
from litestar.types import ASGIApp

from sbproxy.api.admin import Admin, create_admin_app
from sbproxy.api.config_state import ReloadSource
from sbproxy.api.config_watch import DEFAULT_POLL_INTERVAL_S, ConfigWatcher
from sbproxy.api.errors import Surface
from sbproxy.api.fleet import peer_handlers
from sbproxy.api.gateway import Gateway, Routing, create_gateway_app
from sbproxy.api.host import ServedHost, open_host
from sbproxy.api.keys import KeyPlane
from sbproxy.api.metrics import Disconnects, Rejections
from sbproxy.api.peer_blobs import peer_blob_handlers
from sbproxy.api.peers import LoneDirectory, PeerDispatch
from sbproxy.api.shutdown import Shutdown
from sbproxy.api.wake import ColdWake
from sbproxy.config import CompiledConfig, FleetConfig
from sbproxy.errors import SbproxyError
from sbproxy.fleet.admission import PeerAdmission
from sbproxy.fleet.cluster import fleet_credential, shared_credential
from sbproxy.fleet.routing import FleetDirectory, FleetWaker
from sbproxy.fleet.view import FleetStatus
from sbproxy.model_host.artifacts import ArtifactCache
from sbproxy.model_host.lockfile import lock_guard
from sbproxy.model_host.runtime.reload import reload_from_source
from sbproxy.model_host.service import ModelHostService

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


# Why a listener cannot bind, by errno: (reason code, what it means).
_BIND_FAILURES: dict[int, tuple[str, str]] = {
    errno.EADDRINUSE: ("port_in_use", "is already in use by another process"),
    errno.EACCES: ("port_not_permitted", "needs privileges this user lacks (ports below 1024)"),
    errno.EADDRNOTAVAIL: ("bind_address_unavailable", "is not an address of this machine"),
}


def check_listeners(compiled: CompiledConfig, *, fields: Mapping[str, str] | None = None) -> None:
    """Refuse to start when a listener's address cannot be bound -- before any engine or
    job starts, with one line that names the port and what to change.

    Args:
        compiled: The configuration whose gateway and admin listeners are checked.
        fields: What to tell the operator to change, by dotted config field (``sbproxy run``
            maps ``proxy.http_bind_port`` to ``--port``); default: the field itself.

    Raises:
        SbproxyError: ``port_in_use``, ``port_not_permitted`` or ``bind_address_unavailable``.
    """
    proxy = compiled.config.proxy
    wanted = [(_url_host(proxy.bind_address), proxy.http_bind_port, "proxy.http_bind_port")]
    if proxy.admin.enabled:
        wanted.append((_url_host(proxy.admin.bind), proxy.admin.port, "proxy.admin.port"))
    for address, port, field in wanted:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            try:
                probe.bind((address, port))
            except OSError as exc:
                code, meaning = _BIND_FAILURES.get(
                    exc.errno or 0, ("listen_failed", f"cannot be bound ({exc.strerror})")
                )
                where = (fields or {}).get(field, field)
                raise SbproxyError(
                    f"{address}:{port} ({field}) {meaning}",
                    code=code,
                    remediation=f"Stop what holds it or choose another port with {where}.",
                    details={"port": port, "address": address, "field": field},
                ) from None


def _fleet(compiled: CompiledConfig) -> FleetConfig:
    return compiled.model_host.fleet if compiled.model_host is not None else FleetConfig()


def _credential(compiled: CompiledConfig) -> str | None:
    return fleet_credential(compiled)


def _node_id(compiled: CompiledConfig) -> str:
    node = compiled.model_host.node.id if compiled.model_host is not None else None
    return node or "local"


def peer_dispatch(compiled: CompiledConfig, directory: FleetDirectory) -> PeerDispatch:
    """The gateway's peer dispatch over ``directory``, with the fleet credential and
    cool-down of ``compiled`` (``proxy.model_host.fleet``)."""
    dispatch = PeerDispatch(
        directory,
        credential=_credential(compiled),
        cooldown_s=_fleet(compiled).peer_cooldown_ms / 1000,
        # A cluster host's directory is its agent: it knows every member's node credential.
        admission=directory if isinstance(directory, PeerAdmission) else None,
        accept_shared=_fleet(compiled).accept_shared_credential,
    )
    if isinstance(directory, FleetWaker):
        dispatch.cold = ColdWake(directory, directory)
    return dispatch


def build_servers(
    compiled: CompiledConfig,
    host: ServedHost,
    *,
    stop: Shutdown | None = None,
    directory: FleetDirectory | None = None,
    fleet_status: FleetStatus | None = None,
) -> tuple[list[Listener], Gateway, Admin | None]:
    """The gateway listener and, when enabled, the admin listener of ``compiled``; with
    ``stop``, each app is guarded so that its requests end cleanly at the drain deadline;
    with ``directory`` (a fleet's routing table), the gateway serves every deployment of the
    fleet (:mod:`sbproxy.api.peers`); with ``fleet_status``, the console shows the fleet."""
    proxy = compiled.config.proxy
    if directory is None:
        directory = host.fleet  # a cluster host's agent keeps the fleet's routing table
    deadline_s = max(1, round(host.manager.shutdown_deadline_s))
    rejections = Rejections()
    disconnects = Disconnects()
    gateway = Gateway(
        manager=host.manager,
        routing=Routing(compiled.routes),
        keys=KeyPlane(list(proxy.api_keys)),
        rejections=rejections,
        disconnects=disconnects,
        fleet=peer_dispatch(compiled, directory) if directory is not None else None,
        deployments=compiled.deployments,
    )
    if gateway.fleet is None and _credential(compiled) is not None:
        # A host with the fleet credential takes peer hops even before it knows its peers.
        directory = LoneDirectory(_node_id(compiled))
        gateway.fleet = peer_dispatch(compiled, directory)

    def swap(candidate: CompiledConfig) -> None:
        keys = KeyPlane(list(candidate.config.proxy.api_keys))
        gateway.routing = Routing(candidate.routes)
        gateway.deployments = candidate.deployments
        gateway.keys = keys
        if gateway.fleet is not None:  # the same rotation and counts, the new credential
            gateway.fleet.configure(
                credential=_credential(candidate),
                cooldown_s=_fleet(candidate).peer_cooldown_ms / 1000,
                accept_shared=_fleet(candidate).accept_shared_credential,
            )
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

    def guarded(app: ASGIApp, surface: Surface) -> ASGIApp:
        return stop.guard(app, surface=surface) if stop is not None else app

    servers = [
        Listener(
            uvicorn.Config(
                guarded(create_gateway_app(gateway, extra=_peer_routes(host)), "gateway"),
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
            config=host.config,
            activity=gateway.activity,
            peers=gateway.fleet,
            fleet=fleet_status if fleet_status is not None else host.fleet,
            agent=host.fleet,
        )
        tls = settings.tls
        servers.append(
            Listener(
                uvicorn.Config(
                    guarded(create_admin_app(admin), "admin"),
                    host=_url_host(settings.bind),
                    port=settings.port,
                    ssl_certfile=tls.cert_file if tls else None,
                    ssl_keyfile=tls.key_file if tls else None,
                    **common,  # type: ignore[arg-type]
                )
            )
        )
    return servers, gateway, admin


async def reload_logged(
    host: ServedHost, *, source: ReloadSource, content_sha256: str | None = None
) -> None:
    """Reload from the configuration file; record the attempt in ``host.config`` and log it
    (never raises a reload error).

    Args:
        host: The served host.
        source: What asked for the reload.
        content_sha256: The digest the file watcher read, recorded with a failure (a
            committed reload records the digest of what it loaded).
    """
    try:
        job_id, report = await reload_from_source(host.manager, source=source.value)
    except SbproxyError as exc:
        attempt = host.config.failed(source, exc, content_sha256=content_sha256)
        logger.error(
            "reload (%s) %s, nothing changed: [%s] %s", source, attempt.result, exc.code, exc
        )
        return
    host.config.committed(source, job_id=job_id, revision=report.revision)
    plan = report.plan
    logger.info(  # routine: an operator's own change, not something to act on
        "reload (%s) committed revision %d (job %s, sha256 %s): added %s, changed %s, "
        "removed %s, preserved %s",
        source,
        report.revision,
        job_id,
        (host.config.content_sha256 or "-")[:12],
        list(plan.added),
        list(plan.changed),
        list(plan.removed),
        list(plan.preserved),
    )


async def _watch_config(
    host: ServedHost, stopped: anyio.Event, *, poll_interval_s: float = DEFAULT_POLL_INTERVAL_S
) -> None:
    """Reload when the configuration file's content changes, until ``stopped`` is set
    (:class:`~sbproxy.api.config_watch.ConfigWatcher`: every directory the path leads
    through is watched, and the file is looked at every ``poll_interval_s`` besides).

    The watch waits in a worker thread that a cancellation cannot interrupt (only its stop
    event, checked every 50 ms, ends the wait early), so the server sets ``stopped`` before
    cancelling this task; otherwise a shutdown would wait out the poll interval.
    """
    source = ModelHostService.serving(host.manager).served.source
    if source is None:
        return

    async def reload(digest: str) -> None:
        await reload_logged(host, source=ReloadSource.WATCH, content_sha256=digest)

    watcher = ConfigWatcher(
        path=source,
        state=host.config,
        reload=reload,
        poll_interval_s=poll_interval_s,
    )
    await watcher.run(stopped)


async def _on_stop_signals(
    stop: Shutdown, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        async for received in signals:
            stop.request(received)


async def _on_reload_signal(host: ServedHost) -> None:
    with anyio.open_signal_receiver(signal.SIGHUP) as signals:
        async for _ in signals:
            host.manager.background(lambda: reload_logged(host, source=ReloadSource.SIGHUP))


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
    listener_fields: Mapping[str, str] | None = None,
    directory: FleetDirectory | None = None,
    fleet_status: FleetStatus | None = None,
) -> None:
    """Run the host of ``compiled`` until SIGTERM or SIGINT (see the module docstring).

    Args:
        compiled: The loaded configuration.
        cache_dir: Overrides ``proxy.model_host.cache.directory``.
        on_listening: Called once with the listeners' addresses when all are accepting.
        watch: Started beside the listeners once they accept (``sbproxy run`` follows its
            deployment's readiness with it); it may stop the server with
            ``host.stop.stop_self(reason)``.
        watch_config: Reload when the configuration file changes (``SIGHUP`` always
            reloads).
        lockfile: ``serve --locked``: every file reload must still match this lockfile
            (``lock_drift`` refuses it and changes nothing); the start was checked already.
        listener_fields: Passed to :func:`check_listeners` (the flags ``run`` names).
        directory: The fleet's routing table, on a host of a fleet: the gateway serves
            every deployment of the fleet, through peers where needed.
        fleet_status: The fleet's state, for the console's fleet page.

    Raises:
        SbproxyError: ``port_in_use``, ``port_not_permitted``, ``bind_address_unavailable``
            (checked before anything starts) or ``listen_failed`` when a listener still
            cannot start.
    """
    check_listeners(compiled, fields=listener_fields)
    host_config = compiled.model_host
    stop = Shutdown(deadline_s=(host_config.shutdown_deadline_ms if host_config else 30_000) / 1000)
    error: SbproxyError | None = None
    async with anyio.create_task_group() as lifetime:
        # Stop signals are ours from before the host starts until its engines are stopped:
        # a Ctrl-C at any point drains (or, the second time, hurries) instead of raising
        # KeyboardInterrupt through the loop.
        await lifetime.start(_on_stop_signals, stop)
        lifetime.start_soon(stop.enforce)
        try:
            await _serve_host(
                compiled,
                stop=stop,
                cache_dir=cache_dir,
                on_listening=on_listening,
                watch=watch,
                watch_config=watch_config,
                lockfile=lockfile,
                directory=directory,
                fleet_status=fleet_status,
            )
            if not stop.requested:
                # Only a stop signal (or ``stop_self``) ends a healthy host; anything else
                # is a fault, and the process must not exit 0 as if it had been asked to.
                raise SbproxyError(
                    "the host stopped without a stop signal (a task it runs was cancelled "
                    "from outside; see the log above)",
                    code="host_stopped",
                    remediation="Report the log lines above; restart the server.",
                )
        except* SbproxyError as failures:
            # Raised below as itself: the CLI reports an SbproxyError by its code, and the
            # host's task groups may have wrapped it (an engine that survived SIGKILL).
            error = _first_error(failures)
        finally:
            lifetime.cancel_scope.cancel()
    if error is not None:
        raise error


def _first_error(group: BaseExceptionGroup[SbproxyError]) -> SbproxyError:
    first = group.exceptions[0]
    return _first_error(first) if isinstance(first, BaseExceptionGroup) else first


def _peer_routes(host: ServedHost) -> list[HTTPRouteHandler]:
    """The fleet's peer routes on a cluster host's gateway (:mod:`sbproxy.api.fleet`, the
    artifact blobs of :mod:`sbproxy.api.peer_blobs`), with the credential the runtime serves
    now (a reload may rotate it)."""

    # One facade per read: a reload replaces the configuration it is taken from.
    def shared() -> str | None:
        return shared_credential(ModelHostService.serving(host.manager).served)

    routes = peer_handlers(host.fleet, shared)
    if host.fleet is not None:
        cache = ArtifactCache(host.layout)
        routes += peer_blob_handlers(host.fleet.check_peer, shared, lambda: cache)
    return routes


async def _serve_host(
    compiled: CompiledConfig,
    *,
    stop: Shutdown,
    cache_dir: Path | None,
    on_listening: Callable[[list[str]], None] | None,
    watch: Callable[[ServedHost], Coroutine[Any, Any, None]] | None,
    watch_config: bool,
    lockfile: Path | None,
    directory: FleetDirectory | None = None,
    fleet_status: FleetStatus | None = None,
) -> None:
    """Open the host, serve until ``stop`` stops the listeners, shut the host down within
    what is left of the budget (the arguments are :func:`serve`'s).

    Raises:
        SbproxyError: ``listen_failed``, or an error of :func:`open_host`.
    """
    failed = False
    async with open_host(compiled, cache_dir=cache_dir, stop=stop) as host:
        stop.follow(host.manager)
        if lockfile is not None:
            host.manager.config_guard = lock_guard(lockfile, ModelHostService.serving(host.manager))
        # The configuration the runtime serves now, not the file's: a cluster host started
        # with the deployments placed on it, and the gateway must know them as its own.
        served = ModelHostService.serving(host.manager).served
        servers, _, _ = build_servers(
            served, host, stop=stop, directory=directory, fleet_status=fleet_status
        )
        stop.attach(servers)
        watcher_stopped = anyio.Event()
        async with anyio.create_task_group() as group:
            group.start_soon(_on_reload_signal, host)
            if watch_config:
                group.start_soon(_watch_config, host, watcher_stopped)
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
                watcher_stopped.set()
                group.cancel_scope.cancel()
    if failed:
        raise SbproxyError(
            "a listener could not start (is the port in use?)",
            code="listen_failed",
            remediation="Free the port or change proxy.http_bind_port / proxy.admin.port.",
        )
