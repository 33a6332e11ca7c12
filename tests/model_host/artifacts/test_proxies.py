"""Downloads through the forward proxy the environment names (``HTTPS_PROXY``,
``HTTP_PROXY``, ``ALL_PROXY``, ``NO_PROXY``): the rules as tables, then real pulls through a
real proxy (``proxy.py`` in its own process) to the HF-shaped mirror, over HTTPS with a test
CA where the tunnel matters."""

from __future__ import annotations

import base64
import hashlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from sbproxy.errors import SbproxyError
from sbproxy.model_host.artifacts import download
from sbproxy.model_host.artifacts.download import DownloadResult, RemoteFile, download_file
from sbproxy.model_host.artifacts.errors import HttpStatusError, ProxyError, TransportError
from sbproxy.model_host.artifacts.proxies import ProxySettings, proxy_settings
from sbproxy.redact import redact
from tests.model_host.artifacts.support import REPO, REVISION
from tests.model_host.engines.support import free_port
from tests.support.forward_proxy import ForwardProxy
from tests.support.hf_server import HfMirror
from tests.support.tls import LoopbackCa, loopback_ca

pytestmark = pytest.mark.anyio

DATA = os.urandom(3 * 1024 * 1024 + 17)  # several receive blocks
SHA256 = hashlib.sha256(DATA).hexdigest()
FILE = "model.gguf"
PASSWORD = "pr0xy-Secret-77"
TOKEN = "hf_" + "a" * 30


# --- which proxy, from which variable -------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "url", "expected"),
    [
        ({"HTTPS_PROXY": "http://corp:3128"}, "https://huggingface.co/x", ("corp", 3128)),
        ({"HTTPS_PROXY": "http://corp:3128"}, "http://mirror.local/x", None),
        ({"HTTP_PROXY": "http://corp:3128"}, "http://mirror.local/x", ("corp", 3128)),
        ({"HTTP_PROXY": "http://corp:3128"}, "https://huggingface.co/x", None),
        (
            {"https_proxy": "http://lower:1", "HTTPS_PROXY": "http://upper:2"},
            "https://h/x",
            ("lower", 1),
        ),
        ({"https_proxy": "", "HTTPS_PROXY": "http://upper:2"}, "https://h/x", ("upper", 2)),
        ({"ALL_PROXY": "http://every:3"}, "https://h/x", ("every", 3)),
        ({"ALL_PROXY": "http://every:3"}, "http://h/x", ("every", 3)),
        (
            {"ALL_PROXY": "http://every:3", "HTTPS_PROXY": "http://own:4"},
            "https://h/x",
            ("own", 4),
        ),
        ({"HTTPS_PROXY": "corp:3128"}, "https://h/x", ("corp", 3128)),  # no scheme: http
        ({"HTTPS_PROXY": "http://corp"}, "https://h/x", ("corp", 80)),
        ({"HTTPS_PROXY": "http://[::1]:3128/"}, "https://h/x", ("::1", 3128)),
        ({}, "https://h/x", None),
    ],
)
def test_each_scheme_takes_its_own_variable(
    env: dict[str, str], url: str, expected: tuple[str, int] | None
) -> None:
    proxy = proxy_settings(env).for_url(url)
    assert (None if proxy is None else (proxy.host, proxy.port)) == expected


