"""``sbproxy models pull`` behind a forward proxy: a real ``sbproxy`` process with
``HTTPS_PROXY`` set pulls from the HF-shaped mirror over HTTPS through a real proxy
(``proxy.py``, with basic auth), and the proxy's password shows nowhere: not on stdout or
stderr, not in the job's error, not in any file of the cache (the journal included)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.catalog.builders import COMMIT, document, entry, variant, write
from tests.support.forward_proxy import ForwardProxy
from tests.support.hf_server import HfMirror
from tests.support.tls import LoopbackCa, loopback_ca

ROOT = Path(__file__).resolve().parents[2]
SBPROXY = Path(sys.executable).parent / "sbproxy"
REPO = "acme/tiny-GGUF"
FILE = "tiny-q4_k_m.gguf"
TINY = os.urandom(300_000)
PASSWORD = "Pr0xy-Pass-42"


class Behind:
    """A cache root and catalog, an HTTPS mirror, and a proxy that wants a password."""

    def __init__(self, tmp: Path, ca: LoopbackCa, hub: HfMirror, proxy: ForwardProxy) -> None:
        self.cache = tmp / "cache"
        self.ca, self.hub, self.proxy = ca, hub, proxy
        files = [{"path": FILE, "sha256": hashlib.sha256(TINY).hexdigest(), "size_bytes": 300_000}]
        self.catalog = write(
            tmp / "ops-catalog.yaml",
            document(models={"tiny": entry(variant("q4_k_m", source=f"hf:{REPO}", files=files))}),
        )

    def pull(self, https_proxy: str) -> subprocess.CompletedProcess[str]:
        dropped = {"SB_CONFIG_FILE", "SBPROXY_CACHE_DIR", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"}
        env = {key: value for key, value in os.environ.items() if key not in dropped}
        env |= {
            "HF_ENDPOINT": self.hub.url,
            "HTTPS_PROXY": https_proxy,
            "SSL_CERT_FILE": str(self.ca.ca_pem),
        }
        return subprocess.run(
            [str(SBPROXY), "models", "pull", "tiny", "--catalog-file", str(self.catalog),
             "--cache-dir", str(self.cache), "--format", "json"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip

    def cache_bytes(self) -> bytes:
        """Every file of the cache root (journal, WAL, metadata, logs) concatenated."""
        return b"".join(p.read_bytes() for p in sorted(self.cache.rglob("*")) if p.is_file())


@pytest.fixture
def behind(tmp_path: Path) -> Iterator[Behind]:
    ca = loopback_ca(tmp_path / "ca")
    with (
        HfMirror(tls=ca.server) as hub,
        ForwardProxy(tmp_path / "proxy", basic_auth=f"alice:{PASSWORD}") as proxy,
    ):
        hub.add_file(REPO, COMMIT, FILE, TINY)
        yield Behind(tmp_path, ca, hub, proxy)


def artifact_row(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert "Traceback" not in done.stderr
    (row,) = json.loads(done.stdout)["artifacts"]
    assert isinstance(row, dict)
    return row


def test_a_pull_goes_through_the_proxy_in_https_proxy(behind: Behind) -> None:
    done = behind.pull(behind.proxy.url_with(f"alice:{PASSWORD}"))
    assert done.returncode == 0, done.stderr
    row = artifact_row(done)
    assert row["error"] is None and row["verified_bytes"] == len(TINY)
    behind.proxy.wait_seen(f"CONNECT 127.0.0.1:{behind.hub.port}")
    assert [r.status for r in behind.hub.requests] == [200]
    assert PASSWORD not in done.stdout + done.stderr
    assert PASSWORD.encode() not in behind.cache_bytes()


def test_a_refused_proxy_password_fails_the_job_and_shows_nowhere(behind: Behind) -> None:
    wrong = "Wrong-Secret-99"
    done = behind.pull(behind.proxy.url_with(f"alice:{wrong}"))
    assert done.returncode == 1, done.stderr
    error = artifact_row(done)["error"]
    assert error["code"] == "http_status"
    assert f"the proxy {behind.proxy.url} from HTTPS_PROXY refused GET" in error["message"]
    assert "407" in error["message"]
    assert not behind.hub.requests
    for secret in (wrong, PASSWORD):
        assert secret not in done.stdout + done.stderr
        assert secret.encode() not in behind.cache_bytes()


def test_a_proxy_variable_that_cannot_be_used_exits_2_naming_it(behind: Behind) -> None:
    done = behind.pull(f"http://alice:{PASSWORD}@127.0.0.1:99999")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    error = json.loads(done.stdout)["error"]
    assert error["code"] == "invalid_proxy"
    assert error["variable"] == "HTTPS_PROXY"
    assert "HTTPS_PROXY=http://***@127.0.0.1:99999" in error["error"]
    assert "invalid_proxy" in done.stderr or "HTTPS_PROXY" in done.stderr
    assert PASSWORD not in done.stdout + done.stderr
    assert not behind.cache.exists() or PASSWORD.encode() not in behind.cache_bytes()


def test_sbproxy_run_refuses_a_proxy_variable_that_cannot_be_used(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBPROXY_", "HF_"))}
    env |= {"SBPROXY_CACHE_DIR": str(tmp_path / "cache"), "NO_PROXY": "localhost,a/b"}
    env["HTTPS_PROXY"] = f"http://alice:{PASSWORD}@proxy.example:3128"
    done = subprocess.run(
        [sys.executable, "-m", "sbproxy.cli", "run", "smollm2-135m-instruct"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "NO_PROXY entry 'a/b' is not a host name" in done.stderr
    assert PASSWORD not in done.stdout + done.stderr
    assert not (tmp_path / "cache").exists()
