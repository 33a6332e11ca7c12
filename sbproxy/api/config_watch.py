"""Watching the configuration file: reload when its content changes, however it changed.

A file can change in ways no event names: a Kubernetes ConfigMap mount is ``sb.yml ->
..data/sb.yml`` with ``..data -> ..<timestamp>``, and an update writes a new
``..<timestamp2>/sb.yml`` and renames a fresh ``..data`` symlink over the old one -- the
events name ``..data_tmp`` and ``..data``, never ``sb.yml``, and the file's inode is a new
one. Editors replace a file by rename, or rewrite it in place. So the watcher does not follow
one name or one inode: it watches every directory the path leads through (the file's own
directory and the directory of each symlink hop), and on *any* event there -- and every
``poll_interval_s`` without one, a safety net for file systems that send no events (NFS,
some container mounts) -- it reads the file through its path and compares the SHA-256 of
its content with the active one. Only a different content reloads; a ``touch`` reloads
nothing.

A file that cannot be read at that moment (missing between two renames, permission denied)
is not a reload at all: it is read again at the next event or poll. An empty file is taken
for one being rewritten in place (truncated, not yet written) until a later look finds it
still empty. A content that was tried and refused or failed is not tried again until the
content changes again (``SIGHUP`` or ``sbproxy apply`` retries it on demand), so a bad edit
is reported once, not at every poll.

Why watchfiles: it coalesces an editor's burst of writes and renames into one batch, runs
inotify/FSEvents in a Rust thread, and can wake on a timeout for the poll
(``yield_on_timeout``). Its wait runs in a worker thread that a cancellation cannot
interrupt, only its stop event (checked every 50 ms), so the server sets ``stopped`` before
cancelling the watcher: it then ends within about 100 ms.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import anyio
import anyio.to_thread

from sbproxy.api.config_state import ConfigState

__all__ = [
    "DEFAULT_POLL_INTERVAL_S",
    "ChangeSource",
    "ConfigWatcher",
    "read_digest",
    "watched_directories",
]

logger = logging.getLogger(__name__)

# Seconds between two looks at the file when no event arrives: the worst-case delay on a
# file system without change events. One read and hash of a few KiB each time.
DEFAULT_POLL_INTERVAL_S: Final = 2.0
# The kernel's own limit on symlinks followed in one path lookup (Linux MAXSYMLINKS).
MAX_SYMLINK_HOPS: Final = 40
_EMPTY_SHA256: Final = hashlib.sha256(b"").hexdigest()

ChangeSource = Callable[[Sequence[Path], anyio.Event, float], AsyncGenerator[object, None]]
"""``(directories, stopped, poll_interval_s)`` -> an iterator that yields whenever something
changed in one of ``directories`` and after every ``poll_interval_s`` without a change, and
ends when ``stopped`` is set."""


def _absolute(path: Path) -> Path:
    """``path`` made absolute and normalised (``..`` removed) without following symlinks."""
    return Path(os.path.normpath(path.absolute()))


def watched_directories(path: Path) -> tuple[Path, ...]:
    """The directories whose entries decide what reading ``path`` returns, each resolved,
    existing ones only, without duplicates, in a stable order.

    That is the directory ``path`` names, the directory of every symlink hop from there
    (``sb.yml -> ..data/sb.yml``: ``..data``'s directory, resolved), and the directory the
    file finally resolves to (``..<timestamp>``); for one that does not exist, its nearest
    existing ancestor. Renaming any entry on the way changes an entry of one of them.
    """
    found: list[Path] = []

    def add(directory: Path) -> None:
        # A directory that does not exist (yet) is watched through the nearest ancestor
        # that does, where it would appear.
        for candidate in (directory, *directory.parents):
            try:
                resolved = candidate.resolve(strict=True)
            except (OSError, RuntimeError):  # missing, or a loop (RuntimeError before 3.13)
                continue
            if resolved.is_dir() and resolved not in found:
                found.append(resolved)
            return

    current = _absolute(path)
    for _ in range(MAX_SYMLINK_HOPS):
        add(current.parent)
        if not current.is_symlink():
            break
        try:
            target = current.readlink()
        except OSError:
            break
        current = _absolute(current.parent / target)
    with contextlib.suppress(OSError, RuntimeError):
        add(path.resolve().parent)
    return tuple(found)


def read_digest(path: Path) -> str | None:
    """SHA-256 (hex) of the content read through ``path`` now, following symlinks; ``None``
    when it cannot be read at the moment (missing, a directory, permission denied)."""
    try:
        with path.open("rb") as file:
            return hashlib.file_digest(file, "sha256").hexdigest()
    except OSError:
        return None


async def watchfiles_changes(
    directories: Sequence[Path], stopped: anyio.Event, poll_interval_s: float
) -> AsyncGenerator[object, None]:
    """The default :data:`ChangeSource`: watchfiles on ``directories`` (not recursive, no
    filter: any entry may be a hop of the path), waking at least every ``poll_interval_s``.

    Raises:
        OSError: a directory cannot be watched (removed meanwhile, out of inotify watches).
        RuntimeError: watchfiles' ``WatchfilesRustInternalError``.
    """
    import watchfiles

    watching = watchfiles.awatch(
        *directories,
        watch_filter=None,
        stop_event=stopped,
        rust_timeout=max(1, round(poll_interval_s * 1000)),
        yield_on_timeout=True,
        recursive=False,
    )
    async with contextlib.aclosing(watching):  # lets go of the watches at once
        async for changes in watching:
            yield changes


@dataclass
class ConfigWatcher:
    """Reload when the content of the file at ``path`` changes (see the module docstring).

    Attributes:
        path: The configuration file, as the host was started with it (not resolved: a
            symlink is followed at every look).
        state: The host's configuration state: its ``content_sha256`` is the content the
            host runs now; every look is counted in it.
        reload: Reload to the file; given the digest the watcher read. It records its
            outcome in ``state``, logs it, and does not raise a reload failure.
        poll_interval_s: Seconds between looks when no event arrives.
        changes: Where events come from (default: watchfiles); injectable for tests.
    """

    path: Path
    state: ConfigState
    reload: Callable[[str], Awaitable[None]]
    poll_interval_s: float = DEFAULT_POLL_INTERVAL_S
    changes: ChangeSource = watchfiles_changes
    _tried: str | None = field(default=None, init=False, repr=False)
    _pending_empty: bool = field(default=False, init=False, repr=False)
    _warned: bool = field(default=False, init=False, repr=False)

    async def run(self, stopped: anyio.Event) -> None:
        """Watch until ``stopped`` is set (within about 100 ms of it)."""
        self._tried = self.state.content_sha256
        self.state.watching(poll_interval_s=self.poll_interval_s)
        while not stopped.is_set():
            await self.check()  # at the start, and whatever changed while re-watching
            directories = await anyio.to_thread.run_sync(watched_directories, self.path)
            if directories and await self._follow(directories, stopped):
                continue
            # Nothing on the way exists, it cannot be watched, or the events ended (at a
            # stop, the wait below ends at once): look again later.
            with anyio.move_on_after(self.poll_interval_s):
                await stopped.wait()

    async def _follow(self, directories: tuple[Path, ...], stopped: anyio.Event) -> bool:
        """Check at every event or poll until ``stopped``, until the path leads through
        other directories (a ConfigMap swap: the new ``..<timestamp>``) -- then ``True`` --
        or until the directories cannot be watched (logged once)."""
        async with contextlib.aclosing(
            self.changes(directories, stopped, self.poll_interval_s)
        ) as events:
            while True:
                try:
                    await anext(events)
                except StopAsyncIteration:
                    return False
                except (OSError, RuntimeError) as exc:  # RuntimeError: watchfiles' internal
                    log = logger.debug if self._warned else logger.warning
                    self._warned = True
                    log(
                        "cannot watch %s (%s); looking at the file every %.0f s",
                        ", ".join(map(str, directories)),
                        exc,
                        self.poll_interval_s,
                    )
                    return False
                await self.check()
                now = await anyio.to_thread.run_sync(watched_directories, self.path)
                if now != directories:
                    return True

    async def check(self) -> None:
        """Look at the file once; reload when its content is new (neither active nor
        tried already)."""
        digest = await anyio.to_thread.run_sync(read_digest, self.path)
        self.state.looked()
        if digest is None:
            return  # unreadable right now: looked at again at the next event or poll
        if digest == _EMPTY_SHA256 and not self._pending_empty and digest != self._tried:
            self._pending_empty = True  # most likely truncated to be rewritten: wait
            return
        self._pending_empty = False
        if digest == self.state.content_sha256:
            self._tried = digest
            return
        if digest == self._tried:
            return  # refused or failed already: reported once, until the content changes
        self._tried = digest
        logger.info("configuration %s changed (sha256 %s); reloading", self.path, digest[:12])
        await self.reload(digest)
