"""Resumable, verified HTTP download of one file into a partial.

The body is hashed (SHA-256 for verification, BLAKE3 for the fast re-verification
fingerprint) while it streams: there is no second read of a fresh download. A resumed
download re-reads only the bytes already on disk, once, to rebuild the hash state.

Resume rules (reference section 5, "HTTP resume"):

* ``<part>`` holds the bytes, ``<part>.resume.json`` the state ``{schema_version, url,
  etag, expected_sha256, expected_size, completed_bytes}``. The state is written before the
  body and at every checkpoint (every 64 MiB or 2 s) *after* the bytes it counts were
  ``fdatasync``-ed; ``completed_bytes`` is the durable length, for progress and inspection.
* A resume needs a state that matches url, expected sha256 and size, and a non-empty ETag;
  otherwise the partial is discarded and the download restarts at 0.
* A resume starts from the partial's *length*, not from its last checkpoint: a process
  killed between checkpoints leaves its written bytes in the file (they are in the page
  cache), and refetching them would waste up to a checkpoint's worth per crash. The bytes
  on disk are re-hashed once to rebuild the streaming SHA-256 and BLAKE3 state. Whether they
  were right (after a power loss the unsynced tail may not be) the final SHA-256 decides: a
  mismatch on a resumed download discards the partial and fetches the file again from 0
  (once); only a mismatch of a download from 0 is ``digest_mismatch``.
* ``Range: bytes=N-`` with ``If-Range: <etag>``. 200 replaces the partial; 206 appends only
  if the ETag and ``Content-Range`` match; 416 at ``N == size`` with a matching total
  completes without a download; a mismatching answer discards the partial and restarts at 0
  (once).
* Redirects are followed by hand (at most 10); the bearer token is dropped on any hop to
  another origin (HF redirects file bodies to a CDN).
* Each hop goes through the forward proxy the environment names for its URL (``HTTPS_PROXY``,
  ``HTTP_PROXY``, ``ALL_PROXY``, unless ``NO_PROXY`` matches its host:
  :mod:`sbproxy.model_host.artifacts.proxies`): an ``https://`` hop through a ``CONNECT``
  tunnel (``HTTPSConnection.set_tunnel``; TLS and the certificate check stay end to end), an
  ``http://`` hop as an absolute-form request. The proxy's credentials go to the proxy only
  (``Proxy-Authorization``); the bearer token follows the same-origin rule as without one.
* A full file system is ``disk_full`` naming the partial, the bytes still needed and the
  bytes free; the partial is kept, less the last MiB, which is given back so that the job
  journal (usually on the same file system) can record the failure
  (:mod:`sbproxy.model_host.artifacts.space`).

Why a blocking ``http.client`` connection on a worker thread, not the event loop: a verified
download is CPU-bound on this project's 2-core machines (the body is copied from the socket,
hashed twice and copied into the page cache). On loopback, reading 256 MiB cost the event
loop 0.12-0.31 s of CPU with aiohttp (its parser copies every piece, and flow control
pauses the socket every 64 KiB) against 0.04-0.07 s with ``HTTPResponse.read1`` on a thread,
which receives straight into the returned buffer with the GIL released; TLS decryption
likewise runs on that thread instead of the event loop. The thread hands the bytes to
:class:`~sbproxy.model_host.artifacts._sink.PartialSink`, whose own threads hash and write
them side by side; ``benchmarks/pull.py`` measures the whole against ``curl``.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import logging
import os
import socket
import ssl
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

import anyio
import anyio.to_thread
from blake3 import blake3

from sbproxy.errors import JsonScalar
from sbproxy.model_host.artifacts._sink import PartialSink
from sbproxy.model_host.artifacts.errors import (
    DigestMismatch,
    DiskFull,
    HttpStatusError,
    SizeMismatch,
    TransportError,
)
from sbproxy.model_host.artifacts.proxies import (
    Proxy,
    ProxySettings,
    proxy_settings,
    refused,
    tunnel_status,
)
from sbproxy.model_host.artifacts.sources import same_origin
from sbproxy.model_host.artifacts.space import (
    disk_full,
    free_bytes,
    is_disk_full,
    journal_full_beside,
    release_reserve,
)

__all__ = ["DownloadResult", "RemoteFile", "download_file", "hash_file", "read_timeout_s"]

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024
# The reader hands the body over in blocks of about this size (one receive call each).
BLOCK_BYTES = 1024 * 1024
# A checkpoint fdatasyncs the partial on its own thread (the transfer does not wait for
# it): every 64 MiB or 2 s bounds the work a crash loses and keeps the dirty pages few, so
# that the final fsync is short.
CHECKPOINT_BYTES = 64 * 1024 * 1024
CHECKPOINT_SECONDS = 2.0
CONNECT_TIMEOUT_S = 15.0
PROGRESS_S = 0.25
MAX_REDIRECTS = 10
STATE_SCHEMA_VERSION = 1
# Errors of the connection itself: refused, reset, cut, timed out, TLS, malformed HTTP.
_NETWORK_ERRORS = (OSError, http.client.HTTPException)


def unreachable(url: str, exc: BaseException, *, proxy: Proxy | None = None) -> TransportError:
    """The error for a GET of ``url`` that never got an answer: it names the host (and the
    proxy it went through, never with credentials), why (the name did not resolve, the
    connection was refused or timed out) and what to do. Retryable (``transport``): the
    network may come back."""
    host = urlsplit(url).netloc or url
    if isinstance(exc, socket.gaierror):
        why = "its name does not resolve"
    elif isinstance(exc, ConnectionRefusedError):
        why = "the connection was refused"
    elif isinstance(exc, TimeoutError | socket.timeout):
        why = "it did not answer in time"
    else:
        why = f"{type(exc).__name__}: {exc}"
    remediation = (
        "Check the network or HF_ENDPOINT (a mirror), use --offline with an "
        "artifact already cached, or put the file in place with `sbproxy models import`."
    )
    if proxy is None:
        return TransportError(
            f"cannot reach {host} ({why}) for GET {url}",
            remediation=remediation,
            details={"host": host},
        )
    if isinstance(exc, ssl.SSLError | ssl.CertificateError):
        host_is = f"{host} through the proxy {proxy.shown} from {proxy.variable}"
    else:
        # Only the connection to the proxy itself can be refused, time out or fail to
        # resolve: for the host, the proxy answers with a status instead.
        host_is = f"the proxy {proxy.shown} from {proxy.variable}"
        remediation = (
            f"Check that the proxy in {proxy.variable} runs and can be reached from here, or "
            f"add {urlsplit(url).hostname} to NO_PROXY to connect directly."
        )
    return TransportError(
        f"cannot reach {host_is} ({why}) for GET {url}",
        remediation=remediation,
        details={"host": host, "proxy": proxy.shown, "variable": proxy.variable},
    )


@dataclass(frozen=True)
class RemoteFile:
    """One file to fetch: its URL (never with credentials) and what it must be."""

    url: str
    path: str
    sha256: str
    size: int


@dataclass(frozen=True)
class DownloadResult:
    """A verified partial: its SHA-256, BLAKE3, size, and where the transfer started."""

    sha256: str
    blake3: str
    size: int
    resumed_from: int
    downloaded_bytes: int


class _Restart(Exception):
    """The server's answer does not fit the partial: discard it and start from 0."""


