"""Acquisition jobs: a pinned release archive from a (local) mirror, provisioning order."""

from __future__ import annotations

import hashlib
import io
import os
import sys
import tarfile
import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from sbproxy.config import EngineConfig
from sbproxy.model_host.artifacts import ArtifactCache, CacheLayout
from sbproxy.model_host.engines import EngineError, provision_llama_cpp
from sbproxy.model_host.flows import registry
from sbproxy.workflows import WorkflowEngine
from tests.model_host.engines.support import FAKE_SERVER
from tests.support.forward_proxy import ForwardProxy

pytestmark = pytest.mark.anyio

TAG = "b7777"


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib name
        pass


@pytest.fixture
def mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory served over HTTP in GitHub's release layout; the env points at it."""
    root = tmp_path / "mirror"
    root.mkdir()
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("SBPROXY_LLAMA_RELEASE_BASE_URL", f"http://127.0.0.1:{server.server_port}")
    try:
        yield root
    finally:
        server.shutdown()
        server.server_close()


def release_archive(mirror: Path, *, infix: str = "ubuntu-x64") -> str:
    script = f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_SERVER}" "$@"\n'.encode()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as bundle:
        info = tarfile.TarInfo("build/bin/llama-server")
        info.size = len(script)
        info.mode = 0o755
        bundle.addfile(info, io.BytesIO(script))
    data = buffer.getvalue()
    target = mirror / TAG / f"llama-{TAG}-bin-{infix}.tar.gz"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


async def provision(root: Path, config: EngineConfig) -> Path:
    cache = ArtifactCache(CacheLayout(root=root))
    engine = await WorkflowEngine.open(cache.layout.journal, registry, resources=[cache])
    try:
        return await provision_llama_cpp(config, engine=engine, layout_root=root)
    finally:
        await engine.close()


async def test_a_pinned_release_is_downloaded_verified_and_published(
    tmp_path: Path, mirror: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    digest = release_archive(mirror)
    root = tmp_path / "cache"
    executable = await provision(root, EngineConfig(version=TAG, sha256=digest, acceleration="cpu"))
    assert (
        executable
        == root
        / "engines"
        / "llama.cpp"
        / f"release-{TAG}-ubuntu-x64"
        / "build"
        / "bin"
        / "llama-server"
    )
    assert executable.is_file()
    assert not (root / "engines" / "staging" / f"release-{TAG}-ubuntu-x64.tar.gz").exists()
    # Published: the next call finds it without a download.
    (mirror / TAG).rename(mirror / "gone")
    assert await provision(root, EngineConfig(version=TAG, sha256=digest)) == executable


async def test_a_release_not_matching_its_pin_installs_nothing(
    tmp_path: Path, mirror: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    release_archive(mirror)
    root = tmp_path / "cache"
    with pytest.raises(EngineError) as info:
        await provision(root, EngineConfig(version=TAG, sha256="0" * 64))
    assert info.value.code == "engine_blocked"
    assert not (root / "engines" / "llama.cpp").exists()


async def test_a_release_is_fetched_through_the_proxy_in_http_proxy(
    tmp_path: Path, mirror: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The archive download honours the proxy variables like the artifact downloads: a real
    proxy (``proxy.py``) that wants a password forwards it; a wrong password fails the job
    with the proxy's 407, and the password shows in no error."""
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    digest = release_archive(mirror)
    password = "Rel3ase-Proxy-Pw"
    with ForwardProxy(tmp_path / "proxy", basic_auth=f"ops:{password}") as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url_with("ops:Wrong-Pw-123"))
        with pytest.raises(EngineError) as refused:
            await provision(tmp_path / "cache", EngineConfig(version=TAG, sha256=digest))
        assert refused.value.code == "http_status", refused.value.message
        assert f"the proxy {proxy.url} from HTTP_PROXY refused GET" in refused.value.message
        assert "Wrong-Pw-123" not in repr(refused.value.to_dict())

        monkeypatch.setenv("HTTP_PROXY", proxy.url_with(f"ops:{password}"))
        executable = await provision(  # a fresh cache: the failed job is not joined again
            tmp_path / "cache-2", EngineConfig(version=TAG, sha256=digest, acceleration="cpu")
        )
        assert executable.is_file()
        served = urlsplit(os.environ["SBPROXY_LLAMA_RELEASE_BASE_URL"]).netloc
        proxy.wait_seen(f"GET {served}/{TAG}/llama-{TAG}-bin-")


async def test_blocked_detection_is_an_error_with_a_remediation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    with pytest.raises(EngineError) as info:
        await provision(tmp_path / "cache", EngineConfig(version="b1234"))
    assert info.value.code == "engine_blocked"
    assert info.value.remediation is not None


async def test_detection_runs_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`llama-server --version` (about 0.1 s) must not stall the loop that serves requests."""
    from sbproxy.model_host.engines import llama_cpp

    script = tmp_path / "bin" / "llama-server"
    script.parent.mkdir()
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_SERVER}" "$@"\n')
    script.chmod(0o755)
    threads: list[threading.Thread] = []
    real = llama_cpp.read_version

    def recording(path: Path) -> str | None:
        threads.append(threading.current_thread())
        return real(path)

    monkeypatch.setattr(llama_cpp, "read_version", recording)
    executable = await provision(tmp_path / "cache", EngineConfig(path=str(script)))
    assert executable == script
    assert threads and threading.main_thread() not in threads
