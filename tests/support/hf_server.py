"""A real local HTTP server that speaks the Hugging Face ``resolve`` URL shape, with faults.

``GET|HEAD /{org}/{repo}/resolve/{revision}/{path...}`` serves a registered file the way the
Hub does for the parts a downloader relies on: ``ETag`` (by default the quoted SHA-256 of the
content, as the Hub reports for LFS files), ``Content-Length``, ``Accept-Ranges: bytes`` and
``X-Repo-Commit``; ``Range: bytes=N-`` / ``bytes=N-M`` answered with 206 and ``Content-Range``;
``If-Range`` with another ETag answered with the full 200; a start at or past the end answered
with 416 and ``Content-Range: bytes */size``. Anything else is a 404 with a JSON body.
Connections are HTTP/1.1 keep-alive; with ``tls=`` (a server-side :class:`ssl.SSLContext`,
e.g. from a ``trustme`` CA) the mirror speaks HTTPS and :attr:`HfMirror.url` is ``https://``.

Each :class:`FileEntry` carries fault knobs (see its docstring) that tests set by keyword in
:meth:`HfMirror.add_file` or as attributes later; every request is recorded in
:attr:`HfMirror.requests`.

Usage in a test::

    with HfMirror() as hub:
        hub.add_file("Org/Repo", "main", "model.gguf", b"...", cut_after=4)
        env = {"HF_ENDPOINT": hub.url}
        ...
        assert [r.range_start for r in hub.requests] == [None, 4]

Standalone (benchmarks)::

    python -m tests.support.hf_server --file Org/Repo:main:model.gguf=/abs/model.gguf

prints ``{"url": ..., "files": [...]}`` as one JSON line on stdout and serves until killed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import re
import signal
import socket
import ssl
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType, TracebackType
from typing import cast
from urllib.parse import quote, unquote, urlsplit

__all__ = ["FileEntry", "HfMirror", "RecordedRequest", "main"]

_SEND_CHUNK = 1 << 20
_SENDFILE_CHUNK = 8 << 20
_HASH_CHUNK = 8 << 20
_STOP_GRACE_S = 5.0
_RANGE_START = re.compile(r"^\s*bytes\s*=\s*(\d+)\s*-")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass
class FileEntry:
    """One servable file and its fault knobs.

    Knobs can be set by keyword in :meth:`HfMirror.add_file` or assigned later; each works
    alone or combined with the others. They are applied to a request in this order: delay,
    token check, scripted failure status, redirect, then the content response.

    Attributes:
        repo: ``Org/Repo`` as it appears in the URL.
        revision: The URL revision segment (branch, tag or commit).
        path: The file path inside the repository.
        size: Content length in bytes.
        etag: The ETag served (quoted), unless ``etag_sequence`` says otherwise.
        commit: The ``X-Repo-Commit`` header value.
        data: The content, when served from memory.
        source: The content, when served from disk.
        cut_after: Close the connection after this many body bytes of a response that has
            more; applies to the first ``cut_times`` such GET responses.
        cut_times: How many responses ``cut_after`` cuts (default 1).
        ignore_range: Answer a Range request with 200 and the full body.
        etag_sequence: ETags for successive content responses (the n-th response that gets
            as far as serving content uses ``etag_sequence[n]``, the last one sticks): an
            upstream that changed between attempts. ``If-Range`` is compared with the ETag of
            the response being answered.
        wrong_bytes: Serve the content with its first and last bytes inverted (same length,
            so any range reaching the end is wrong too).
        fail_statuses: Statuses answered, one per request, before serving normally; consumed
            from the front (``[503, 503]`` fails the next two requests).
        retry_after: ``Retry-After`` value sent with a scripted 429 or 503 (``None``: none).
        delay_s: Seconds to wait before sending the response headers.
        delay_times: How many requests ``delay_s`` applies to (``None``: every request).
        throttle_bps: Cap on body bytes per second.
        redirect_to: Another mirror (a CDN): answer 302 with ``Location`` at the same
            ``resolve`` URL on it. :meth:`HfMirror.add_file` registers the content there.
        require_token: Answer 401 unless ``Authorization: Bearer <token>`` is sent.
        hold_after: Stop every body at this byte offset of the file until :meth:`release`
            (a download held mid-way, deterministically); :attr:`holding` counts the
            responses waiting there now.
    """

    repo: str
    revision: str
    path: str
    size: int
    etag: str
    commit: str
    data: bytes | None = None
    source: Path | None = None
    cut_after: int | None = None
    cut_times: int = 1
    ignore_range: bool = False
    etag_sequence: list[str] | None = None
    wrong_bytes: bool = False
    fail_statuses: list[int] = field(default_factory=list)
    retry_after: str | None = "0"
    delay_s: float = 0.0
    delay_times: int | None = None
    throttle_bps: int | None = None
    redirect_to: HfMirror | None = None
    require_token: str | None = None
    hold_after: int | None = None
    # Bookkeeping, guarded by the owning mirror's lock.
    served_count: int = 0
    cuts_done: int = 0
    delays_done: int = 0
    holding: int = 0
    released: threading.Event = field(default_factory=threading.Event, repr=False)

    def release(self) -> None:
        """Let the bodies held at :attr:`hold_after` (and any later one) go on."""
        self.released.set()

    def read(self, offset: int, length: int) -> bytes:
        """The served bytes ``[offset, offset + length)``, faults (``wrong_bytes``) applied."""
        if self.data is not None:
            chunk = self.data[offset : offset + length]
        else:
            assert self.source is not None
            with self.source.open("rb") as handle:
                handle.seek(offset)
                chunk = handle.read(length)
        if not self.wrong_bytes or not chunk:
            return chunk
        flipped = bytearray(chunk)
        for position in {0, self.size - 1}:
            if offset <= position < offset + len(flipped):
                flipped[position - offset] ^= 0xFF
        return bytes(flipped)


@dataclass
class RecordedRequest:
    """One request the mirror answered (a snapshot; the mirror keeps its own copy).

    Attributes:
        method: ``GET`` or ``HEAD``.
        path: The URL path as requested (query string removed, percent-encoding kept).
        file: The repository file path it resolved to, or ``None`` when not a resolve URL.
        range_header: The raw ``Range`` header, if any.
        range_start: The first byte asked for by ``Range: bytes=N-...``, else ``None``.
        if_range: The ``If-Range`` header, if any.
        authorization: The ``Authorization`` header value, if any.
        proxy_authorization: The ``Proxy-Authorization`` header value, if any (a proxy's
            credentials must never reach the origin).
        host: The ``Host`` header, if any.
        status: The response status (0 until the headers are decided).
        body_bytes: Body bytes handed to the socket so far.
    """

    method: str
    path: str
    file: str | None
    range_header: str | None
    range_start: int | None
    if_range: str | None
    authorization: str | None
    proxy_authorization: str | None = None
    host: str | None = None
    status: int = 0
    body_bytes: int = 0

    @property
    def has_authorization(self) -> bool:
        """Whether an ``Authorization`` header was sent."""
        return self.authorization is not None


class HfMirror:
    """A threaded HTTP server on 127.0.0.1 that serves registered files in the HF shape.

    Args:
        port: The port to bind (0: any free port).
        tls: A server-side TLS context: serve HTTPS (the handshake runs on the connection's
            own thread).
    """

    def __init__(self, *, port: int = 0, tls: ssl.SSLContext | None = None) -> None:
        self._port = port
        self._tls = tls
        self._lock = threading.Lock()
        self._files: dict[tuple[str, str, str], FileEntry] = {}
        self._requests: list[RecordedRequest] = []
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> HfMirror:
        """Bind and serve from a daemon thread; returns ``self``."""
        if self._server is not None:
            return self
        self._stopping.clear()
        server = _Server(("127.0.0.1", self._port), self, tls=self._tls)
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"hf-mirror-{self.port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, drop open connections and release the port."""
        server, thread = self._server, self._thread
        if server is None:
            return
        self._stopping.set()
        server.shutdown()
        server.close_connections(timeout_s=_STOP_GRACE_S)
        server.server_close()
        if thread is not None:
            thread.join(timeout=_STOP_GRACE_S)
        self._server = None
        self._thread = None

    def __enter__(self) -> HfMirror:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        """The bound port (the mirror must be started)."""
        if self._server is None:
            raise RuntimeError("HfMirror is not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """The endpoint, e.g. ``http://127.0.0.1:41234`` (what ``HF_ENDPOINT`` is set to);
        ``https://`` with ``tls``."""
        return f"{'https' if self._tls is not None else 'http'}://127.0.0.1:{self.port}"

    # -- files -----------------------------------------------------------------------------

    def add_file(
        self,
        repo: str,
        revision: str,
        path: str,
        data: bytes | Path,
        *,
        etag: str | None = None,
        commit: str | None = None,
        cut_after: int | None = None,
        cut_times: int = 1,
        ignore_range: bool = False,
        etag_sequence: list[str] | None = None,
        wrong_bytes: bool = False,
        fail_statuses: list[int] | None = None,
        retry_after: str | None = "0",
        delay_s: float = 0.0,
        delay_times: int | None = None,
        throttle_bps: int | None = None,
        redirect_to: HfMirror | None = None,
        require_token: str | None = None,
        hold_after: int | None = None,
    ) -> FileEntry:
        """Register (or replace) a file; the knobs are :class:`FileEntry`'s.

        Args:
            repo: ``Org/Repo``.
            revision: URL revision segment.
            path: File path inside the repository.
            data: The content in memory, or a file on disk (streamed with ``sendfile``).
            etag: The ETag to serve; default the quoted SHA-256 hex of the content, computed
                once here (in chunks for a file).
            commit: ``X-Repo-Commit``; default the revision when it is a 40-hex commit, else
                a stable fake commit derived from repo and revision.

        Returns:
            The entry, whose attributes can be changed later to arm faults.
        """
        if isinstance(data, Path):
            size = data.stat().st_size
            digest = _sha256_file(data) if etag is None else ""
            content, source = None, data
        else:
            size = len(data)
            digest = hashlib.sha256(data).hexdigest() if etag is None else ""
            content, source = bytes(data), None
        if commit is None:
            commit = (
                revision
                if _COMMIT.match(revision)
                else hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()  # noqa: S324
            )
        entry = FileEntry(
            repo=repo,
            revision=revision,
            path=path,
            size=size,
            etag=etag if etag is not None else f'"{digest}"',
            commit=commit,
            data=content,
            source=source,
            cut_after=cut_after,
            cut_times=cut_times,
            ignore_range=ignore_range,
            etag_sequence=etag_sequence,
            wrong_bytes=wrong_bytes,
            fail_statuses=list(fail_statuses or []),
            retry_after=retry_after,
            delay_s=delay_s,
            delay_times=delay_times,
            throttle_bps=throttle_bps,
            redirect_to=redirect_to,
            require_token=require_token,
            hold_after=hold_after,
        )
        with self._lock:
            self._files[(repo, revision, path)] = entry
        if redirect_to is not None and not redirect_to.has_file(repo, revision, path):
            redirect_to.add_file(repo, revision, path, data, etag=entry.etag, commit=entry.commit)
        return entry

    def has_file(self, repo: str, revision: str, path: str) -> bool:
        """Whether a file is registered."""
        with self._lock:
            return (repo, revision, path) in self._files

    def entry(self, repo: str, revision: str, path: str) -> FileEntry:
        """The registered entry (raises ``KeyError`` when absent)."""
        with self._lock:
            return self._files[(repo, revision, path)]

    def url_for(self, repo: str, revision: str, path: str) -> str:
        """The absolute ``resolve`` URL of a file on this mirror."""
        return f"{self.url}{resolve_path(repo, revision, path)}"

    # -- recording -------------------------------------------------------------------------

    @property
    def requests(self) -> list[RecordedRequest]:
        """A snapshot of every request answered so far, oldest first."""
        with self._lock:
            return [replace(request) for request in self._requests]

    def bytes_served(self, path: str | None = None) -> int:
        """Body bytes sent, for every request or those whose file (or URL path) is ``path``."""
        with self._lock:
            return sum(
                request.body_bytes
                for request in self._requests
                if path is None or path in (request.file, request.path)
            )

    def clear(self) -> None:
        """Forget recorded requests (the files and their fault state stay)."""
        with self._lock:
            self._requests.clear()

    # -- used by the handler ---------------------------------------------------------------

    def _lookup(self, key: tuple[str, str, str] | None) -> FileEntry | None:
        if key is None:
            return None
        with self._lock:
            return self._files.get(key)

    def _record(self, request: RecordedRequest) -> None:
        with self._lock:
            self._requests.append(request)

    def _set_status(self, request: RecordedRequest, status: int) -> None:
        with self._lock:
            request.status = status

    def _add_bytes(self, request: RecordedRequest, count: int) -> None:
        with self._lock:
            request.body_bytes += count

    def _claim_delay(self, entry: FileEntry) -> float:
        """Seconds this request waits before its headers (``delay_s``/``delay_times``)."""
        with self._lock:
            if entry.delay_s <= 0 or (
                entry.delay_times is not None and entry.delays_done >= entry.delay_times
            ):
                return 0.0
            entry.delays_done += 1
            return entry.delay_s

    def _hold(self, entry: FileEntry) -> bool:
        """Wait at ``entry.hold_after`` until released; ``False`` when the mirror stops."""
        with self._lock:
            entry.holding += 1
        try:
            while not entry.released.wait(0.05):
                if self._stopping.is_set():
                    return False
            return True
        finally:
            with self._lock:
                entry.holding -= 1

    def _claim_failure(self, entry: FileEntry) -> int | None:
        """The scripted status this request gets, consumed from ``fail_statuses``."""
        with self._lock:
            return entry.fail_statuses.pop(0) if entry.fail_statuses else None

    def _next_etag(self, entry: FileEntry) -> str:
        with self._lock:
            index = entry.served_count
            entry.served_count += 1
        if entry.etag_sequence:
            return entry.etag_sequence[min(index, len(entry.etag_sequence) - 1)]
        return entry.etag

    def _claim_cut(self, entry: FileEntry, length: int) -> int | None:
        with self._lock:
            cut = entry.cut_after
            if cut is None or entry.cuts_done >= entry.cut_times or length <= cut:
                return None
            entry.cuts_done += 1
            return cut


def resolve_path(repo: str, revision: str, path: str) -> str:
    """``/{repo}/resolve/{revision}/{path}`` with each part percent-encoded like the Hub's."""
    return f"/{quote(repo)}/resolve/{quote(revision, safe='')}/{quote(path)}"


def _parse_route(url_path: str) -> tuple[str, str, str] | None:
    repo, marker, rest = url_path.partition("/resolve/")
    if not marker or not repo.startswith("/") or len(repo) < 2:
        return None
    revision, slash, file = rest.partition("/")
    if not slash or not revision or not file:
        return None
    return unquote(repo[1:]), unquote(revision), unquote(file)


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """``(first, last)`` inclusive, ``first >= size`` when unsatisfiable; ``None`` to ignore.

    Only a single range is honoured; anything else is ignored (a server may, RFC 9110 14.2).
    """
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first_text, dash, last_text = spec.strip().partition("-")
    first_text, last_text = first_text.strip(), last_text.strip()
    if not dash or not (first_text.isdigit() or last_text.isdigit()):
        return None
    if not first_text:  # suffix range: the last N bytes
        suffix = int(last_text)
        return (size, size) if suffix == 0 else (max(0, size - suffix), size - 1)
    first = int(first_text)
    if not last_text:
        return first, size - 1
    if not last_text.isdigit() or int(last_text) < first:
        return None
    return first, min(int(last_text), size - 1)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], mirror: HfMirror, *, tls: ssl.SSLContext | None
    ) -> None:
        super().__init__(address, _Handler)
        self.mirror = mirror
        self.tls = tls
        self._open: set[socket.socket] = set()
        self._open_changed = threading.Condition()

    def get_request(self) -> tuple[socket.socket, tuple[str, int]]:
        connection, address = super().get_request()
        if self.tls is not None:
            # The handshake waits for the handler's thread: a slow client stalls no accept.
            connection = self.tls.wrap_socket(
                connection, server_side=True, do_handshake_on_connect=False
            )
        return connection, address

    def track(self, connection: socket.socket) -> None:
        with self._open_changed:
            self._open.add(connection)

    def untrack(self, connection: socket.socket) -> None:
        with self._open_changed:
            self._open.discard(connection)
            self._open_changed.notify_all()

    def close_connections(self, *, timeout_s: float) -> None:
        """Shut down open keep-alive connections and wait for their handlers to finish."""
        with self._open_changed:
            for connection in self._open:
                with contextlib.suppress(OSError):  # already closed by the peer
                    connection.shutdown(socket.SHUT_RDWR)
            self._open_changed.wait_for(lambda: not self._open, timeout=timeout_s)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "HfMirror/1"
    disable_nagle_algorithm = True
    timeout = 60

    @property
    def _server(self) -> _Server:
        return cast("_Server", self.server)

    def setup(self) -> None:
        super().setup()
        self._server.track(self.connection)
        self._handshake_failed = False
        if isinstance(self.connection, ssl.SSLSocket):
            try:
                self.connection.do_handshake()
            except OSError:  # the client refused the certificate, or went away
                self._handshake_failed = True

    def handle(self) -> None:
        if not self._handshake_failed:
            super().handle()

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self._server.untrack(self.connection)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib name
        """Quiet: tests read :attr:`HfMirror.requests` instead."""

    def do_GET(self) -> None:
        self._handle(head=False)

    def do_HEAD(self) -> None:
        self._handle(head=True)

    # -- request handling ------------------------------------------------------------------

    def _handle(self, *, head: bool) -> None:
        mirror = self._server.mirror
        url_path = urlsplit(self.path).path
        route = _parse_route(url_path)
        range_header = self.headers.get("Range")
        start_match = _RANGE_START.match(range_header) if range_header else None
        record = RecordedRequest(
            method=self.command,
            path=url_path,
            file=route[2] if route else None,
            range_header=range_header,
            range_start=int(start_match.group(1)) if start_match else None,
            if_range=self.headers.get("If-Range"),
            authorization=self.headers.get("Authorization"),
            proxy_authorization=self.headers.get("Proxy-Authorization"),
            host=self.headers.get("Host"),
        )
        mirror._record(record)
        entry = mirror._lookup(route)
        try:
            if entry is None:
                self._send_json(
                    record, 404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"}
                )
            else:
                self._handle_entry(entry, record, head=head)
        except OSError:
            # The client went away (or was cut off); nothing more to say on this connection.
            self.close_connection = True

    def _handle_entry(self, entry: FileEntry, record: RecordedRequest, *, head: bool) -> None:
        mirror = self._server.mirror
        delay_s = mirror._claim_delay(entry)
        if delay_s > 0 and mirror._stopping.wait(delay_s):
            self.close_connection = True
            return
        if entry.require_token is not None and (
            record.authorization != f"Bearer {entry.require_token}"
        ):
            self._send_json(
                record,
                401,
                {"error": "Invalid credentials in Authorization header"},
                {"X-Error-Code": "RepoNotFound"},
            )
            return
        failure = mirror._claim_failure(entry)
        if failure is not None:
            headers = {}
            if failure in (429, 503) and entry.retry_after is not None:
                headers["Retry-After"] = entry.retry_after
            self._send_json(record, failure, {"error": f"scripted {failure}"}, headers)
            return
        if entry.redirect_to is not None:
            self._start(
                record,
                302,
                {
                    "Location": entry.redirect_to.url_for(entry.repo, entry.revision, entry.path),
                    "X-Repo-Commit": entry.commit,
                    "X-Linked-Etag": entry.etag,
                    "X-Linked-Size": str(entry.size),
                    "Content-Length": "0",
                },
            )
            return
        self._serve_content(entry, record, head=head)

    def _serve_content(self, entry: FileEntry, record: RecordedRequest, *, head: bool) -> None:
        mirror = self._server.mirror
        etag = mirror._next_etag(entry)
        size = entry.size
        first, last, status = 0, size - 1, 200
        if record.range_header is not None and not entry.ignore_range:
            wanted = None if record.if_range not in (None, etag) else record.range_header
            parsed = _parse_range(wanted, size) if wanted is not None else None
            if parsed is not None and parsed[0] >= size:
                self._start(
                    record,
                    416,
                    {
                        "Content-Range": f"bytes */{size}",
                        "ETag": etag,
                        "Accept-Ranges": "bytes",
                        "X-Repo-Commit": entry.commit,
                        "Content-Length": "0",
                    },
                )
                return
            if parsed is not None:
                (first, last), status = parsed, 206
        length = max(0, last - first + 1)
        headers = {
            "Content-Type": "application/octet-stream",
            "Content-Length": str(length),
            "ETag": etag,
            "Accept-Ranges": "bytes",
            "X-Repo-Commit": entry.commit,
        }
        if status == 206:
            headers["Content-Range"] = f"bytes {first}-{last}/{size}"
        self._start(record, status, headers)
        if head or length == 0:
            return
        cut = mirror._claim_cut(entry, length)
        self._send_body(entry, record, first, length if cut is None else cut)
        if cut is not None:
            self.close_connection = True

    # -- writing ---------------------------------------------------------------------------

    def _start(self, record: RecordedRequest, status: int, headers: dict[str, str]) -> None:
        # Recorded before the headers leave, so a client that has seen the response can
        # always find the request in ``HfMirror.requests``.
        self._server.mirror._set_status(record, status)
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()

    def _send_json(
        self,
        record: RecordedRequest,
        status: int,
        body: dict[str, str],
        headers: dict[str, str],
    ) -> None:
        payload = json.dumps(body).encode()
        self._start(
            record,
            status,
            {
                **headers,
                "Content-Type": "application/json",
                "Content-Length": str(len(payload)),
            },
        )
        if self.command != "HEAD":
            self._send_bytes(record, payload)

    def _send_body(
        self, entry: FileEntry, record: RecordedRequest, first: int, length: int
    ) -> None:
        plain = not (entry.wrong_bytes or entry.throttle_bps or entry.hold_after is not None)
        if entry.source is not None and plain:
            self._sendfile(entry.source, record, first, length)
            return
        rate = entry.throttle_bps
        chunk_size = _SEND_CHUNK if not rate else max(1, min(_SEND_CHUNK, rate // 20))
        began, sent = time.monotonic(), 0
        hold = entry.hold_after
        while sent < length:
            wanted = min(chunk_size, length - sent)
            if hold is not None and first + sent >= hold:
                hold = None
                if not entry.released.is_set() and not self._server.mirror._hold(entry):
                    raise ConnectionAbortedError("mirror stopping")
            elif hold is not None:
                wanted = min(wanted, hold - first - sent)  # stop exactly at the hold
            chunk = entry.read(first + sent, wanted)
            if not chunk:
                raise ConnectionAbortedError("source file shrank while serving")
            if rate:
                # Never let the bytes sent run ahead of rate x elapsed time.
                early = (sent + len(chunk)) / rate - (time.monotonic() - began)
                if early > 0 and self._server.mirror._stopping.wait(early):
                    raise ConnectionAbortedError("mirror stopping")
            self._send_bytes(record, chunk)
            sent += len(chunk)

    def _send_bytes(self, record: RecordedRequest, data: bytes) -> None:
        mirror = self._server.mirror
        view = memoryview(data)
        while view:
            # Count before sending so the record never lags what the client has received.
            mirror._add_bytes(record, len(view))
            try:
                accepted = self.connection.send(view)
            except OSError:
                mirror._add_bytes(record, -len(view))
                raise
            mirror._add_bytes(record, accepted - len(view))
            view = view[accepted:]

    def _sendfile(self, source: Path, record: RecordedRequest, first: int, length: int) -> None:
        mirror = self._server.mirror
        with source.open("rb") as handle:
            offset, end = first, first + length
            while offset < end:
                count = min(_SENDFILE_CHUNK, end - offset)
                handle.seek(offset)
                mirror._add_bytes(record, count)
                try:
                    self.connection.sendfile(handle, offset, count)
                finally:
                    # socket.sendfile leaves the file positioned after the last byte sent,
                    # also when it raises.
                    sent = handle.tell() - offset
                    mirror._add_bytes(record, sent - count)
                if sent == 0:
                    raise ConnectionAbortedError("source file shrank while serving")
                offset += sent


def main(argv: list[str] | None = None) -> int:
    """Serve files given as ``REPO:REV:PATH=/abs/file`` until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.hf_server",
        description="Serve local files in the Hugging Face resolve URL shape.",
    )
    parser.add_argument(
        "--file",
        action="append",
        default=[],
        metavar="REPO:REV:PATH=/abs/file",
        help="a file to serve (repeatable)",
    )
    parser.add_argument("--port", type=int, default=0, help="port to bind (default: any)")
    args = parser.parse_args(argv)

    mirror = HfMirror(port=args.port)
    files: list[dict[str, object]] = []
    for spec in args.file:
        location, equals, local = str(spec).partition("=")
        parts = location.split(":", 2)
        if not equals or len(parts) != 3 or not all(parts) or not Path(local).is_absolute():
            parser.error(f"--file must be REPO:REV:PATH=/abs/file, got {spec!r}")
        entry = mirror.add_file(parts[0], parts[1], parts[2], Path(local))
        files.append(
            {"repo": entry.repo, "revision": entry.revision, "path": entry.path}
            | {"size": entry.size, "etag": entry.etag}
        )

    done = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        done.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    with mirror:
        sys.stdout.write(json.dumps({"url": mirror.url, "files": files}) + "\n")
        sys.stdout.flush()
        while not done.wait(0.5):
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