def test_a_proxy_is_shown_without_credentials_and_sends_them_as_basic() -> None:
    settings = proxy_settings({"HTTPS_PROXY": "http://al%40ice:p%3Ass-w0rd@[::1]:3128"})
    proxy = settings.for_url("https://huggingface.co/x")
    assert proxy is not None
    expected = base64.b64encode(b"al@ice:p:ss-w0rd").decode()
    assert proxy.headers() == {"Proxy-Authorization": f"Basic {expected}"}
    assert proxy.shown == "http://[::1]:3128"
    assert proxy.variable == "HTTPS_PROXY"
    assert "p:ss-w0rd" not in repr(proxy) and expected not in repr(settings)
    # Registered when read: anything that echoes them is redacted.
    assert "p:ss-w0rd" not in redact(f"echo p:ss-w0rd {expected}")
    assert expected not in redact(f"header {expected}")
    assert proxy_settings({"HTTPS_PROXY": "http://corp:3128"}).https.headers() == {}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("no_proxy", "url", "bypassed"),
    [
        ("*", "https://huggingface.co/x", True),
        ("localhost,*", "https://huggingface.co/x", True),
        ("huggingface.co", "https://huggingface.co/x", True),
        ("huggingface.co", "https://cdn-lfs.huggingface.co/x", True),
        (".huggingface.co", "https://huggingface.co/x", True),
        (".huggingface.co", "https://cdn-lfs.huggingface.co/x", True),
        ("*.huggingface.co", "https://cdn-lfs.huggingface.co/x", True),
        ("huggingface.co", "https://nothuggingface.co/x", False),
        ("cdn-lfs.huggingface.co", "https://huggingface.co/x", False),
        ("HuggingFace.CO", "https://HUGGINGFACE.co/x", True),
        ("huggingface.co.", "https://huggingface.co/x", False),
        ("mirror.local:8443", "https://mirror.local:8443/x", True),
        ("mirror.local:8443", "https://mirror.local/x", False),
        ("mirror.local:443", "https://mirror.local/x", True),  # the scheme's port
        ("mirror.local:80", "http://mirror.local/x", True),
        ("10.0.0.0/8", "http://10.1.2.3:8080/x", True),
        ("10.0.0.0/8", "http://11.1.2.3/x", False),
        ("10.0.0.0/8", "http://ten.example/x", False),  # no name is resolved to decide
        ("127.0.0.1", "http://127.0.0.1:8080/x", True),
        ("127.0.0.1:8080", "http://127.0.0.1:9090/x", False),
        ("::1", "http://[::1]:8080/x", True),
        ("[::1]:8080", "http://[::1]:8080/x", True),
        ("[::1]:8080", "http://[::1]:9090/x", False),
        ("fd00::/8", "http://[fd12::1]/x", True),
        ("fd00::/8", "http://10.0.0.1/x", False),
        ("localhost, .internal  example.org", "https://a.internal/x", True),
        ("localhost, .internal  example.org", "https://example.org/x", True),
        ("localhost, .internal  example.org", "https://huggingface.co/x", False),
        ("", "https://huggingface.co/x", False),
    ],
)
def test_no_proxy_matching(no_proxy: str, url: str, bypassed: bool) -> None:
    env = {"HTTPS_PROXY": "http://corp:3128", "HTTP_PROXY": "http://corp:3128"}
    settings = proxy_settings({**env, "NO_PROXY": no_proxy})
    assert (settings.for_url(url) is None) is bypassed
    if no_proxy:  # an empty one counts as unset
        lower = proxy_settings({**env, "no_proxy": no_proxy, "NO_PROXY": "*"})
        assert (lower.for_url(url) is None) is bypassed  # no_proxy wins over NO_PROXY


@pytest.mark.parametrize(
    ("variable", "value", "problem"),
    [
        ("HTTPS_PROXY", f"http://user:{PASSWORD}@corp:99999", "not a valid URL"),
        ("HTTPS_PROXY", f"http://user:{PASSWORD}@corp:port", "not a valid URL"),
        ("HTTPS_PROXY", f"http://user:{PASSWORD}@corp:0", "port must be 1-65535"),
        ("HTTPS_PROXY", f"https://user:{PASSWORD}@corp:3128", "scheme 'https' is not supported"),
        ("ALL_PROXY", f"socks5://user:{PASSWORD}@corp:1080", "scheme 'socks5' is not supported"),
        ("http_proxy", f"http://user:{PASSWORD}@:3128", "names no host"),
        ("HTTP_PROXY", f"http://user:{PASSWORD}@corp:3128/proxy", "no path, query or fragment"),
        ("HTTP_PROXY", "http://user:pa%0Ass-word-1@corp:3128", "line break"),
        ("HTTPS_PROXY", f"http://user:{PASSWORD}/x@corp:3128", "unencoded '/', '?' or '#'"),
        ("HTTPS_PROXY", f"http://user:x/{PASSWORD}@corp:port", "unencoded '/', '?' or '#'"),
    ],
)
def test_a_proxy_url_that_cannot_be_used_is_invalid_proxy_naming_the_variable(
    variable: str, value: str, problem: str
) -> None:
    with pytest.raises(ProxyError) as caught:
        proxy_settings({variable: value})
    error = caught.value
    assert error.code == "invalid_proxy" and not error.retryable
    assert error.message.startswith(f"{variable}=")
    assert problem in error.message
    assert error.details["variable"] == variable
    assert "***@corp" in error.message or "***@:3128" in error.message
    shown = repr(error.to_dict()) + str(error)
    assert PASSWORD not in shown and "pa%0Ass-word-1" not in shown


@pytest.mark.parametrize("entry", ["mirror.local:https", "a/b", "[::1]x", "host:70000", "*.", "@"])
def test_a_no_proxy_entry_that_is_no_host_is_invalid_proxy(entry: str) -> None:
    with pytest.raises(ProxyError) as caught:
        proxy_settings({"no_proxy": f"localhost,{entry}"})
    assert caught.value.code == "invalid_proxy"
    assert caught.value.details == {"variable": "no_proxy", "entry": entry}


