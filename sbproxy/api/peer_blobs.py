"""The gateway's artifact blob route for fleet peers (issue 33, "Artifacts from peers").

``GET /fleet/v1/blobs/sha256/{hex}`` from a fleet peer -- its own node credential with
``X-Sbproxy-Peer-Node``, or the shared credential while it is accepted
(:func:`~sbproxy.api.peer_auth.peer_refusal`: 401 ``peer_unauthorized`` otherwise) -- serves
the bytes of one verified file of this host's cache:

* ``{hex}`` must be 64 lowercase hex characters (400 ``invalid_blob_digest`` otherwise), so
  a path can never leave ``blobs/sha256``;
* only a blob a published artifact lists (its SHA-256 was checked when it was pulled) and
  whose size on disk is that artifact's size for it is served; any other -- absent, half
  written, another size -- is 404 ``blob_not_held`` and the caller asks the next source;
* ``Range: bytes=N-`` or ``bytes=N-M`` answers 206 with ``Content-Range``; a start at or
  past the end answers 416 with ``Content-Range: bytes */size``; ``If-Range`` with another
  ETag than this blob's answers the whole file (200). The ETag is ``"sha256:<hex>"``: the
  content's own name, equal on every member, so a resume never mixes two files.

The bytes are read from the file in 1 MiB blocks on a worker thread and streamed; the caller
checks the whole file's SHA-256 against the catalog before it keeps anything.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio.to_thread
from litestar import Request, Response, get
from litestar.handlers import HTTPRouteHandler
from litestar.response import Stream

from sbproxy.api.peer_auth import PeerChecker, peer_refusal
from sbproxy.model_host.artifacts import ArtifactCache
from sbproxy.model_host.artifacts.peers import PEER_BLOB_PREFIX, is_sha256

__all__ = ["peer_blob_handlers", "verified_blob"]

BLOCK_BYTES = 1024 * 1024
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


def verified_blob(cache: ArtifactCache, sha256: str) -> tuple[Path, int] | None:
    """``(path, size)`` of the blob ``sha256`` when a published artifact of ``cache`` lists
    it and the file on disk has that size; else ``None``."""
    for metadata in cache.published():
        for item in metadata.files:
            if item.sha256 == sha256:
                path = cache.blob(sha256)
                held = path.is_file() and not path.is_symlink()
                if held and path.stat().st_size == item.size_bytes:
                    return path, item.size_bytes
                return None
    return None


def _error(status: int, code: str, error: str, **headers: str) -> Response[dict[str, object]]:
    return Response({"code": code, "error": error}, status_code=status, headers=headers)


async def _read(path: Path, start: int, end: int) -> AsyncIterator[bytes]:
    """Bytes ``[start, end)`` of ``path`` in blocks, each read on a worker thread."""
    handle = await anyio.to_thread.run_sync(path.open, "rb")
    try:
        await anyio.to_thread.run_sync(handle.seek, start)
        left = end - start
        while left > 0:
            block = await anyio.to_thread.run_sync(handle.read, min(BLOCK_BYTES, left))
            if not block:
                return
            left -= len(block)
            yield block
    finally:
        handle.close()


def peer_blob_handlers(
    check: PeerChecker | None,
    shared: Callable[[], str | None],
    cache: Callable[[], ArtifactCache],
) -> list[HTTPRouteHandler]:
    """The blob route (module docstring). ``check`` is the fleet agent's node credential
    check, ``shared()`` the shared fleet credential while it is accepted and ``cache()`` the
    cache this host serves now, the last two read at each request."""

    @get(f"{PEER_BLOB_PREFIX}{{sha256:str}}", include_in_schema=False)
    async def blob(request: Request[Any, Any, Any], sha256: str) -> Response[Any]:
        """One verified blob of this host's cache, whole or a byte range."""
        refused = peer_refusal(request.headers, check=check, shared=shared())
        if refused is not None:
            return refused
        if not is_sha256(sha256):
            return _error(
                400,
                "invalid_blob_digest",
                "a blob is named by its SHA-256: 64 lowercase hex characters",
            )
        found = await anyio.to_thread.run_sync(verified_blob, cache(), sha256)
        if found is None:
            return _error(
                404,
                "blob_not_held",
                f"this host holds no verified blob sha256:{sha256}; ask another member or "
                "the upstream",
            )
        path, size = found
        etag = f'"sha256:{sha256}"'
        headers = {"ETag": etag, "Accept-Ranges": "bytes"}
        start, end, status = 0, size, 200
        wanted = (request.headers.get("range") or "").replace(" ", "")
        if_range = request.headers.get("if-range")
        if wanted and (if_range is None or if_range == etag):
            match = _RANGE.fullmatch(wanted)
            if match is None:
                return _error(416, "invalid_range", f"unsupported Range {wanted!r}",
                              **{"Content-Range": f"bytes */{size}"})  # fmt: skip
            start = int(match.group(1))
            end = min(size, int(match.group(2)) + 1) if match.group(2) else size
            if start >= size or end <= start:
                return _error(416, "invalid_range", f"Range {wanted!r} is past the end",
                              **{"Content-Range": f"bytes */{size}"})  # fmt: skip
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        headers["Content-Length"] = str(end - start)
        return Stream(
            _read(path, start, end),
            status_code=status,
            media_type="application/octet-stream",
            headers=headers,
        )

    return [blob]
