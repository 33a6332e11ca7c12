"""A Kubernetes ConfigMap volume, laid out and updated as the kubelet's atomic writer does.

``<dir>/..<timestamp>/`` holds the files; ``..data -> ..<timestamp>``; each file name is a
symlink ``sb.yml -> ..data/sb.yml``. An update writes a new ``..<timestamp>`` directory,
points a fresh ``..data_tmp`` symlink at it, renames that over ``..data`` (the one atomic
step) and then removes the old directory.
"""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["mount_configmap", "update_configmap"]


def _write(directory: Path, stamp: str, files: dict[str, str]) -> None:
    payload = directory / f"..{stamp}"
    payload.mkdir()
    for name, text in files.items():
        (payload / name).write_text(text)


def mount_configmap(directory: Path, files: dict[str, str], *, stamp: str) -> None:
    """Create the volume in ``directory`` with ``files`` (name -> text)."""
    directory.mkdir(parents=True, exist_ok=True)
    _write(directory, stamp, files)
    (directory / "..data").symlink_to(f"..{stamp}")
    for name in files:
        (directory / name).symlink_to(f"..data/{name}")


def update_configmap(
    directory: Path, files: dict[str, str], *, stamp: str, remove_old: bool = True
) -> None:
    """Swap the volume's content to ``files`` under ``..<stamp>`` (``..data`` re-pointed)."""
    old = (directory / "..data").resolve()
    _write(directory, stamp, files)
    (directory / "..data_tmp").symlink_to(f"..{stamp}")
    (directory / "..data_tmp").replace(directory / "..data")  # rename(2): atomic
    if remove_old:
        shutil.rmtree(old)