# --- real pulls through a real proxy ---------------------------------------------------------


@pytest.fixture
def tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LoopbackCa]:
    """A test CA trusted through ``SSL_CERT_FILE`` (the download's TLS context re-reads it)."""
    ca = loopback_ca(tmp_path / "ca")
    monkeypatch.setenv("SSL_CERT_FILE", str(ca.ca_pem))
    download._tls_context.cache_clear()
    yield ca
    download._tls_context.cache_clear()


@pytest.fixture
def hub(tls: LoopbackCa) -> Iterator[HfMirror]:
    """The HF-shaped mirror over HTTPS, serving :data:`FILE`."""
    with HfMirror(tls=tls.server) as server:
        server.add_file(REPO, REVISION, FILE, DATA)
        yield server


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[ForwardProxy]:
    with ForwardProxy(tmp_path / "proxy") as forward:
        yield forward


@pytest.fixture
def auth_proxy(tmp_path: Path) -> Iterator[ForwardProxy]:
    with ForwardProxy(tmp_path / "auth-proxy", basic_auth=f"alice:{PASSWORD}") as forward:
        yield forward


async def _ignore(done: int) -> None:
    return None


async def fetch(
    url: str, part: Path, *, token: str | None = None, proxies: ProxySettings | None = None
) -> DownloadResult:
    """Download :data:`DATA` from ``url``; the proxies come from the environment unless
    given."""
    return await download_file(
        RemoteFile(url=url, path=FILE, sha256=SHA256, size=len(DATA)),
        part=part,
        token=token,
        on_progress=_ignore,
        check_cancelled=lambda: None,
        proxies=proxies,
    )