class _Aborted(Exception):
    """The awaiting task was cancelled: the transfer thread stops at the next block."""


def read_timeout_s() -> float:
    """Seconds without a byte before a download gives up: ``$SBPROXY_HTTP_READ_TIMEOUT_S``
    or 60."""
    return float(os.environ.get("SBPROXY_HTTP_READ_TIMEOUT_S") or 60)


@cache
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()


def hash_file(path: Path, *, limit: int | None = None) -> tuple[Any, Any]:
    """SHA-256 and BLAKE3 hashers fed with the first ``limit`` bytes of ``path`` (all if
    ``None``); blocking, run it in a thread."""
    sha, b3 = hashlib.sha256(), blake3()
    remaining = limit
    with path.open("rb") as handle:
        while remaining is None or remaining > 0:
            size = CHUNK_BYTES * 4 if remaining is None else min(CHUNK_BYTES * 4, remaining)
            block = handle.read(size)
            if not block:
                break
            sha.update(block)
            b3.update(block)
            if remaining is not None:
                remaining -= len(block)
    return sha, b3


def _state_path(part: Path) -> Path:
    return part.with_name(part.name + ".resume.json")


def _write_state(part: Path, state: dict[str, Any]) -> None:
    target = _state_path(part)
    temporary = target.with_name(target.name + f".tmp.{os.getpid()}")
    try:
        with temporary.open("w") as handle:
            json.dump(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        temporary.replace(target)
    except BaseException:
        # A full disk fails the write: leave no stray temporary beside the partial.
        temporary.unlink(missing_ok=True)
        raise


def _discard(part: Path) -> None:
    part.unlink(missing_ok=True)
    _state_path(part).unlink(missing_ok=True)


def _resume_offset(part: Path, remote: RemoteFile) -> tuple[int, str | None]:
    """Bytes of ``part`` to keep (its whole length), and the ETag they came with.

    ``(0, None)`` -- and the partial discarded -- when there is no partial, no state, a
    state for another file or without an ETag, or more bytes than the file has.
    """
    state_file = _state_path(part)
    if not part.exists() or not state_file.exists():
        _discard(part)
        return 0, None
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        _discard(part)
        return 0, None
    completed = state.get("completed_bytes")
    matches = (
        state.get("schema_version") == STATE_SCHEMA_VERSION
        and state.get("url") == remote.url
        and state.get("expected_sha256") == remote.sha256
        and state.get("expected_size") == remote.size
        and isinstance(completed, int)
        and 0 <= completed <= remote.size
        and bool(state.get("etag"))
    )
    on_disk = part.stat().st_size
    if not matches or on_disk == 0 or on_disk > remote.size:
        _discard(part)
        return 0, None
    # The bytes past the last checkpoint are kept too (see the module docstring).
    return on_disk, str(state["etag"])


def partial_length(part: Path) -> int:
    """Bytes in ``part`` now (0 when it does not exist)."""
    try:
        return part.stat().st_size
    except OSError:
        return 0


def _content_range(header: str | None) -> tuple[int | None, int | None]:
    """``bytes a-b/total`` -> (a, total); ``bytes */total`` -> (None, total)."""
    if not header or not header.startswith("bytes "):
        return None, None
    span, _, total = header[6:].partition("/")
    start = None if span == "*" else int(span.split("-")[0])
    return start, int(total) if total.isdigit() else None


def _status_error(status: int, url: str, *, via: Proxy | None = None) -> HttpStatusError:
    retryable = status == 429 or status >= 500
    hint = None
    if status in (401, 403):
        hint = "The repository may be gated: export HF_TOKEN with a token that can read it."
    elif status == 404:
        hint = "Check the catalog's source, revision and file path."
    details: dict[str, JsonScalar] = {"status": status}
    through = ""
    if via is not None:
        through = f" (through the proxy {via.shown} from {via.variable})"
        details |= {"proxy": via.shown, "variable": via.variable}
    return HttpStatusError(
        f"GET {url}{through} answered HTTP {status}",
        retryable=retryable,
        remediation=hint,
        details=details,
    )


class _Transfer:
    """One download, run on a worker thread; :meth:`abort` may be called from another."""

    def __init__(
        self,
        remote: RemoteFile,
        *,
        part: Path,
        token: str | None,
        check_cancelled: Callable[[], None],
        read_timeout: float,
        connect_timeout: float,
        proxies: ProxySettings,
        origin_headers: Mapping[str, str] | None = None,
    ) -> None:
        self.remote = remote
        self.proxies = proxies
        self.part = part
        self.token = token
        self.origin_headers = dict(origin_headers or {})
        self.durable = 0  # bytes of the partial on disk and in its resume state
        self.check_cancelled = check_cancelled
        self.read_timeout = read_timeout
        self.connect_timeout = connect_timeout
        self.aborted = threading.Event()
        self._lock = threading.Lock()
        self._connection: http.client.HTTPConnection | None = None
        self._via: Proxy | None = None  # the proxy of the last hop

    def abort(self) -> None:
        """Stop the transfer: shut its socket down so that a blocked read returns now."""
        self.aborted.set()
        with self._lock:
            connection = self._connection
        if connection is not None and connection.sock is not None:
            with contextlib.suppress(OSError):
                connection.sock.shutdown(socket.SHUT_RDWR)

    def _check(self) -> None:
        if self.aborted.is_set():
            raise _Aborted
        self.check_cancelled()

    def run(self) -> DownloadResult:
        """Download with at most one restart from 0 (see the module docstring).

        Raises:
            DiskFull: ``disk_full``; the partial is kept less its last MiB (given back for
                the journal).
        """
        restarted = False
        while True:
            try:
                self.part.parent.mkdir(parents=True, exist_ok=True)
                return self._attempt()
            except _Restart:
                _discard(self.part)
                if restarted:
                    raise TransportError(
                        f"{self.remote.url}: the server's answers do not match the partial "
                        "download twice in a row"
                    ) from None
                restarted = True
            except (SizeMismatch, DigestMismatch):
                _discard(self.part)
                raise
            except OSError as exc:
                if not is_disk_full(exc):
                    raise
                raise self._disk_full() from exc

    def _disk_full(self) -> DiskFull:
        """The ``disk_full`` error of this transfer, after giving back the journal's room."""
        kept = partial_length(self.part)
        free = free_bytes(self.part)
        released = release_reserve(self.part)
        return disk_full(
            self.part,
            action=f"downloading {self.remote.path}",
            needed_bytes=self.remote.size - kept,
            free=free,
            kept=f"the partial download keeps {kept - released} bytes and the next pull "
            "resumes from them",
        )

    def _connect(self, url: str, proxy: Proxy | None) -> http.client.HTTPConnection:
        """A connection for a GET of ``url``: to its host, or to ``proxy`` (tunnelled for
        ``https``)."""
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port
        if proxy is not None:
            host, port = proxy.host, proxy.port
        connection: http.client.HTTPConnection
        if parts.scheme == "https":
            connection = http.client.HTTPSConnection(
                host, port, timeout=self.connect_timeout, context=_tls_context()
            )
            if proxy is not None:
                connection.set_tunnel(
                    parts.hostname or "", parts.port or 443, headers=proxy.headers()
                )
        elif parts.scheme == "http":
            connection = http.client.HTTPConnection(host, port, timeout=self.connect_timeout)
        else:
            raise HttpStatusError(f"GET {url}: unsupported URL scheme {parts.scheme!r}")
        with self._lock:
            self._connection = connection
        self._check()
        connection.connect()
        assert connection.sock is not None  # noqa: S101 - connect() sets it
        connection.sock.settimeout(self.read_timeout)
        self._check()  # an abort during connect() found no socket to shut down
        return connection

    def _open(self, headers: dict[str, str]) -> http.client.HTTPResponse:
        """GET the URL, following redirects by hand; the token only goes to its origin."""
        url = current = self.remote.url
        for _ in range(MAX_REDIRECTS + 1):
            request_headers = dict(headers)
            if same_origin(current, url):
                request_headers.update(self.origin_headers)
                if self.token:
                    request_headers["Authorization"] = f"Bearer {self.token}"
            parts = urlsplit(current)
            proxy = self._via = self.proxies.for_url(current)
            target = parts.path or "/"
            if parts.query:
                target += f"?{parts.query}"
            if proxy is not None and parts.scheme == "http":
                target = current  # absolute-form: the proxy forwards it
                request_headers.update(proxy.headers())
            try:
                connection = self._connect(current, proxy)
                connection.request("GET", target, headers=request_headers)
                response = connection.getresponse()
            except _NETWORK_ERRORS as exc:
                self._close()
                tunnel = tunnel_status(exc) if proxy is not None else None
                if proxy is not None and tunnel is not None:
                    raise refused(proxy, current, *tunnel) from None
                raise unreachable(current, exc, proxy=proxy) from exc
            except BaseException:
                self._close()
                raise
            if proxy is not None and response.status == 407:
                response.close()
                self._close()
                raise refused(proxy, current, response.status, response.reason)
            location = response.getheader("Location")
            if response.status in (301, 302, 303, 307, 308) and location:
                # The answer holds the socket too (a ``Connection: close`` answer owns it
                # alone): closing only the connection would leave its file descriptor open.
                response.close()
                self._close()
                current = urljoin(current, location)
                continue
            return response
        self._close()
        raise HttpStatusError(f"GET {url}: more than {MAX_REDIRECTS} redirects")

    def _close(self) -> None:
        with self._lock:
            connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    def _start(
        self, response: http.client.HTTPResponse, *, offset: int, etag: str | None
    ) -> tuple[int, Any, Any] | DownloadResult:
        """Decide from the status what the body continues: ``(offset, sha, b3)`` to stream
        from, or a finished result (416 on a complete partial).

        Raises:
            _Restart: the answer does not fit the partial.
        """
        remote, part = self.remote, self.part
        status = response.status
        new_etag = response.getheader("ETag") or ""
        range_start, range_total = _content_range(response.getheader("Content-Range"))
        if status == 416 and offset > 0:
            if offset == remote.size and range_total == remote.size and new_etag in ("", etag):
                sha, b3 = hash_file(part)
                return self._verified(sha, b3, resumed_from=offset, downloaded=0)
            raise _Restart
        if status == 206 and offset > 0:
            if range_start != offset or range_total != remote.size or new_etag != etag:
                raise _Restart
            sha, b3 = hash_file(part, limit=offset)
            return offset, sha, b3
        if status == 200:
            length = response.getheader("Content-Length")
            if length is not None and length.strip().isdigit() and int(length) != remote.size:
                raise SizeMismatch(
                    f"{remote.path}: the server announces {int(length)} bytes, the catalog "
                    f"{remote.size}"
                )
            return 0, hashlib.sha256(), blake3()
        raise _status_error(status, remote.url, via=self._via)

    def _attempt(self) -> DownloadResult:
        remote = self.remote
        offset, etag = _resume_offset(self.part, remote)
        headers = {"Accept-Encoding": "identity"}
        if offset > 0 and etag:
            headers["Range"] = f"bytes={offset}-"
            headers["If-Range"] = etag
        response = self._open(headers)
        sink: PartialSink | None = None
        try:
            started = self._start(response, offset=offset, etag=etag)
            if isinstance(started, DownloadResult):
                return started
            offset, sha, b3 = started
            sink = _open_sink(self.part, remote, response.getheader("ETag") or "", offset, sha, b3)
            sink.checkpoint()  # the state exists before the first body byte counts
            self._stream(response, sink)
            if sink.queued != remote.size:
                sink.checkpoint()  # keep what arrived for the next attempt
                raise TransportError(
                    f"{remote.url}: the stream ended after {sink.queued} of {remote.size} bytes"
                )
            sink.finish()
            return self._verified(sha, b3, resumed_from=offset, downloaded=sink.queued - offset)
        finally:
            if sink is not None:
                sink.close()
            self._close()

    def _verified(self, sha: Any, b3: Any, *, resumed_from: int, downloaded: int) -> DownloadResult:
        """Check the finished partial; a resumed one whose bytes are wrong starts over.

        Raises:
            _Restart: the SHA-256 of a resumed download does not match: the bytes kept from
                an earlier attempt were wrong.
            DigestMismatch: ``digest_mismatch`` for a download from byte 0.
            SizeMismatch: ``size_mismatch``.
        """
        try:
            return _finish(
                self.part, self.remote, sha, b3, resumed_from=resumed_from, downloaded=downloaded
            )
        except DigestMismatch:
            if resumed_from == 0:
                raise
            logger.warning(
                "%s: the SHA-256 does not match after resuming from byte %d; the kept bytes "
                "were wrong, downloading the file again from byte 0",
                self.remote.path,
                resumed_from,
            )
            raise _Restart from None

    def _stream(self, response: http.client.HTTPResponse, sink: PartialSink) -> None:
        """Hand the body to ``sink``, one receive call per block; a cut stream keeps what
        arrived (checkpointed) and raises ``transport``."""
        remote = self.remote
        while True:
            self._check()
            try:
                block = response.read1(BLOCK_BYTES)
            except _NETWORK_ERRORS as exc:
                if self.aborted.is_set():
                    raise _Aborted from exc
                sink.checkpoint()  # keep what arrived for the next attempt
                raise TransportError(
                    f"GET {remote.url}: {type(exc).__name__} after {sink.queued} bytes: {exc}"
                ) from exc
            if not block:
                return
            if sink.queued + len(block) > remote.size:
                raise SizeMismatch(
                    f"{remote.path}: the server sent more than the expected {remote.size} bytes"
                )
            sink.put((block,), len(block))
            self.durable = sink.durable


def _open_sink(
    part: Path, remote: RemoteFile, etag: str, offset: int, sha: Any, b3: Any
) -> PartialSink:
    """A sink appending to ``part`` at ``offset`` whose checkpoints record the resume state
    (only with an ETag: without one a later attempt cannot resume safely)."""
    fd = os.open(part, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.lseek(fd, offset, os.SEEK_SET)
        os.ftruncate(fd, offset)
    except BaseException:
        os.close(fd)
        raise

    def record(completed: int) -> None:
        if etag:
            _write_state(
                part,
                {
                    "schema_version": STATE_SCHEMA_VERSION,
                    "url": remote.url,
                    "etag": etag,
                    "expected_sha256": remote.sha256,
                    "expected_size": remote.size,
                    "completed_bytes": completed,
                },
            )

    return PartialSink(
        fd,
        offset=offset,
        sha=sha,
        b3=b3,
        record=record,
        checkpoint_bytes=CHECKPOINT_BYTES,
        checkpoint_s=CHECKPOINT_SECONDS,
    )


async def download_file(
    remote: RemoteFile,
    *,
    part: Path,
    token: str | None,
    on_progress: Callable[[int], Awaitable[None]],
    check_cancelled: Callable[[], None],
    read_timeout: float | None = None,
    connect_timeout: float = CONNECT_TIMEOUT_S,
    proxies: ProxySettings | None = None,
    origin_headers: Mapping[str, str] | None = None,
) -> DownloadResult:
    """Download ``remote`` into ``part`` (resuming it when possible) and verify it.

    The transfer runs on a worker thread (see the module docstring); cancelling the awaiting
    task stops it at once (its socket is shut down) and returns only after the thread has
    let go of the partial, which is kept for a resume.

    Args:
        remote: URL and expected size and SHA-256.
        part: The partial file; its resume state lives beside it.
        token: Bearer token for the URL's own origin, or ``None``.
        on_progress: Awaited with the bytes on disk when a checkpoint moved them (looked at
            every :data:`PROGRESS_S`) and at the end.
        check_cancelled: Raises to stop between blocks (called on the transfer thread).
        read_timeout: Seconds without a byte (default :func:`read_timeout_s`).
        connect_timeout: Seconds to connect.
        proxies: The forward proxies to use (default: read from the environment now,
            :func:`~sbproxy.model_host.artifacts.proxies.proxy_settings`).
        origin_headers: Headers sent with the token, to the URL's own origin only (a fleet
            peer's name beside its credential); never to a redirect's other host.

    Returns:
        The verified partial's digests (ready to promote into the blob store).

    Raises:
        ProxyError: ``invalid_proxy`` for a proxy variable that cannot be used (before
            anything is fetched; the message names the variable, never its credentials).
        TransportError: ``transport`` (retryable) on connection errors, timeouts or a cut
            stream, also to or through a proxy (and a proxy's 5xx answer to ``CONNECT``);
            the partial and its state are kept for the next attempt.
        HttpStatusError: ``http_status``; retryable for 429 and 5xx; not retryable for a
            proxy's 407 (credentials) or other 4xx answer to ``CONNECT``.
        SizeMismatch: ``size_mismatch``; the partial is discarded.
        DigestMismatch: ``digest_mismatch``; the partial is discarded.
        DiskFull: ``disk_full`` when the file system is full; the partial is kept.
    """

    transfer = _Transfer(
        remote,
        part=part,
        token=token,
        check_cancelled=check_cancelled,
        read_timeout=read_timeout_s() if read_timeout is None else read_timeout,
        connect_timeout=connect_timeout,
        proxies=proxy_settings() if proxies is None else proxies,
        origin_headers=origin_headers,
    )
    finished = threading.Event()

    def run() -> DownloadResult:
        try:
            return transfer.run()
        finally:
            finished.set()

    failure: Exception | None = None

    async def report() -> None:
        # Polled, so the transfer thread never waits for a journal write.
        nonlocal failure
        reported = 0
        try:
            while True:
                await anyio.sleep(PROGRESS_S)
                if transfer.durable > reported:
                    reported = transfer.durable
                    await on_progress(reported)
        except Exception as exc:  # noqa: BLE001 - raised below, after the thread let go
            failure = exc
            transfer.abort()

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(report)
            try:
                result = await anyio.to_thread.run_sync(run, abandon_on_cancel=True)
            except Exception as exc:  # noqa: BLE001 - raised below, outside the task group
                failure = failure or exc
            group.cancel_scope.cancel()
    except anyio.get_cancelled_exc_class():
        transfer.abort()
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(finished.wait)
        raise
    if failure is not None:
        if journal_full_beside(failure, part):
            # The progress write found the journal's file system full, and it is the
            # partial's: give back the journal's room so that it can record the failure.
            release_reserve(part)
        raise failure
    await on_progress(result.size)
    return result


def _finish(
    part: Path,
    remote: RemoteFile,
    sha: Any,
    b3: Any,
    *,
    resumed_from: int,
    downloaded: int,
) -> DownloadResult:
    digest = sha.hexdigest()
    size = part.stat().st_size
    if size != remote.size:
        raise SizeMismatch(f"{remote.path}: got {size} bytes, the catalog says {remote.size}")
    if digest != remote.sha256:
        raise DigestMismatch(
            f"{remote.path}: SHA-256 {digest} does not match the catalog's {remote.sha256}",
            remediation="The upstream bytes changed or were corrupted; nothing was published.",
        )
    return DownloadResult(
        sha256=digest,
        blake3=b3.hexdigest(),
        size=size,
        resumed_from=resumed_from,
        downloaded_bytes=downloaded,
    )
