"""``sbproxy models ps``, ``models load`` and ``models stop``: the live runtime through the
admin API.

Only the running server owns engine processes, so these verbs talk to its authenticated
admin API: ``--admin-url`` (env ``SB_ADMIN_URL``), ``--username`` (``SB_ADMIN_USERNAME``,
default ``admin``) and ``--password`` (``SB_ADMIN_PASSWORD``; never printed). What the flags
and environment leave unset comes from a running ``sbproxy run``'s discovery file
(:mod:`sbproxy.cli._discovery`); without one the URL defaults to ``http://127.0.0.1:9090``
and a password is required. Connect timeout 3 s, request timeout 30 s.

A loopback admin URL is always called directly: ``HTTP_PROXY``/``HTTPS_PROXY`` (which the
artifact downloads honour) would otherwise hand the admin password to a forward proxy. Only
an admin URL on another host follows the proxy variables, as any HTTP client would.
"""

from __future__ import annotations

import functools
import ipaddress
import sys
import time
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import click
import httpx

from sbproxy.cli._output import (
    EXIT_INTERRUPTED,
    EXIT_INVALID,
    EXIT_RUNTIME,
    emit_json,
    fail,
    format_option,
)
from sbproxy.errors import SbproxyError

__all__ = [
    "admin_call",
    "admin_options",
    "devices_cell",
    "load_command",
    "ps_command",
    "stop_command",
]

F = TypeVar("F", bound=Callable[..., Any])
TERMINAL = {"succeeded", "failed", "cancelled", "parked"}


DEFAULT_ADMIN_URL = "http://127.0.0.1:9090"


def admin_options(func: F) -> F:
    """The three admin connection options, completed from a running ``sbproxy run``.

    Flags and environment win. A missing URL, or a missing password, is taken from the
    newest live ``sbproxy run`` of this user -- its password only for its own URL.

    Raises (exit 2):
        SbproxyError: ``admin_password_required`` when no password is given or found.
    """

    @functools.wraps(func)
    def resolved(
        *args: Any, admin_url: str | None, username: str, password: str | None, **kw: Any
    ) -> Any:
        if admin_url is None or password is None:
            from sbproxy.cli._discovery import find_run

            run = find_run()
            if run is not None and admin_url in (None, run.admin_url):
                admin_url = run.admin_url
                if password is None and username == run.username:
                    password = run.password
        offline = getattr(func, "offline_with_config", False)
        if password is None and offline and kw.get("config_path") is not None:
            password = ""  # the verb works on the journal of -f itself: no admin API
        if password is None:
            context = click.get_current_context(silent=True)
            words = context.command_path.split()[1:] if context is not None else []
            fail(
                ".".join(words) or "admin",
                SbproxyError(
                    "no admin password: none was given and no running `sbproxy run` was found",
                    code="admin_password_required",
                    remediation="Pass --password or set SB_ADMIN_PASSWORD (and --admin-url / "
                    "SB_ADMIN_URL for a `sbproxy serve`), or start `sbproxy run MODEL`.",
                ),
                output_format=str(kw.get("output_format", "text")),
                exit_code=EXIT_INVALID,
            )
        return func(
            *args,
            admin_url=admin_url or DEFAULT_ADMIN_URL,
            username=username,
            password=password,
            **kw,
        )

    wrapped: Any = resolved
    wrapped = click.option(
        "--password",
        envvar="SB_ADMIN_PASSWORD",
        default=None,
        help="Admin password (env SB_ADMIN_PASSWORD; default: a running `sbproxy run`'s).",
    )(wrapped)
    wrapped = click.option(
        "--username", envvar="SB_ADMIN_USERNAME", default="admin", show_default=True
    )(wrapped)
    wrapped = click.option(
        "--admin-url",
        envvar="SB_ADMIN_URL",
        default=None,
        help=f"Admin API base URL (env SB_ADMIN_URL; default: a running `sbproxy run`'s, "
        f"else {DEFAULT_ADMIN_URL}).",
    )(wrapped)
    return typing.cast("F", wrapped)


