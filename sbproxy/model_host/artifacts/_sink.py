"""The pipeline that turns a download's body into a hashed, durable partial file.

The download's reader thread only receives the body and hands blocks of it over; three
threads consume every block, in order, each through its own bounded queue:

* ``sha256``: feeds the SHA-256 verifier;
* ``blake3``: feeds the BLAKE3 fingerprint;
* ``write``: writes the block to the partial (``os.writev``, no joining copy) and asks for a
  checkpoint when one is due.

A fourth thread, the syncer, makes checkpoints off the write path: it takes the offset the
writer had reached, ``fdatasync``-s the file (everything written before the call is then on
disk, whatever the writer appends meanwhile) and only then records that offset in the resume
state. So the state never counts a byte that is not durable, and neither the reader nor the
writer waits for the disk, which writes back while the transfer goes on.

Why threads pay off on two cores: ``hashlib`` and ``blake3`` release the GIL on buffers
larger than a few KiB and ``os.writev``/``os.fdatasync`` release it while in the kernel, so
reading, SHA-256 (about 1.7 GiB/s here), BLAKE3 (about 4 GiB/s) and the page-cache copy run
side by side instead of one after another (``benchmarks/pull.py`` measures the result).

Memory is bounded: the stages see the same block objects in the same order, so the blocks
alive are at most those in the fullest queue (:data:`QUEUE_BLOCKS`) plus one per stage.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from sbproxy.workflows import fault_point

__all__ = ["Block", "PartialSink"]

Block = Sequence[bytes]
# Blocks queued per stage: with blocks of about 1 MiB, at most ~16 MiB of body in flight.
QUEUE_BLOCKS = 16
# Linux refuses more buffers than this in one writev(2).
_IOV_MAX = 1024


class _Stage:
    """One consumer thread: applies ``work`` to every block, in order, from a bounded queue.

    After a failure the stage keeps taking blocks (dropping them) so that the producer never
    blocks on a dead consumer; the failure is raised on the producer's side.
    """

    def __init__(self, name: str, work: Callable[[Block], None]) -> None:
        self._work = work
        self.queue: queue.Queue[Block | None] = queue.Queue(maxsize=QUEUE_BLOCKS)
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"sbproxy-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            block = self.queue.get()
            try:
                if block is None:
                    return
                if self.failure is None:
                    self._work(block)
            except BaseException as exc:  # noqa: BLE001 - raised on the producer's side
                self.failure = exc
            finally:
                self.queue.task_done()

    def stop(self) -> None:
        """Let the thread finish the blocks already queued, then end it."""
        self.queue.put(None)
        self._thread.join()


class _Syncer:
    """The checkpoint thread: ``fdatasync``, then record the synced offset.

    :meth:`request` never blocks: a request made while a sync runs is served by the next
    sync, which then covers every byte written until it starts.
    """

    def __init__(self, fd: int, record: Callable[[int], None], *, durable: int) -> None:
        self._fd = fd
        self._record = record
        self._cond = threading.Condition()
        self._wanted = durable
        self._asked = 0  # checkpoints asked for, and made (or failed), so far
        self._made = 0
        self._closing = False
        self.durable = durable
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="sbproxy-sync", daemon=True)
        self._thread.start()

    def request(self, offset: int) -> None:
        """Ask for a checkpoint at ``offset`` (bytes already written)."""
        with self._cond:
            self._wanted = max(self._wanted, offset)
            self._asked += 1
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._made == self._asked and not self._closing:
                    self._cond.wait()
                if self._made == self._asked:
                    return
                offset, asked = self._wanted, self._asked
            try:
                if self.failure is None:
                    self._checkpoint(offset)
            except BaseException as exc:  # noqa: BLE001 - raised on the producer's side
                self.failure = exc
            with self._cond:
                self._made = asked
                self._cond.notify_all()

    def _checkpoint(self, offset: int) -> None:
        os.fdatasync(self._fd)
        self._record(offset)
        self.durable = offset
        fault_point("download.checkpoint")

    def wait(self) -> None:
        """Block until every requested checkpoint is made (or has failed)."""
        with self._cond:
            while self._made != self._asked:
                self._cond.wait()

    def stop(self) -> None:
        """Finish the requested checkpoints, then end the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()


class PartialSink:
    """Writes body blocks to a partial file, hashing them on the way, with checkpoints.

    Args:
        fd: The partial, open for writing and positioned at ``offset``.
        offset: Bytes already in the partial (and already fed to ``sha`` and ``b3``).
        sha: SHA-256 hasher (``hashlib``) holding the state of the first ``offset`` bytes.
        b3: BLAKE3 hasher, likewise.
        record: Records a durable offset in the resume state (runs on the syncer thread).
        checkpoint_bytes: Ask for a checkpoint after this many bytes written ...
        checkpoint_s: ... or this many seconds, whichever comes first.
    """

    def __init__(
        self,
        fd: int,
        *,
        offset: int,
        sha: Any,
        b3: Any,
        record: Callable[[int], None],
        checkpoint_bytes: int,
        checkpoint_s: float,
    ) -> None:
        self.fd = fd
        self.queued = offset  # bytes handed to the stages
        self._written = offset  # bytes written (writer thread)
        self._checkpoint_bytes = checkpoint_bytes
        self._checkpoint_s = checkpoint_s
        self._requested_at = offset
        self._requested_time = time.monotonic()
        self._syncer = _Syncer(fd, record, durable=offset)
        self._stages = [
            _Stage("sha256", lambda block: _feed(sha, block)),
            _Stage("blake3", lambda block: _feed(b3, block)),
            _Stage("write", self._write),
        ]

    @property
    def durable(self) -> int:
        """Bytes known to be on disk and recorded in the resume state."""
        return self._syncer.durable

    def _write(self, block: Block) -> None:
        fault_point("download.write")
        pending = [memoryview(piece) for piece in block if piece]
        while pending:
            done = os.writev(self.fd, pending[:_IOV_MAX])
            self._written += done
            while pending and done >= len(pending[0]):
                done -= len(pending[0])
                pending.pop(0)
            if done:
                pending[0] = pending[0][done:]
        now = time.monotonic()
        if (
            self._written - self._requested_at >= self._checkpoint_bytes
            or now - self._requested_time >= self._checkpoint_s
        ):
            self._requested_at, self._requested_time = self._written, now
            self._syncer.request(self._written)

    def _raise_failure(self) -> None:
        for failure in (*(stage.failure for stage in self._stages), self._syncer.failure):
            if failure is not None:
                raise failure

    def put(self, block: Block, size: int) -> None:
        """Hand ``block`` (``size`` bytes) to every stage; blocks while a queue is full."""
        self._raise_failure()
        for stage in self._stages:
            stage.queue.put(block)
        self.queued += size

    def drain(self) -> None:
        """Wait until every queued byte is hashed and written (not yet synced)."""
        for stage in self._stages:
            stage.queue.join()
        self._raise_failure()

    def checkpoint(self) -> None:
        """Drain, then make every byte so far durable and recorded; waits for it."""
        self.drain()
        self._syncer.request(self._written)
        self._syncer.wait()
        self._raise_failure()

    def finish(self) -> None:
        """Drain, wait for the checkpoint in flight, then ``fsync`` the whole file."""
        self.drain()
        self._syncer.wait()
        self._raise_failure()
        os.fsync(self.fd)

    def close(self) -> None:
        """Stop every thread (after the work already queued) and close the file."""
        for stage in self._stages:
            stage.stop()
        self._syncer.stop()
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _feed(hasher: Any, block: Block) -> None:
    for piece in block:
        hasher.update(piece)
