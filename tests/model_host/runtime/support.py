"""Test builders for the runtime: synthetic GGUF files, a manual clock, and the checks that
the live engine processes are exactly the ones status shows."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import gguf
import psutil

from tests.model_host.engines.support import FAKE_SERVER

if TYPE_CHECKING:
    from sbproxy.model_host.runtime.manager import RuntimeManager
    from sbproxy.store import JobRecord
    from tests.model_host.runtime.host import Host


class ManualClock:
    """A :class:`~sbproxy.model_host.runtime.clock.Clock` that moves only when a test says:
    sleepers wake when :meth:`advance` passes their deadline."""

    def __init__(self, start: float = 1_000.0) -> None:
        self._now = start
        self._sleepers: list[tuple[float, anyio.Event]] = []

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            return
        wake = anyio.Event()
        self._sleepers.append((self._now + seconds, wake))
        await wake.wait()

    @property
    def sleepers(self) -> int:
        """Tasks asleep on this clock now."""
        return len(self._sleepers)

    def advance(self, seconds: float) -> None:
        """Move time on and wake the sleepers whose deadline passed."""
        self._now += seconds
        due = [entry for entry in self._sleepers if entry[0] <= self._now]
        self._sleepers = [entry for entry in self._sleepers if entry[0] > self._now]
        for _, wake in due:
            wake.set()


def write_gguf(
    path: Path,
    *,
    arch: str = "llama",
    block_count: int | None = 4,
    head_count: int | list[int] | None = 8,
    head_count_kv: int | list[int] | None = 2,
    key_length: int | None = None,
    value_length: int | None = None,
    embedding_length: int | None = 512,
    context_length: int | None = 4096,
    vocab: int = 2000,
    big_endian: bool = False,
) -> Path:
    """Write a GGUF (v3, no tensors) with a vocabulary and other arrays to skip."""
    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    writer = gguf.GGUFWriter(path, arch, endianess=endian)
    writer.add_name("synthetic")
    # Arrays before the shape keys, so the reader must skip them to get there.
    writer.add_token_list([f"tok{i}\N{LATIN SMALL LETTER E WITH ACUTE}" for i in range(vocab)])
    writer.add_token_scores([float(i) for i in range(vocab)])
    writer.add_token_types([1] * vocab)
    writer.add_array("synthetic.nested", [[1, 2], [3, 4, 5]])
    writer.add_chat_template("{{ messages }}" * 200)
    if block_count is not None:
        writer.add_block_count(block_count)
    if head_count is not None:
        writer.add_head_count(head_count)
    if head_count_kv is not None:
        writer.add_head_count_kv(head_count_kv)
    if key_length is not None:
        writer.add_key_length(key_length)
    if value_length is not None:
        writer.add_value_length(value_length)
    if embedding_length is not None:
        writer.add_embedding_length(embedding_length)
    if context_length is not None:
        writer.add_context_length(context_length)
    writer.add_feed_forward_length(1024)
    writer.add_rope_freq_base(10000.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


async def finished(host: Host, job_id: str, timeout_s: float = 20) -> JobRecord:
    """Poll a job the manager runs until it ends (never run it from the test: that would
    execute it outside its command's turn)."""
    with anyio.fail_after(timeout_s):
        while True:
            job = await host.engine.get(job_id)
            if job.terminal:
                return job
            await anyio.sleep(0.02)


async def until(predicate: Any, timeout_s: float = 15) -> None:
    with anyio.fail_after(timeout_s):
        while not predicate():
            await anyio.sleep(0.02)


def live_engines(root: Path) -> set[int]:
    """Pids of the stand-in engines of this test's host that are running now."""
    found = set()
    for child in psutil.Process(os.getpid()).children(recursive=True):
        try:
            argv = child.cmdline()
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.Error:
            continue
        if str(FAKE_SERVER) in argv and any(str(root) in arg for arg in argv):
            found.add(child.pid)
    return found


def shown(manager: RuntimeManager) -> set[int]:
    """Engine pids that status reports as serving."""
    return {s.extra["engine_pid"] for s in manager.status() if s.extra.get("engine_pid")}


async def converged(host: Host) -> None:
    """At rest, the live engine processes are exactly the ones status shows."""
    await until(lambda: live_engines(host.root) == shown(host.manager), timeout_s=10)
