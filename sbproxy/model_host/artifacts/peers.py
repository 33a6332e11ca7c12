"""Artifact files from fleet peers: a pull asks the members that hold the artifact first.

On a fleet (``cluster_authority``, PostgreSQL journal) every member reports the artifacts its
cache holds (``fleet_nodes.artifact_inventory_json``). The fleet gives the pull workflow a
:class:`PeerSources` resource; the ``fetch:<path>`` step then tries, in order, each member
that reported the artifact's digest verified -- ``GET <advertise_url>/fleet/v1/blobs/sha256/
<hex>`` on its gateway with ``Authorization: Bearer <this node's own node credential>`` and
``X-Sbproxy-Peer-Node: <this node's id>`` (or the shared fleet credential while it is
accepted) -- and the catalog's upstream last. A single host has no such resource and pulls
from the upstream as before.

**One upstream download per fleet.** Members report pulls under way too (unverified, with
the bytes so far). A pull that finds no member holding the artifact waits once for
``settle_s`` (two heartbeats: its own report reaches the others, theirs reach it); then the
member with the smallest node id among those pulling it fetches from the upstream, and every
other one waits while that member's reported bytes move and fetches from it once it reports
the artifact verified. A member whose bytes stand still for :data:`PEER_STALL_S`, or that
leaves, no longer counts: the next in id order goes to the upstream. Placing three replicas
of one artifact on an empty fleet thus takes its bytes from the upstream once.

What each peer failure does (the next source is tried at once; the peer's bytes are never
trusted before the SHA-256 of the whole file matched the catalog's):

* a stream cut mid-transfer (``transport``) after bytes arrived: the partial is kept with
  its resume state naming that peer's URL, and the same peer is asked again from there with
  ``Range``/``If-Range`` (:data:`PEER_RESUMES` times; a job restarted after a crash does the
  same). Connection refused, a read timeout, or a cut again: the next source; another
  source's URL does not match the partial's state, so the partial is discarded and that
  source starts from byte 0;
* 401 ``peer_unauthorized``, 404 ``blob_not_held`` or any other status (``http_status``):
  nothing was written;
* wrong bytes or a truncated body that the peer claims complete (``digest_mismatch``,
  ``size_mismatch``): the partial is discarded (:func:`~sbproxy.model_host.artifacts.
  download.download_file`), nothing is promoted, nothing published.

The credential is read at each fetch through :attr:`PeerSources.credential` (never stored in
the job, its events or a partial's resume state); it goes only to the peer's own origin.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import anyio

from sbproxy.errors import SbproxyError
from sbproxy.model_host.artifacts.download import (
    DownloadResult,
    RemoteFile,
    download_file,
    partial_length,
)
from sbproxy.model_host.artifacts.errors import (
    DigestMismatch,
    HttpStatusError,
    SizeMismatch,
    TransportError,
)

__all__ = [
    "PEER_BLOB_PREFIX",
    "PEER_CONNECT_TIMEOUT_S",
    "PEER_READ_TIMEOUT_S",
    "PEER_RESUMES",
    "PEER_STALL_S",
    "PeerFailure",
    "PeerHolder",
    "PeerSources",
    "download_from_peers",
    "is_sha256",
]

logger = logging.getLogger(__name__)

# The header a fleet peer names itself in beside its credential (api/peer_auth.py).
PEER_NODE_HEADER = "X-Sbproxy-Peer-Node"

PEER_BLOB_PREFIX = "/fleet/v1/blobs/sha256/"
# A peer is on the fleet's own network: a peer that does not answer is left for the next
# source well before the upstream's own patience (60 s) would run out.
PEER_CONNECT_TIMEOUT_S = 5.0
PEER_READ_TIMEOUT_S = 15.0
# A member ahead of this one pulling the same artifact is waited for while its reported
# bytes move; it counts as gone once they stood still this long.
PEER_STALL_S = 30.0
WAIT_POLL_S = 0.25
# A transfer from a peer cut after it brought bytes is continued from the partial this many
# times (each with ``Range``) before the next source is asked.
PEER_RESUMES = 1
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# The failures after which the next source is tried (anything else -- disk full,
# cancellation -- ends the attempt as it would for the upstream).
_PEER_ERRORS = (TransportError, HttpStatusError, SizeMismatch, DigestMismatch)


def is_sha256(text: str) -> bool:
    """Whether ``text`` is a lowercase hex SHA-256 (64 characters): the only blob names a
    peer serves, so that no request path can leave the blob store."""
    return bool(_SHA256.fullmatch(text))


@dataclass(frozen=True)
class PeerHolder:
    """A member that reported an artifact verified in its cache.

    Attributes:
        node: Its node id.
        base_url: Its gateway (``node.advertise_url``), without a trailing ``/``.
    """

    node: str
    base_url: str

    def blob_url(self, sha256: str) -> str:
        """The URL of the blob ``sha256`` on this member's gateway."""
        return f"{self.base_url.rstrip('/')}{PEER_BLOB_PREFIX}{sha256}"


