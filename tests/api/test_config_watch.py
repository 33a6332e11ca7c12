"""The configuration file watcher in-process, on real files and real watchfiles events: what
it notices (a ConfigMap symlink swap, a rename, an edit in place, a change only a poll can
see), what it ignores (a touch, an unreadable or half-written file, content it already
tried), and that it stops at once."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest

from sbproxy.api.config_state import ConfigState
from sbproxy.api.config_watch import ChangeSource, ConfigWatcher, read_digest, watched_directories
from tests.api.configmap import mount_configmap, update_configmap

pytestmark = pytest.mark.anyio

# Long enough that a test which passes within its deadline was woken by an event, not a poll.
NO_POLL_S = 600.0


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


async def until(predicate: object, timeout_s: float = 10) -> None:
    assert callable(predicate)
    with anyio.fail_after(timeout_s):
        while not predicate():
            await anyio.sleep(0.01)


async def ticks(
    directories: Sequence[Path], stopped: anyio.Event, poll_interval_s: float
) -> AsyncGenerator[object, None]:
    """A change source with no events at all: only the poll (a file system without inotify)."""
    while not stopped.is_set():
        with anyio.move_on_after(poll_interval_s):
            await stopped.wait()
        if not stopped.is_set():
            yield set()


@dataclass
class Watching:
    state: ConfigState
    reloads: list[str] = field(default_factory=list)
    stopped: anyio.Event = field(default_factory=anyio.Event)

    async def next_looks(self, count: int = 1) -> None:
        """Wait until the watcher has looked at the file ``count`` more times."""
        target = self.state.looks + count
        await until(lambda: self.state.looks >= target)


@asynccontextmanager
async def watching(
    path: Path,
    *,
    commit: bool = True,
    poll_interval_s: float = NO_POLL_S,
    changes: ChangeSource | None = None,
) -> AsyncIterator[Watching]:
    """A watcher on ``path`` whose reload records the digest and, with ``commit``, makes it
    the active one (as a committed reload does); yielded once its watch is established."""
    state = ConfigState(path=path, resolved_path=None, content_sha256=read_digest(path), revision=1)
    seen = Watching(state=state)

    async def reload(digest: str) -> None:
        seen.reloads.append(digest)
        if commit:
            state.content_sha256 = digest

    extra = {"changes": changes} if changes is not None else {}
    watcher = ConfigWatcher(
        path=path, state=state, reload=reload, poll_interval_s=poll_interval_s, **extra
    )
    async with anyio.create_task_group() as group:
        group.start_soon(watcher.run, seen.stopped)
        await until(lambda: state.looks >= 1)
        if changes is None:
            await _established(seen, path.absolute().parent)
        try:
            yield seen
        finally:
            seen.stopped.set()


async def _established(seen: Watching, directory: Path) -> None:
    """Until an event reaches the watcher: a file written beside ``path`` wakes it."""
    probe = directory / ".probe"
    with anyio.fail_after(10):
        while True:
            target = seen.state.looks + 1
            probe.write_text(str(time.monotonic()))
            with anyio.move_on_after(0.3):
                await until(lambda target=target: seen.state.looks >= target)
                break
    probe.unlink()
    await seen.next_looks()  # the probe's removal, seen before the test starts


def test_watched_directories_follow_a_configmap_mount(tmp_path: Path) -> None:
    volume = tmp_path / "config"
    mount_configmap(volume, {"sb.yml": "a: 1\n"}, stamp="2026_12_01_00_00_00.1")
    path = volume / "sb.yml"
    first = watched_directories(path)
    assert first == (volume.resolve(), (volume / "..2026_12_01_00_00_00.1").resolve())
    update_configmap(volume, {"sb.yml": "a: 2\n"}, stamp="2026_12_01_00_00_00.2")
    assert watched_directories(path) == (
        volume.resolve(),
        (volume / "..2026_12_01_00_00_00.2").resolve(),
    )


def test_watched_directories_of_a_plain_file_and_a_dangling_link(tmp_path: Path) -> None:
    plain = tmp_path / "sb.yml"
    plain.write_text("a: 1\n")
    assert watched_directories(plain) == (tmp_path.resolve(),)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "link.yml"
    link.symlink_to(elsewhere / "missing" / "sb.yml")
    # The missing directory cannot be watched: its nearest existing ancestor is, where it
    # would be created.
    assert watched_directories(link) == (tmp_path.resolve(), elsewhere.resolve())


async def test_a_configmap_swap_is_noticed(tmp_path: Path) -> None:
    volume = tmp_path / "config"
    mount_configmap(volume, {"sb.yml": "a: 1\n"}, stamp="2026_12_01_00_00_00.1")
    async with watching(volume / "sb.yml") as seen:
        update_configmap(volume, {"sb.yml": "a: 2\n"}, stamp="2026_12_01_00_00_00.2")
        await until(lambda: seen.reloads == [sha("a: 2\n")])
        # The watcher re-arms on the new payload directory; a swap in the moment between
        # its look and its new watch is left to the poll (off here), so wait for the watch.
        await _established(seen, volume)
        # Now watching the new payload directory: the next swap is noticed as well.
        update_configmap(volume, {"sb.yml": "a: 3\n"}, stamp="2026_12_01_00_00_00.3")
        await until(lambda: seen.reloads == [sha("a: 2\n"), sha("a: 3\n")])


async def test_a_file_replaced_by_rename_and_one_edited_in_place_are_noticed(
    tmp_path: Path,
) -> None:
    path = tmp_path / "sb.yml"
    path.write_text("a: 1\n")
    async with watching(path) as seen:
        staged = tmp_path / ".sb.yml.tmp"
        staged.write_text("a: 2\n")
        staged.replace(path)
        await until(lambda: seen.reloads == [sha("a: 2\n")])
        with path.open("r+") as file:  # the same inode, rewritten
            file.write("a: 3\n")
        await until(lambda: seen.reloads == [sha("a: 2\n"), sha("a: 3\n")])


async def test_a_touch_that_keeps_the_content_reloads_nothing(tmp_path: Path) -> None:
    path = tmp_path / "sb.yml"
    path.write_text("a: 1\n")
    async with watching(path) as seen:
        os.utime(path)
        await seen.next_looks()
        path.write_text("a: 1\n")  # rewritten with the same bytes
        await seen.next_looks()
        assert seen.reloads == []
        # Events are looked at in order: a real change after them is the only reload.
        path.write_text("a: 2\n")
        await until(lambda: seen.reloads == [sha("a: 2\n")])


async def test_a_change_without_events_is_found_by_the_poll(tmp_path: Path) -> None:
    path = tmp_path / "sb.yml"
    path.write_text("a: 1\n")
    async with watching(path, poll_interval_s=0.05, changes=ticks) as seen:
        path.write_text("a: 2\n")
        await until(lambda: seen.reloads == [sha("a: 2\n")])


async def test_an_unreadable_file_is_looked_at_again_not_reloaded(tmp_path: Path) -> None:
    target = tmp_path / "real.yml"
    target.write_text("a: 1\n")
    path = tmp_path / "sb.yml"
    path.symlink_to(target)
    async with watching(path, poll_interval_s=0.05, changes=ticks) as seen:
        target.unlink()  # the link dangles: nothing to read
        await seen.next_looks(3)
        assert seen.reloads == []
        target.write_text("a: 2\n")
        await until(lambda: seen.reloads == [sha("a: 2\n")])


async def test_a_half_written_file_waits_for_its_content(tmp_path: Path) -> None:
    path = tmp_path / "sb.yml"
    path.write_text("a: 1\n")
    async with watching(path) as seen:
        path.write_text("")  # truncated, about to be written
        await seen.next_looks()
        assert seen.reloads == []
        path.write_text("a: 2\n")
        await until(lambda: seen.reloads == [sha("a: 2\n")])


async def test_a_file_left_empty_is_reloaded_once(tmp_path: Path) -> None:
    path = tmp_path / "sb.yml"
    path.write_text("a: 1\n")
    async with watching(path, commit=False, poll_interval_s=0.05, changes=ticks) as seen:
        path.write_text("")
        await until(lambda: seen.reloads == [sha("")])  # a later look found it still empty
        await seen.next_looks(3)
        assert seen.reloads == [sha("")]


async def test_content_that_failed_is_not_retried_until_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "sb.yml"
    path.write_text("a: 1\n")
    async with watching(path, commit=False, poll_interval_s=0.05, changes=ticks) as seen:
        path.write_text("bad: [\n")
        await until(lambda: seen.reloads == [sha("bad: [\n")])
        await seen.next_looks(3)
        assert seen.reloads == [sha("bad: [\n")]  # reported once, not at every poll
        path.write_text("a: 2\n")
        await until(lambda: seen.reloads == [sha("bad: [\n"), sha("a: 2\n")])


async def test_the_watcher_stops_within_100_ms(tmp_path: Path) -> None:
    path = tmp_path / "sb.yml"
    path.write_text("a: 1\n")
    state = ConfigState(path=path, resolved_path=None, content_sha256=sha("a: 1\n"), revision=1)

    async def reload(digest: str) -> None:
        raise AssertionError("nothing changed")

    watcher = ConfigWatcher(path=path, state=state, reload=reload, poll_interval_s=NO_POLL_S)
    stopped = anyio.Event()
    seen = Watching(state=state, stopped=stopped)
    ended: list[float] = []

    async def run() -> None:
        await watcher.run(stopped)
        ended.append(time.monotonic())

    async with anyio.create_task_group() as group:
        group.start_soon(run)
        await until(lambda: state.looks >= 1)
        await _established(seen, tmp_path)
        asked = time.monotonic()
        stopped.set()
        with anyio.fail_after(5):
            await until(lambda: bool(ended))
    # watchfiles checks its stop event every 50 ms; allow for a loaded 2-core machine.
    assert ended[0] - asked < 0.25


async def unwatchable(
    directories: Sequence[Path], stopped: anyio.Event, poll_interval_s: float
) -> AsyncGenerator[object, None]:
    """A change source that fails as inotify does when the watch limit is reached."""
    if not stopped.is_set():
        raise OSError(28, "OS file watch limit reached")
    yield set()


async def test_a_directory_that_cannot_be_watched_falls_back_to_the_poll(tmp_path: Path) -> None:
    path = tmp_path / "sb.yml"
    path.write_text("a: 1\n")
    async with watching(path, poll_interval_s=0.05, changes=unwatchable) as seen:
        await seen.next_looks(2)
        path.write_text("a: 2\n")
        await until(lambda: seen.reloads == [sha("a: 2\n")])