def _is_loopback(url: str) -> bool:
    host = httpx.URL(url).host
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class AdminRefusal(Exception):
    """The admin API answered ``status`` >= 400: its reason code, message, and the seconds
    its ``Retry-After`` asks for (``None``: none given)."""

    def __init__(self, status: int, body: dict[str, Any], retry_after_s: float | None) -> None:
        self.status = status
        self.code = str(body.get("code") or body.get("reason_code") or "")
        self.message = str(body.get("error") or "")
        self.retry_after_s = retry_after_s
        super().__init__(self.code)

    def error(self) -> SbproxyError:
        """What the CLI reports for it."""
        detail = f": {self.message}" if self.message and self.message != self.code else ""
        return SbproxyError(
            f"admin request returned HTTP {self.status}: {self.code}{detail}",
            code=self.code or "admin_error",
        )

    @property
    def exit_code(self) -> int:
        # The server's reason code decides first (a 503 journal_unavailable is a refusal,
        # exit 2, as from a verb that reads the journal itself).
        return EXIT_INVALID if self.status in (400, 401, 404, 409, 422) else EXIT_RUNTIME


def admin_request(
    method: str, url: str, *, auth: tuple[str, str], json_body: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One admin API call; its JSON body.

    Raises:
        SbproxyError: ``admin_unreachable`` -- no answer from ``url``.
        AdminRefusal: an answer of HTTP 400 or more.
    """
    try:
        response = httpx.request(
            method,
            url,
            auth=auth,
            json=json_body,
            timeout=httpx.Timeout(30.0, connect=3.0),
            trust_env=not _is_loopback(url),
        )
    except httpx.HTTPError as exc:
        raise SbproxyError(
            f"cannot reach the admin API at {url}: {type(exc).__name__}",
            code="admin_unreachable",
            remediation="Is `sbproxy serve` running with proxy.admin.enabled? Check "
            "--admin-url / SB_ADMIN_URL.",
        ) from exc
    try:
        body: dict[str, Any] = response.json()
    except ValueError:
        body = {}
    if response.status_code >= 400:
        retry_after = response.headers.get("Retry-After", "")
        raise AdminRefusal(
            response.status_code,
            body,
            float(retry_after) if retry_after.isdigit() else None,
        )
    return body


def admin_call(
    command: str,
    method: str,
    url: str,
    *,
    auth: tuple[str, str],
    output_format: str,
    json_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """:func:`admin_request`, its failure reported and the CLI ended (exit 2 for a refusal
    of what was asked, 1 otherwise, or as the reason code says)."""
    try:
        return admin_request(method, url, auth=auth, json_body=json_body)
    except AdminRefusal as refusal:
        fail(command, refusal.error(), output_format=output_format, exit_code=refusal.exit_code)
    except SbproxyError as exc:
        fail(command, exc, output_format=output_format, exit_code=EXIT_RUNTIME)


@click.command("ps")
@click.option(
    "--fleet",
    "fleet",
    is_flag=True,
    help="Every replica of the fleet (cluster_authority): node, state, generation, port, "
    "active/queued as each node last reported; then where each artifact is cached.",
)
@admin_options
@format_option
def ps_command(
    fleet: bool, admin_url: str, username: str, password: str, output_format: str
) -> None:
    """Show running deployments: state, port, active and queued requests, reason."""
    if fleet:
        _fleet_ps(admin_url, username, password, output_format)
        return
    body = admin_call(
        "models.ps",
        "GET",
        f"{admin_url.rstrip('/')}/admin/model-host/status",
        auth=(username, password),
        output_format=output_format,
    )
    if output_format == "json":
        emit_json("models.ps", body)
        return
    rows = body.get("deployments", [])
    _print_table(
        ("DEPLOYMENT", "STATE", "GEN", "PORT", "ACTIVE", "QUEUED", "DEVICES", "REASON"),
        [
            (
                str(r.get("deployment")),
                str(r.get("state")),
                str(r.get("generation")),
                str(r.get("port") or "-"),
                str(r.get("active_requests")),
                str(r.get("queued_requests")),
                devices_cell(r.get("selected_devices")),
                str(r.get("reason_code") or "-"),
            )
            for r in rows
        ],
    )
    # A failed deployment's retained error (a crash, an exhausted load job) says what to fix.
    for r in rows:
        if r.get("state") == "failed" and r.get("last_error"):
            job = f" (job {r['job_id']})" if r.get("job_id") else ""
            click.echo(f"{r.get('deployment')}: {r.get('reason_code')}{job}: {r['last_error']}")


def devices_cell(devices: object) -> str:
    """``-`` (none), ``0`` (one device) or ``0,1 tp2`` (split across several)."""
    if not isinstance(devices, list) or not devices:
        return "-"
    listed = ",".join(str(device) for device in devices)
    return listed if len(devices) == 1 else f"{listed} tp{len(devices)}"


def _print_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    table = [header, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))


def _fleet_ps(admin_url: str, username: str, password: str, output_format: str) -> None:
    """``models ps --fleet``: every placement with its node's reported runtime, then where
    each artifact is cached (``artifacts`` in the JSON form)."""
    body = admin_call(
        "models.ps",
        "GET",
        f"{admin_url.rstrip('/')}/admin/fleet/placements",
        auth=(username, password),
        output_format=output_format,
    )
    if output_format == "json":
        emit_json("models.ps", {**body, "fleet": True})
        return
    rows: list[tuple[str, ...]] = []
    for placement in body.get("placements", []):
        runtime = placement.get("runtime") or {}
        rows.append(
            (
                str(placement["deployment"]),
                str(placement["replica"]),
                # A split: its leader's node, then every other worker's.
                "+".join(
                    [
                        str(placement["node"]),
                        *(str(w["node"]) for w in (placement.get("workers") or [])[1:]),
                    ]
                ),
                f"{placement['state']}/{placement.get('node_state') or '?'}"
                + (f" stuck:{placement['stuck']}" if placement.get("stuck") else ""),
                str(placement.get("variant") or "-"),
                str(placement.get("estimate_basis") or "-"),
                str(runtime.get("state") or "-"),
                str(runtime.get("generation") or "-"),
                str(runtime.get("port") or "-"),
                str(runtime.get("active", "-")),
                str(runtime.get("queued", "-")),
            )
        )
    _print_table(
        (
            "DEPLOYMENT",
            "REPLICA",
            "NODE",
            "PLACEMENT/NODE",
            "VARIANT",
            "ESTIMATE",
            "STATE",
            "GEN",
            "PORT",
            "ACTIVE",
            "QUEUED",
        ),
        rows,
    )
    artifacts = body.get("artifacts") or []
    if artifacts:
        click.echo("")
        _print_table(
            ("ARTIFACT", "SIZE", "CACHED ON", "PULLING"),
            [
                (
                    f"sha256:{str(row['artifact_digest'])[:12]}",
                    _gib(int(row.get("size_bytes") or 0)),
                    ",".join(row.get("nodes") or []) or "-",
                    ",".join(row.get("fetching") or []) or "-",
                )
                for row in artifacts
            ],
        )


def _gib(size: int) -> str:
    """``size`` bytes as ``1.00 GiB`` / ``12.5 MiB``."""
    if size >= 1 << 30:
        return f"{size / (1 << 30):.2f} GiB"
    return f"{size / (1 << 20):.1f} MiB"


def _lifecycle(
    command: str,
    route: str,
    deployment: str,
    *,
    wait: bool,
    done_state: str,
    admin_url: str,
    username: str,
    password: str,
    output_format: str,
) -> None:
    """POST a lifecycle route, optionally follow its job, report the outcome."""
    base = admin_url.rstrip("/")
    auth = (username, password)
    try:
        body = admin_call(
            command,
            "POST",
            f"{base}/admin/model-host/{route}",
            auth=auth,
            output_format=output_format,
            json_body={"deployment": deployment},
        )
    except KeyboardInterrupt:
        click.echo(
            f"sbproxy {command.replace('.', ' ')}: interrupted before the server answered; "
            f"the command may have been taken: `sbproxy models ps` shows {deployment}'s state.",
            err=True,
        )
        sys.exit(EXIT_INTERRUPTED)
    if wait and body.get("job_id"):
        job = _follow(command, base, str(body["job_id"]), auth=auth, output_format=output_format)
        body["job"] = job
        body["state"] = done_state if job.get("status") == "succeeded" else job.get("status")
    if output_format == "json":
        emit_json(command, body)
    else:
        click.echo(
            f"{deployment} {body.get('state')}"
            + (f" (job {body['job_id']})" if body.get("job_id") else "")
        )
    if wait and body.get("job", {}).get("status") not in (None, "succeeded"):
        sys.exit(EXIT_RUNTIME)


# How long --wait follows a job, in seconds.
FOLLOW_S = 600.0


def _follow(
    command: str, base: str, job_id: str, *, auth: tuple[str, str], output_format: str
) -> dict[str, Any]:
    """Follow job ``job_id`` until it ends (or :data:`FOLLOW_S` passed); the job as last
    read. A retryable refusal on the way (``503 journal_unavailable``: the journal went away
    while the job runs) is waited out, said once on stderr; the job goes on meanwhile. One
    that lasts past the deadline fails naming the job, to follow with ``sbproxy jobs watch``.
    """
    try:
        return _follow_until_done(command, base, job_id, auth=auth, output_format=output_format)
    except KeyboardInterrupt:
        # The job runs in the server, not here: it goes on.
        click.echo(
            f"sbproxy {command.replace('.', ' ')}: interrupted; job {job_id} goes on in the "
            f"server: `sbproxy jobs watch {job_id}` follows it.",
            err=True,
        )
        sys.exit(EXIT_INTERRUPTED)


def _follow_until_done(
    command: str, base: str, job_id: str, *, auth: tuple[str, str], output_format: str
) -> dict[str, Any]:
    deadline = time.monotonic() + FOLLOW_S
    job: dict[str, Any] = {}
    told = False
    while True:
        pause = 0.2
        try:
            job = admin_request("GET", f"{base}/admin/model-host/jobs/{job_id}", auth=auth).get(
                "job", {}
            )
        except AdminRefusal as refusal:
            if refusal.status != 503 or time.monotonic() >= deadline:
                error = _naming_job(refusal.error(), job_id)
                fail(command, error, output_format=output_format, exit_code=refusal.exit_code)
            if not told:
                click.echo(f"sbproxy: {refusal.error()} -- still following job {job_id}", err=True)
                told = True
            pause = max(pause, refusal.retry_after_s or 1.0)
        except SbproxyError as exc:
            error = _naming_job(exc, job_id)
            fail(command, error, output_format=output_format, exit_code=EXIT_RUNTIME)
        if job.get("status") in TERMINAL:
            return job
        if time.monotonic() >= deadline:
            error = SbproxyError(
                f"job {job_id} is still {job.get('status', 'running')} after {FOLLOW_S:g} s "
                "of following",
                code="wait_timeout",
                remediation=f"It goes on in the server: `sbproxy jobs watch {job_id}`.",
                details={"job_id": job_id},
            )
            fail(command, error, output_format=output_format, exit_code=EXIT_RUNTIME)
        time.sleep(pause)


def _naming_job(error: SbproxyError, job_id: str) -> SbproxyError:
    """``error`` with what to do about the job it interrupted the following of."""
    follow = f"Job {job_id} was submitted and may still run: `sbproxy jobs watch {job_id}`."
    error.remediation = f"{error.remediation} {follow}" if error.remediation else follow
    error.details["job_id"] = job_id
    return error


@click.command("stop")
@click.argument("deployment")
@click.option("--wait", is_flag=True, help="Follow the drain job until it ends.")
@admin_options
@format_option
def stop_command(
    deployment: str, wait: bool, admin_url: str, username: str, password: str, output_format: str
) -> None:
    """Drain DEPLOYMENT and stop its engine (the artifact stays cached)."""
    _lifecycle(
        "models.stop",
        "stop",
        deployment,
        wait=wait,
        done_state="stopped",
        admin_url=admin_url,
        username=username,
        password=password,
        output_format=output_format,
    )


@click.command("load")
@click.argument("deployment")
@click.option("--wait", is_flag=True, help="Follow the load job until it ends.")
@admin_options
@format_option
def load_command(
    deployment: str, wait: bool, admin_url: str, username: str, password: str, output_format: str
) -> None:
    """Prepare and warm DEPLOYMENT in the running server (pull, engine, launch)."""
    _lifecycle(
        "models.load",
        "load",
        deployment,
        wait=wait,
        done_state="ready",
        admin_url=admin_url,
        username=username,
        password=password,
        output_format=output_format,
    )