@dataclass(frozen=True)
class PeerFailure:
    """One peer that did not deliver a file: its node, the error's reason code and message."""

    node: str
    code: str
    message: str


class PeerSources:
    """The fleet's answer to "who holds this artifact?", a resource of the pull workflow.

    Args:
        node: This node's id.
        holders: ``holders(artifact_digest)`` -> the members (not this one) that reported the
            artifact verified, in the order to ask them.
        credential: The fleet credential in force now (``None``: no peer is asked).
        fetching: ``fetching(artifact_digest)`` -> ``{node: bytes so far}`` of the other
            live members that report a pull of it under way.
        members: How many other live members there are.
        settle_s: How long this node's own report of a pull takes to reach the others (two
            heartbeats and a margin): a pull that finds no holder waits this long once
            before it decides who goes to the upstream.
    """

    def __init__(
        self,
        *,
        node: str,
        holders: Callable[[str], Sequence[PeerHolder]],
        credential: Callable[[], str | None],
        fetching: Callable[[str], Mapping[str, int]] = lambda _digest: {},
        members: Callable[[], int] = lambda: 0,
        settle_s: float = 0.0,
    ) -> None:
        self.node = node
        self._holders = holders
        self._credential = credential
        self._fetching = fetching
        self._members = members
        self.settle_s = settle_s

    def holders(self, artifact_digest: str) -> list[PeerHolder]:
        """The members to ask for ``artifact_digest``'s files, in order."""
        return list(self._holders(artifact_digest))

    def fetching(self, artifact_digest: str) -> dict[str, int]:
        """``{node: bytes so far}`` of the other live members pulling ``artifact_digest``
        now (reported unverified)."""
        return dict(self._fetching(artifact_digest))

    def members(self) -> int:
        """Live members other than this one."""
        return self._members()

    def credential(self) -> str | None:
        """The fleet credential in force now."""
        return self._credential()


