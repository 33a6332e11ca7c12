"""Engine archives unpack inside their target or not at all, on every Python 3.11.

The fallback checks (for Pythons before 3.11.4, which lack PEP 706's filters -- Debian 12's
system python3 is 3.11.2) run here on this interpreter too, so both paths meet the same table.
"""

from __future__ import annotations

import io
import stat
import tarfile
from pathlib import Path

import pytest

from sbproxy.model_host.engines.archives import extract_safely, has_stdlib_filter
from sbproxy.model_host.engines.errors import EngineError

PATHS = [
    pytest.param(False, id="own-checks"),
    pytest.param(
        True,
        id="stdlib-filter",
        marks=pytest.mark.skipif(not has_stdlib_filter(), reason="Python before 3.11.4"),
    ),
]


def _file(name: str, data: bytes = b"x", mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    return info, data


def _link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info, None


def _archive(path: Path, *entries: tuple[tarfile.TarInfo, bytes | None]) -> Path:
    with tarfile.open(path, "w:gz") as bundle:
        for info, data in entries:
            bundle.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


@pytest.mark.parametrize("stdlib_filter", PATHS)
def test_a_plain_tree_unpacks_with_its_links_and_without_setuid(
    tmp_path: Path, stdlib_filter: bool
) -> None:
    archive = _archive(
        tmp_path / "ok.tar.gz",
        _file("tree/bin/llama-server", b"#!", mode=0o4755),
        _file("tree/lib/libggml.so.0.26.0", b"elf"),
        _link("tree/lib/libggml.so", "libggml.so.0.26.0"),
        _link("tree/bin/lib", "../lib"),
    )
    target = tmp_path / "out"
    with tarfile.open(archive) as bundle:
        extract_safely(archive, bundle, target, stdlib_filter=stdlib_filter)
    server = target / "tree" / "bin" / "llama-server"
    assert server.read_bytes() == b"#!"
    assert not server.stat().st_mode & stat.S_ISUID
    assert (target / "tree" / "lib" / "libggml.so").read_bytes() == b"elf"
    assert (target / "tree" / "bin" / "lib" / "libggml.so.0.26.0").read_bytes() == b"elf"


@pytest.mark.parametrize("stdlib_filter", PATHS)
@pytest.mark.parametrize(
    "entry",
    [
        pytest.param(_file("/etc/evil"), id="absolute-name"),
        pytest.param(_file("tree/../../evil"), id="dotdot-name"),
        pytest.param(_link("tree/passwd", "/etc/passwd"), id="absolute-symlink"),
        pytest.param(_link("tree/up", "../../outside"), id="escaping-symlink"),
        pytest.param(_link("tree/hard", "../outside", tarfile.LNKTYPE), id="escaping-hardlink"),
    ],
)
def test_a_member_that_leaves_the_target_is_refused_and_nothing_escapes(
    tmp_path: Path, stdlib_filter: bool, entry: tuple[tarfile.TarInfo, bytes | None]
) -> None:
    archive = _archive(tmp_path / "bad.tar.gz", _file("tree/README"), entry)
    target = tmp_path / "deep" / "out"
    with tarfile.open(archive) as bundle, pytest.raises(EngineError) as refused:
        extract_safely(archive, bundle, target, stdlib_filter=stdlib_filter)
    assert refused.value.code == "engine_blocked"
    assert str(archive) in str(refused.value)
    assert not (tmp_path / "evil").exists()
    assert not (tmp_path / "deep" / "outside").exists()


def test_special_files_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    fifo = tarfile.TarInfo("tree/pipe")
    fifo.type = tarfile.FIFOTYPE
    archive = _archive(tmp_path / "fifo.tar.gz", _file("tree/README"), (fifo, None))
    target = tmp_path / "out"
    with tarfile.open(archive) as bundle, pytest.raises(EngineError) as refused:
        extract_safely(archive, bundle, target, stdlib_filter=False)
    assert refused.value.code == "engine_blocked"
    assert "special file" in str(refused.value)
    assert not target.exists()
