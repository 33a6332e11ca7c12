"""Small real file systems for disk-full tests: a tmpfs the test mounts and unmounts itself.

``mount -t tmpfs`` needs root (``CAP_SYS_ADMIN``); CI runs the suite as root, so the tests
that use :func:`small_filesystem` run there. Where mounting is impossible (not root, no
``mount``, a container that refuses it) they skip, saying which of those it was; each such
test has a twin that injects the same failure (a fault point raising ``ENOSPC``, a SQLite
"database or disk is full") and runs everywhere.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["fill", "small_filesystem"]

_FILL_CHUNK = 1 << 20


@contextlib.contextmanager
def small_filesystem(path: Path, *, size_bytes: int) -> Iterator[Path]:
    """Mount a tmpfs of ``size_bytes`` at ``path`` (created if missing), yield ``path``,
    unmount it (lazily if something still holds it open).

    Skips the calling test, with the reason, when this process cannot mount.
    """
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip(f"mounting a tmpfs needs root; this test runs as uid {os.geteuid()}")
    mount, umount = shutil.which("mount"), shutil.which("umount")
    if mount is None or umount is None:
        pytest.skip("mounting a tmpfs needs mount(8) and umount(8), which are not on PATH")
    done = subprocess.run(
        [mount, "-t", "tmpfs", "-o", f"size={size_bytes},mode=0755", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs at {path} was refused: {done.stderr.strip()}")
    try:
        yield path
    finally:
        unmounted = subprocess.run([umount, str(path)], capture_output=True, check=False)
        if unmounted.returncode != 0:
            subprocess.run([umount, "-l", str(path)], capture_output=True, check=False)


def fill(directory: Path, *, leave_bytes: int = 0, name: str = "filler") -> Path:
    """Take every free byte of ``directory``'s file system but ``leave_bytes`` with one file.

    Returns:
        The file; unlink it to give the space back.
    """
    target = directory / name
    wanted = max(0, shutil.disk_usage(directory).free - leave_bytes)
    with target.open("wb") as handle:
        try:
            os.posix_fallocate(handle.fileno(), 0, wanted)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            block = bytes(_FILL_CHUNK)
            while wanted > 0:
                wanted -= handle.write(block[: min(_FILL_CHUNK, wanted)])
    return target