async def download_from_peers(
    sources: PeerSources,
    *,
    artifact_digest: str,
    path: str,
    sha256: str,
    size: int,
    part: Path,
    on_progress: Callable[[int], Awaitable[None]],
    check_cancelled: Callable[[], None],
    on_failure: Callable[[PeerFailure], Awaitable[None]],
) -> tuple[PeerHolder, DownloadResult] | None:
    """Fetch one file of ``artifact_digest`` from the first member that delivers it whole.

    Args:
        sources: Who holds what, and the credential.
        artifact_digest: The artifact the file belongs to (what members report).
        path: The file's path in the artifact (for messages).
        sha256: The catalog's SHA-256 of the file (the blob's name; the check).
        size: The catalog's size of the file in bytes.
        part: The partial, resumed when its state names the same peer URL.
        on_progress: As :func:`~sbproxy.model_host.artifacts.download.download_file`.
        check_cancelled: As :func:`~sbproxy.model_host.artifacts.download.download_file`.
        on_failure: Awaited with each peer that failed, before the next one is asked.

    Returns:
        ``(holder, result)`` -- the verified partial and the member that served it -- or
        ``None`` when this node is the one to fetch from the upstream: no credential, no
        other member, a member failed to deliver, or no member holds it and none with a
        smaller id is pulling it (waited for while it moves, see the module docstring).

    Raises:
        DiskFull: ``disk_full`` (as for any download; the partial is kept).
    """
    credential = sources.credential()
    if not credential:
        return None
    failed: set[str] = set()
    settled = False
    progress: dict[str, tuple[int, float]] = {}
    while True:
        for holder in sources.holders(artifact_digest):
            if holder.node in failed:
                continue
            served = await _from_holder(
                holder,
                path=path,
                sha256=sha256,
                size=size,
                part=part,
                credential=credential,
                node=sources.node,
                on_progress=on_progress,
                check_cancelled=check_cancelled,
            )
            if isinstance(served, DownloadResult):
                return holder, served
            failed.add(holder.node)
            failure = PeerFailure(node=holder.node, code=served.code, message=_short(served))
            logger.warning(
                "peer %s did not deliver %s (%s) of artifact %s: [%s] %s; trying the next source",
                holder.node,
                path,
                sha256[:12],
                artifact_digest[:12],
                failure.code,
                failure.message,
            )
            await on_failure(failure)
        if failed or sources.members() == 0:
            return None  # a peer failed, or nobody else could hold it: the upstream now
        if not settled:
            # Let this node's own report of the pull reach the others (and theirs reach
            # it) before deciding who fetches from the upstream.
            settled = True
            await anyio.sleep(sources.settle_s)
            continue
        if not _ahead(sources, artifact_digest, progress, me=sources.node):
            return None  # this node is the one to fetch it from the upstream
        check_cancelled()
        await anyio.sleep(WAIT_POLL_S)


async def _from_holder(
    holder: PeerHolder,
    *,
    path: str,
    sha256: str,
    size: int,
    part: Path,
    credential: str,
    node: str,
    on_progress: Callable[[int], Awaitable[None]],
    check_cancelled: Callable[[], None],
) -> DownloadResult | SbproxyError:
    """The file from ``holder`` (``downloaded_bytes``: every byte it sent, cut transfers
    included), or the error it failed with. A transfer cut after it brought bytes is
    continued from the partial with ``Range`` (at most :data:`PEER_RESUMES` times per
    holder) before the holder counts as failed."""
    remote = RemoteFile(url=holder.blob_url(sha256), path=path, sha256=sha256, size=size)
    resumes = carried = 0
    while True:
        before = partial_length(part)
        try:
            result = await download_file(
                remote,
                part=part,
                token=credential,
                origin_headers={PEER_NODE_HEADER: node},
                on_progress=on_progress,
                check_cancelled=check_cancelled,
                read_timeout=PEER_READ_TIMEOUT_S,
                connect_timeout=PEER_CONNECT_TIMEOUT_S,
            )
        except TransportError as exc:
            if resumes >= PEER_RESUMES or partial_length(part) <= before:
                return exc
            resumes += 1
            carried += partial_length(part) - before
            logger.info(
                "peer %s: %s cut after %d bytes; continuing from there",
                holder.node,
                path,
                partial_length(part),
            )
            continue
        except _PEER_ERRORS as exc:
            return exc
        # What this holder sent in all: the cut transfers' bytes too.
        return replace(result, downloaded_bytes=result.downloaded_bytes + carried)


def _ahead(
    sources: PeerSources,
    artifact_digest: str,
    progress: dict[str, tuple[int, float]],
    *,
    me: str,
) -> bool:
    """Whether a member with a smaller node id is pulling the artifact and still moving:
    it fetches from the upstream, this node waits to fetch from it. A member whose reported
    bytes stood still for :data:`PEER_STALL_S` no longer counts (it failed or stopped)."""
    now = anyio.current_time()
    moving = False
    for node, done in sources.fetching(artifact_digest).items():
        if node >= me:
            continue
        seen, since = progress.get(node, (-1, now))
        if done != seen:
            progress[node] = (done, now)
            moving = True
        elif now - since < PEER_STALL_S:
            moving = True
    return moving


def _short(exc: SbproxyError) -> str:
    message = exc.message
    return message if len(message) <= 300 else message[:297] + "..."
