"""The download itself: the threaded sink, checkpoints, and cancelling a transfer."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from blake3 import blake3

from sbproxy.model_host.artifacts._sink import PartialSink
from sbproxy.model_host.artifacts.download import RemoteFile, download_file
from tests.model_host.artifacts.support import REPO, REVISION
from tests.support.hf_server import HfMirror

pytestmark = pytest.mark.anyio


@pytest.fixture
def mirror() -> Iterator[HfMirror]:
    with HfMirror() as server:
        yield server


def blocks(seed: int, count: int) -> list[bytes]:
    """``count`` pseudo-random blocks of uneven sizes (1 byte to ~300 KiB)."""
    return [
        hashlib.shake_256(f"{seed}:{i}".encode()).digest(1 + (i * 7919) % 300_000)
        for i in range(count)
    ]


def open_sink(path: Path, record: list[int], *, checkpoint_bytes: int) -> PartialSink:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    return PartialSink(
        fd,
        offset=0,
        sha=hashlib.sha256(),
        b3=blake3(),
        record=record.append,
        checkpoint_bytes=checkpoint_bytes,
        checkpoint_s=60.0,
    )


def test_sink_hashes_and_writes_every_block_in_order(tmp_path: Path) -> None:
    data = blocks(1, 200)
    whole = b"".join(data)
    sha, b3 = hashlib.sha256(), blake3()
    recorded: list[int] = []
    fd = os.open(tmp_path / "part", os.O_WRONLY | os.O_CREAT, 0o644)
    sink = PartialSink(
        fd,
        offset=0,
        sha=sha,
        b3=b3,
        record=recorded.append,
        checkpoint_bytes=4 * 1024 * 1024,
        checkpoint_s=60.0,
    )
    try:
        for i in range(0, len(data), 3):
            group = data[i : i + 3]
            sink.put(group, sum(map(len, group)))
        sink.finish()
    finally:
        sink.close()
    assert (tmp_path / "part").read_bytes() == whole
    assert sha.hexdigest() == hashlib.sha256(whole).hexdigest()
    assert b3.hexdigest() == blake3(whole).hexdigest()
    # Checkpoints came from the writer while it ran: each counts only bytes already written.
    assert recorded, "a 4 MiB checkpoint interval over ~30 MB must checkpoint"
    assert recorded == sorted(recorded)
    assert all(0 < done <= len(whole) for done in recorded)


def test_sink_checkpoint_records_every_byte_put_so_far(tmp_path: Path) -> None:
    recorded: list[int] = []
    sink = open_sink(tmp_path / "part", recorded, checkpoint_bytes=1 << 40)
    try:
        sink.checkpoint()  # nothing written yet: still a checkpoint at 0
        data = blocks(2, 50)
        for block in data:
            sink.put((block,), len(block))
        sink.checkpoint()
        assert recorded == [0, sum(map(len, data))]
        assert (tmp_path / "part").stat().st_size == recorded[-1]
    finally:
        sink.close()


def test_sink_raises_a_stage_failure_to_the_producer(tmp_path: Path) -> None:
    def no_space(done: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    fd = os.open(tmp_path / "part", os.O_WRONLY | os.O_CREAT, 0o644)
    sink = PartialSink(
        fd,
        offset=0,
        sha=hashlib.sha256(),
        b3=blake3(),
        record=no_space,
        checkpoint_bytes=1 << 40,
        checkpoint_s=60.0,
    )
    try:
        sink.put((b"x" * 1000,), 1000)
        with pytest.raises(OSError, match="No space left"):
            sink.checkpoint()
        with pytest.raises(OSError, match="No space left"):
            sink.put((b"y",), 1)
    finally:
        sink.close()


async def test_cancelled_download_returns_at_once_and_keeps_a_resumable_partial(
    tmp_path: Path, mirror: HfMirror
) -> None:
    data = hashlib.shake_256(b"cancel").digest(24_000_000)
    mirror.add_file(REPO, REVISION, "model.gguf", data, throttle_bps=8 * 1024 * 1024)
    remote = RemoteFile(
        url=f"{mirror.url}/{REPO}/resolve/{REVISION}/model.gguf",
        path="model.gguf",
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
    )
    part = tmp_path / "model.gguf.part"
    progress: list[int] = []

    async def on_progress(done: int) -> None:
        progress.append(done)

    # Cancel once bytes flow (not after a fixed time: on a loaded machine the first byte
    # may take longer than that), while the throttled transfer blocks in a read.
    scope = anyio.CancelScope()
    cancelled_at: list[float] = []

    async def cancel_once_flowing() -> None:
        while not progress or progress[-1] < 1024 * 1024:
            await anyio.sleep(0.01)
        cancelled_at.append(time.monotonic())
        scope.cancel()

    async with anyio.create_task_group() as group:
        group.start_soon(cancel_once_flowing)
        with scope:
            await download_file(
                remote, part=part, token=None, on_progress=on_progress, check_cancelled=lambda: None
            )
    # The blocked read was interrupted, not waited out (the rest takes ~2.8 s at 8 MiB/s).
    assert time.monotonic() - cancelled_at[0] < 2.0
    state = json.loads(part.with_name("model.gguf.part.resume.json").read_text())
    assert 0 < state["completed_bytes"] < len(data)
    kept = part.stat().st_size
    assert state["completed_bytes"] <= kept < len(data)

    result = await download_file(
        remote, part=part, token=None, on_progress=on_progress, check_cancelled=lambda: None
    )
    # The resume starts from the partial's length, past its last checkpoint if need be.
    assert result.resumed_from == kept
    assert result.sha256 == remote.sha256
    assert part.read_bytes() == data
    gets = [(r.status, r.range_start) for r in mirror.requests if r.method == "GET"]
    assert gets == [(200, None), (206, kept)]
    assert progress[-1] == len(data)
