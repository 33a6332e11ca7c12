"""Resumable, verified HTTP download of one file into a partial.

The body is hashed (SHA-256 for verification, BLAKE3 for the fast re-verification
fingerprint) while it streams: there is no second read of a fresh download. A resumed
download re-reads only the bytes already on disk, once, to rebuild the hash state.

Resume rules (reference section 5, "HTTP resume"):

* ``<part>`` holds the bytes, ``<part>.resume.json`` the state ``{schema_version, url,
  etag, expected_sha256, expected_size, completed_bytes}``. The state is written before the
  body and at every checkpoint (every 8 MiB or 2 s) *after* the bytes it counts were
  ``fdatasync``-ed, so after a crash the partial is cut back to ``completed_bytes``.
* A resume needs a state that matches url, expected sha256 and size, and a non-empty ETag;
  otherwise the partial is discarded and the download restarts at 0.
* ``Range: bytes=N-`` with ``If-Range: <etag>``. 200 replaces the partial; 206 appends only
  if the ETag and ``Content-Range`` match; 416 at ``N == size`` with a matching total
  completes without a download; a mismatching answer discards the partial and restarts at 0
  (once).
* Redirects are followed by hand (at most 10); the bearer token is dropped on any hop to
  another origin (HF redirects file bodies to a CDN).

Why aiohttp and not httpx here: on this project's 2-core machines a verified download with
httpx reached about 0.6 of curl's throughput on loopback, aiohttp about 1.2 (its C parser
reads into large buffers); ``benchmarks/pull.py`` measures it side by side.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import anyio.to_thread
from blake3 import blake3
from yarl import URL

from sbproxy.model_host.artifacts.errors import (
    DigestMismatch,
    HttpStatusError,
    SizeMismatch,
    TransportError,
    disk_full_errors,
)
from sbproxy.model_host.artifacts.sources import same_origin
from sbproxy.workflows import fault_point

__all__ = ["DownloadResult", "RemoteFile", "download_file", "hash_file", "new_session"]

CHUNK_BYTES = 1024 * 1024
# A checkpoint fdatasyncs the partial: every 64 MiB or 2 s bounds the work a crash loses
# without letting syncs dominate a fast local transfer.
CHECKPOINT_BYTES = 64 * 1024 * 1024
CHECKPOINT_SECONDS = 2.0
QUEUE_BLOCKS = 8
MAX_REDIRECTS = 10
STATE_SCHEMA_VERSION = 1


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


def new_session(
    *, read_timeout_s: float | None = None, connect_timeout_s: float = 15.0
) -> aiohttp.ClientSession:
    """A client session for downloads: no automatic redirects, bounded socket timeouts.

    ``read_timeout_s`` (seconds without a byte) defaults to ``$SBPROXY_HTTP_READ_TIMEOUT_S``
    or 60.
    """
    if read_timeout_s is None:
        read_timeout_s = float(os.environ.get("SBPROXY_HTTP_READ_TIMEOUT_S") or 60)
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
    )
    return aiohttp.ClientSession(timeout=timeout, auto_decompress=False, trust_env=False)


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
    with temporary.open("w") as handle:
        json.dump(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    temporary.replace(target)


def _discard(part: Path) -> None:
    part.unlink(missing_ok=True)
    _state_path(part).unlink(missing_ok=True)


def _resume_offset(part: Path, remote: RemoteFile) -> tuple[int, str | None]:
    """Bytes of ``part`` that can be kept, and the ETag they came with."""
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
        and 0 < completed <= remote.size
        and bool(state.get("etag"))
    )
    on_disk = part.stat().st_size
    if not matches or on_disk < completed:
        _discard(part)
        return 0, None
    if on_disk > completed:
        # Bytes written after the last checkpoint are not known to be durable: cut them.
        with part.open("r+b") as handle:
            handle.truncate(completed)
    return int(completed), str(state["etag"])


def _content_range(header: str | None) -> tuple[int | None, int | None]:
    """``bytes a-b/total`` -> (a, total); ``bytes */total`` -> (None, total)."""
    if not header or not header.startswith("bytes "):
        return None, None
    span, _, total = header[6:].partition("/")
    start = None if span == "*" else int(span.split("-")[0])
    return start, int(total) if total.isdigit() else None


def _status_error(status: int, url: str) -> HttpStatusError:
    retryable = status == 429 or status >= 500
    hint = None
    if status in (401, 403):
        hint = "The repository may be gated: export HF_TOKEN with a token that can read it."
    elif status == 404:
        hint = "Check the catalog's source, revision and file path."
    return HttpStatusError(
        f"GET {url} answered HTTP {status}",
        retryable=retryable,
        remediation=hint,
        details={"status": status},
    )


class _Sink:
    """Writes body bytes to the partial, hashing them on the way, with checkpoints.

    Hashing and writing run on a dedicated thread fed through a small bounded queue, so the
    event loop keeps parsing the next network chunk meanwhile (``hashlib``, ``blake3`` and
    ``os.write`` release the GIL on large buffers). At a checkpoint the queue is drained
    first, so the state file never counts a byte that is not on disk.
    """

    def __init__(
        self, part: Path, remote: RemoteFile, etag: str, offset: int, sha: Any, b3: Any
    ) -> None:
        self.part = part
        self.remote = remote
        self.etag = etag
        self.completed = offset
        self.started_at = offset
        self.fd = os.open(part, os.O_WRONLY | os.O_CREAT, 0o644)
        os.lseek(self.fd, offset, os.SEEK_SET)
        os.ftruncate(self.fd, offset)
        self.last_checkpoint_bytes = offset
        self.last_checkpoint_time = time.monotonic()
        self._sha = sha
        self._b3 = b3
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=QUEUE_BLOCKS)
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._consume, name="sbproxy-download", daemon=True)
        self._thread.start()

    def _consume(self) -> None:
        while True:
            block = self._queue.get()
            try:
                if block is None:
                    return
                if self._failure is None:
                    self._sha.update(block)
                    self._b3.update(block)
                    fault_point("download.write")
                    view = memoryview(block)
                    while view:
                        view = view[os.write(self.fd, view) :]
            except BaseException as exc:  # noqa: BLE001 - handed to the event loop side
                self._failure = exc
            finally:
                self._queue.task_done()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    async def write(self, block: bytes) -> None:
        """Queue ``block`` (waiting in a thread when the queue is full)."""
        self._raise_failure()
        if self.completed + len(block) > self.remote.size:
            raise SizeMismatch(
                f"{self.remote.path}: the server sent more than the expected "
                f"{self.remote.size} bytes"
            )
        try:
            self._queue.put_nowait(block)
        except queue.Full:
            await anyio.to_thread.run_sync(self._queue.put, block)
        self.completed += len(block)

    async def flush(self) -> None:
        """Wait until every queued byte is hashed and written."""
        await anyio.to_thread.run_sync(self._queue.join)
        self._raise_failure()

    def due(self) -> bool:
        return (
            self.completed - self.last_checkpoint_bytes >= CHECKPOINT_BYTES
            or time.monotonic() - self.last_checkpoint_time >= CHECKPOINT_SECONDS
        )

    async def checkpoint(self) -> None:
        """Make the bytes so far durable and, with an ETag, resumable."""
        await self.flush()
        await anyio.to_thread.run_sync(self._sync_and_record)
        fault_point("download.checkpoint")

    def _sync_and_record(self) -> None:
        os.fdatasync(self.fd)
        self.last_checkpoint_bytes = self.completed
        self.last_checkpoint_time = time.monotonic()
        if not self.etag:
            return  # without an ETag a later attempt cannot resume safely: no state
        _write_state(
            self.part,
            {
                "schema_version": STATE_SCHEMA_VERSION,
                "url": self.remote.url,
                "etag": self.etag,
                "expected_sha256": self.remote.sha256,
                "expected_size": self.remote.size,
                "completed_bytes": self.completed,
            },
        )

    def close(self) -> None:
        """Stop the writer thread (after the bytes already queued) and close the file."""
        self._queue.put(None)
        self._thread.join()
        with contextlib.suppress(OSError):
            os.close(self.fd)


async def _open(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], token: str | None
) -> aiohttp.ClientResponse:
    current = url
    for _ in range(MAX_REDIRECTS + 1):
        request_headers = dict(headers)
        if token and same_origin(current, url):
            request_headers["Authorization"] = f"Bearer {token}"
        response = await session.get(current, headers=request_headers, allow_redirects=False)
        if response.status in (301, 302, 303, 307, 308) and "Location" in response.headers:
            location = str(response.url.join(URL(response.headers["Location"])))
            response.release()
            current = location
            continue
        return response
    raise HttpStatusError(f"GET {url}: more than {MAX_REDIRECTS} redirects")


async def download_file(
    session: aiohttp.ClientSession,
    remote: RemoteFile,
    *,
    part: Path,
    token: str | None,
    on_progress: Callable[[int], Awaitable[None]],
    check_cancelled: Callable[[], None],
) -> DownloadResult:
    """Download ``remote`` into ``part`` (resuming it when possible) and verify it.

    Args:
        session: From :func:`new_session`.
        remote: URL and expected size and SHA-256.
        part: The partial file; its resume state lives beside it.
        token: Bearer token for the URL's own origin, or ``None``.
        on_progress: Awaited with the bytes on disk at each checkpoint.
        check_cancelled: Raises to stop between chunks.

    Returns:
        The verified partial's digests (ready to promote into the blob store).

    Raises:
        TransportError: ``transport`` (retryable) on connection errors, timeouts or a cut
            stream; the partial and its state are kept for the next attempt.
        HttpStatusError: ``http_status``; retryable for 429 and 5xx.
        SizeMismatch: ``size_mismatch``; the partial is discarded.
        DigestMismatch: ``digest_mismatch``; the partial is discarded.
        DiskFull: ``disk_full`` when the file system is full; the partial is kept.
    """
    part.parent.mkdir(parents=True, exist_ok=True)
    restarted = False
    while True:
        try:
            return await _attempt(
                session,
                remote,
                part=part,
                token=token,
                on_progress=on_progress,
                check_cancelled=check_cancelled,
            )
        except _Restart:
            _discard(part)
            if restarted:
                raise TransportError(
                    f"{remote.url}: the server's answers do not match the partial download "
                    "twice in a row"
                ) from None
            restarted = True
        except (SizeMismatch, DigestMismatch):
            _discard(part)
            raise


async def _start(
    response: aiohttp.ClientResponse,
    remote: RemoteFile,
    *,
    part: Path,
    offset: int,
    etag: str | None,
) -> tuple[int, Any, Any] | DownloadResult:
    """Decide from the status what the body continues: ``(offset, sha, b3)`` to stream
    from, or a finished result (416 on a complete partial).

    Raises:
        _Restart: the answer does not fit the partial.
    """
    status = response.status
    new_etag = response.headers.get("ETag") or ""
    range_start, range_total = _content_range(response.headers.get("Content-Range"))
    if status == 416 and offset > 0:
        if offset == remote.size and range_total == remote.size and new_etag in ("", etag):
            sha, b3 = await anyio.to_thread.run_sync(hash_file, part)
            return await _finish(part, remote, sha, b3, resumed_from=offset, downloaded=0)
        raise _Restart
    if status == 206 and offset > 0:
        if range_start != offset or range_total != remote.size or new_etag != etag:
            raise _Restart
        sha, b3 = await anyio.to_thread.run_sync(lambda: hash_file(part, limit=offset))
        return offset, sha, b3
    if status == 200:
        length = response.content_length
        if length is not None and length != remote.size:
            raise SizeMismatch(
                f"{remote.path}: the server announces {length} bytes, the catalog {remote.size}"
            )
        return 0, hashlib.sha256(), blake3()
    raise _status_error(status, remote.url)


async def _attempt(
    session: aiohttp.ClientSession,
    remote: RemoteFile,
    *,
    part: Path,
    token: str | None,
    on_progress: Callable[[int], Awaitable[None]],
    check_cancelled: Callable[[], None],
) -> DownloadResult:
    """One transfer attempt; a full file system becomes ``disk_full`` (partial kept)."""
    with disk_full_errors(f"writing {part}", kept="the partial download is kept"):
        return await _transfer(
            session,
            remote,
            part=part,
            token=token,
            on_progress=on_progress,
            check_cancelled=check_cancelled,
        )


async def _transfer(
    session: aiohttp.ClientSession,
    remote: RemoteFile,
    *,
    part: Path,
    token: str | None,
    on_progress: Callable[[int], Awaitable[None]],
    check_cancelled: Callable[[], None],
) -> DownloadResult:
    offset, etag = await anyio.to_thread.run_sync(_resume_offset, part, remote)
    headers = {"Accept-Encoding": "identity"}
    if offset > 0 and etag:
        headers["Range"] = f"bytes={offset}-"
        headers["If-Range"] = etag
    try:
        response = await _open(session, remote.url, headers, token)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise TransportError(f"GET {remote.url}: {type(exc).__name__}: {exc}") from exc
    sink: _Sink | None = None
    try:
        started = await _start(response, remote, part=part, offset=offset, etag=etag)
        if isinstance(started, DownloadResult):
            return started
        offset, sha, b3 = started
        sink = _Sink(part, remote, response.headers.get("ETag") or "", offset, sha, b3)
        await sink.checkpoint()  # the state exists before the first body byte counts
        async for block in response.content.iter_chunked(CHUNK_BYTES):
            check_cancelled()
            await sink.write(block)
            if sink.due():
                await sink.checkpoint()
                await on_progress(sink.completed)
        if sink.completed != remote.size:
            raise TransportError(
                f"{remote.url}: the stream ended after {sink.completed} of {remote.size} bytes"
            )
        await sink.flush()
        await anyio.to_thread.run_sync(os.fsync, sink.fd)
        await on_progress(sink.completed)
        return await _finish(
            part,
            remote,
            sha,
            b3,
            resumed_from=sink.started_at,
            downloaded=sink.completed - sink.started_at,
        )
    except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
        if sink is not None:
            await sink.checkpoint()  # keep what arrived for the next attempt
        raise TransportError(
            f"GET {remote.url}: {type(exc).__name__} after "
            f"{sink.completed if sink else offset} bytes: {exc}"
        ) from exc
    finally:
        if sink is not None:
            sink.close()
        response.release()


async def _finish(
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