async def test_an_https_pull_tunnels_through_the_proxy_with_tls_end_to_end(
    tmp_path: Path, hub: HfMirror, proxy: ForwardProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", proxy.url)
    result = await fetch(hub.url_for(REPO, REVISION, FILE), tmp_path / "part", token=TOKEN)
    assert result.sha256 == SHA256 and (tmp_path / "part").read_bytes() == DATA
    assert proxy.wait_seen("CONNECT") == [f"CONNECT 127.0.0.1:{hub.port}"]
    (request,) = hub.requests
    # Inside the tunnel: the origin's own Host, and the token of its own origin.
    assert request.host == f"127.0.0.1:{hub.port}"
    assert request.authorization == f"Bearer {TOKEN}"


async def test_an_http_pull_goes_through_the_proxy_in_absolute_form(
    tmp_path: Path, proxy: ForwardProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    with HfMirror() as plain:
        plain.add_file(REPO, REVISION, FILE, DATA)
        result = await fetch(plain.url_for(REPO, REVISION, FILE), tmp_path / "part")
        assert result.sha256 == SHA256
        path = f"/{REPO}/resolve/{REVISION}/{FILE}"
        assert proxy.wait_seen("GET") == [f"GET 127.0.0.1:{plain.port}{path}"]
        assert [r.path for r in plain.requests] == [path]


async def test_no_proxy_sends_its_hosts_past_the_proxy(
    tmp_path: Path, hub: HfMirror, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proxy named does not exist: only a download that skips it can succeed."""
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{free_port()}")
    url = hub.url_for(REPO, REVISION, FILE)
    with pytest.raises(TransportError):
        await fetch(url, tmp_path / "part")
    monkeypatch.setenv("NO_PROXY", f"localhost,127.0.0.1:{hub.port}")
    result = await fetch(url, tmp_path / "part")
    assert result.sha256 == SHA256


async def test_proxy_credentials_go_to_the_proxy_and_are_never_shown(
    tmp_path: Path,
    hub: HfMirror,
    auth_proxy: ForwardProxy,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    url = hub.url_for(REPO, REVISION, FILE)
    monkeypatch.setenv("HTTPS_PROXY", auth_proxy.url)
    with pytest.raises(HttpStatusError) as without:
        await fetch(url, tmp_path / "part")
    assert "Put the user and password the proxy expects in HTTPS_PROXY" in str(
        without.value.remediation
    )

    monkeypatch.setenv("HTTPS_PROXY", auth_proxy.url_with(f"alice:{PASSWORD}"))
    result = await fetch(url, tmp_path / "part", token=TOKEN)
    assert result.sha256 == SHA256
    auth_proxy.wait_seen(f"CONNECT 127.0.0.1:{hub.port}")
    (request,) = hub.requests
    assert request.proxy_authorization is None  # the proxy's credentials stay at the proxy
    (tmp_path / "part").unlink()

    monkeypatch.setenv("HTTPS_PROXY", auth_proxy.url_with("alice:Wrong-Password-1"))
    with pytest.raises(HttpStatusError) as wrong:
        await fetch(url, tmp_path / "part")
    error = wrong.value
    assert error.code == "http_status" and not error.retryable
    assert error.details == {
        "status": 407,
        "proxy": auth_proxy.url,
        "variable": "HTTPS_PROXY",
    }
    assert f"the proxy {auth_proxy.url} from HTTPS_PROXY refused GET {url}" in error.message
    assert "Check the user and password in HTTPS_PROXY" in str(error.remediation)
    basic = base64.b64encode(f"alice:{PASSWORD}".encode()).decode()
    for shown in (repr(error.to_dict()), str(error), caplog.text):
        for secret in (PASSWORD, "Wrong-Password-1", basic):
            assert secret not in shown


async def test_an_unreachable_proxy_is_a_retryable_transport_error_naming_it(
    tmp_path: Path, hub: HfMirror, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()  # nothing listens here
    monkeypatch.setenv("https_proxy", f"http://alice:{PASSWORD}@127.0.0.1:{port}")
    with pytest.raises(TransportError) as caught:
        await fetch(hub.url_for(REPO, REVISION, FILE), tmp_path / "part")
    error = caught.value
    assert error.retryable and error.code == "transport"
    assert (
        f"cannot reach the proxy http://127.0.0.1:{port} from https_proxy (the connection was "
        "refused)" in error.message
    )
    assert "add 127.0.0.1 to NO_PROXY" in str(error.remediation)
    assert error.details["variable"] == "https_proxy"
    assert PASSWORD not in repr(error.to_dict())
    assert not hub.requests


async def test_a_proxy_that_cannot_reach_the_host_is_retryable(
    tmp_path: Path, proxy: ForwardProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", proxy.url)
    gone = f"https://127.0.0.1:{free_port()}/{REPO}/resolve/{REVISION}/{FILE}"
    with pytest.raises(TransportError) as caught:
        await fetch(gone, tmp_path / "part")
    assert caught.value.retryable
    assert caught.value.details["status"] == 502
    assert f"the proxy {proxy.url} from HTTPS_PROXY could not forward GET {gone}" in (
        caught.value.message
    )


async def test_the_token_is_dropped_on_a_redirect_to_another_host_through_the_proxy(
    tmp_path: Path, tls: LoopbackCa, proxy: ForwardProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Hub answers 302 to a CDN on another host: both hops go through the proxy, and
    only the Hub's own origin gets the bearer token."""
    monkeypatch.setenv("HTTPS_PROXY", proxy.url)
    with HfMirror(tls=tls.server) as cdn, HfMirror(tls=tls.server) as hub:
        hub.add_file(REPO, REVISION, FILE, DATA, require_token=TOKEN, redirect_to=cdn)
        result = await fetch(hub.url_for(REPO, REVISION, FILE), tmp_path / "part", token=TOKEN)
        assert result.sha256 == SHA256
        assert [(r.status, r.authorization) for r in hub.requests] == [(302, f"Bearer {TOKEN}")]
        assert [(r.status, r.authorization) for r in cdn.requests] == [(200, None)]
        assert sorted(proxy.wait_seen("CONNECT", count=2)) == sorted(
            [f"CONNECT 127.0.0.1:{hub.port}", f"CONNECT 127.0.0.1:{cdn.port}"]
        )


async def test_each_redirect_hop_picks_its_own_proxy(
    tmp_path: Path, tls: LoopbackCa, proxy: ForwardProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NO_PROXY lists the CDN only: the Hub is reached through the proxy, the CDN directly."""
    monkeypatch.setenv("HTTPS_PROXY", proxy.url)
    with HfMirror(tls=tls.server) as cdn, HfMirror(tls=tls.server) as hub:
        monkeypatch.setenv("NO_PROXY", f"127.0.0.1:{cdn.port}")
        hub.add_file(REPO, REVISION, FILE, DATA, redirect_to=cdn)
        assert (await fetch(hub.url_for(REPO, REVISION, FILE), tmp_path / "part")).size
        assert [r.status for r in cdn.requests] == [200]
        assert proxy.wait_seen("CONNECT") == [f"CONNECT 127.0.0.1:{hub.port}"]


async def test_a_proxy_variable_that_cannot_be_used_fails_the_download_before_any_request(
    tmp_path: Path, hub: HfMirror, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", f"socks5://alice:{PASSWORD}@127.0.0.1:1080")
    with pytest.raises(SbproxyError) as caught:
        await fetch(hub.url_for(REPO, REVISION, FILE), tmp_path / "part")
    assert caught.value.code == "invalid_proxy"
    assert PASSWORD not in str(caught.value)
    assert not hub.requests
