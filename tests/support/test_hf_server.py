"""The local Hugging Face mirror speaks the resolve shape and each fault does what it says."""

from __future__ import annotations

import hashlib
import http.client
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.hf_server import HfMirror

REPO = "Org/Repo"
REV = "main"
CONTENT = bytes(range(256)) * 40  # 10240 bytes
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub() -> Iterator[HfMirror]:
    with HfMirror() as mirror:
        yield mirror


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=5.0) as http:
        yield http


def _etag(data: bytes) -> str:
    return f'"{hashlib.sha256(data).hexdigest()}"'


def test_full_get_serves_content_and_hub_headers(hub: HfMirror, client: httpx.Client) -> None:
    hub.add_file(REPO, COMMIT, "model.gguf", CONTENT)
    response = client.get(f"{hub.url}/{REPO}/resolve/{COMMIT}/model.gguf")
    assert response.status_code == 200
    assert response.content == CONTENT
    assert response.headers["etag"] == _etag(CONTENT)
    assert response.headers["content-length"] == str(len(CONTENT))
    assert response.headers["accept-ranges"] == "bytes"
    assert response.headers["x-repo-commit"] == COMMIT
    [request] = hub.requests
    assert (request.method, request.path, request.file) == (
        "GET",
        f"/{REPO}/resolve/{COMMIT}/model.gguf",
        "model.gguf",
    )
    assert (request.status, request.body_bytes, request.range_start) == (200, len(CONTENT), None)
    assert not request.has_authorization


def test_head_sends_headers_only(hub: HfMirror, client: httpx.Client) -> None:
    hub.add_file(REPO, REV, "dir/config.json", b"{}", etag='"fixed"')
    response = client.head(hub.url_for(REPO, REV, "dir/config.json"))
    assert response.status_code == 200
    assert response.headers["content-length"] == "2"
    assert response.headers["etag"] == '"fixed"'
    assert len(response.headers["x-repo-commit"]) == 40
    assert hub.bytes_served() == 0


def test_unknown_file_is_404_json(hub: HfMirror, client: httpx.Client) -> None:
    hub.add_file(REPO, REV, "a.bin", b"a")
    for path in (f"/{REPO}/resolve/{REV}/missing.bin", "/Org/Other/resolve/main/a.bin", "/x"):
        response = client.get(hub.url + path)
        assert response.status_code == 404
        assert response.json() == {"error": "Entry not found"}
    assert [r.status for r in hub.requests] == [404, 404, 404]


def test_range_request_gets_206_with_content_range(hub: HfMirror, client: httpx.Client) -> None:
    hub.add_file(REPO, REV, "m.bin", CONTENT)
    url = hub.url_for(REPO, REV, "m.bin")
    open_ended = client.get(url, headers={"Range": "bytes=1000-"})
    assert open_ended.status_code == 206
    assert open_ended.headers["content-range"] == f"bytes 1000-{len(CONTENT) - 1}/{len(CONTENT)}"
    assert open_ended.content == CONTENT[1000:]
    bounded = client.get(url, headers={"Range": "bytes=10-19"})
    assert bounded.status_code == 206
    assert bounded.headers["content-range"] == f"bytes 10-19/{len(CONTENT)}"
    assert bounded.content == CONTENT[10:20]
    assert [r.range_start for r in hub.requests] == [1000, 10]
    assert hub.bytes_served("m.bin") == len(CONTENT) - 1000 + 10


def test_if_range_with_the_current_etag_resumes(hub: HfMirror, client: httpx.Client) -> None:
    entry = hub.add_file(REPO, REV, "m.bin", CONTENT)
    response = client.get(
        hub.url_for(REPO, REV, "m.bin"), headers={"Range": "bytes=5-", "If-Range": entry.etag}
    )
    assert response.status_code == 206
    assert response.content == CONTENT[5:]
    assert hub.requests[0].if_range == entry.etag


def test_if_range_mismatch_gets_the_full_body(hub: HfMirror, client: httpx.Client) -> None:
    hub.add_file(REPO, REV, "m.bin", CONTENT)
    response = client.get(
        hub.url_for(REPO, REV, "m.bin"), headers={"Range": "bytes=5-", "If-Range": '"stale"'}
    )
    assert response.status_code == 200
    assert response.content == CONTENT
    assert "content-range" not in response.headers


def test_range_at_the_end_is_416(hub: HfMirror, client: httpx.Client) -> None:
    entry = hub.add_file(REPO, REV, "m.bin", CONTENT)
    response = client.get(
        hub.url_for(REPO, REV, "m.bin"),
        headers={"Range": f"bytes={len(CONTENT)}-", "If-Range": entry.etag},
    )
    assert response.status_code == 416
    assert response.headers["content-range"] == f"bytes */{len(CONTENT)}"
    assert response.headers["etag"] == entry.etag
    assert response.content == b""


def test_keep_alive_serves_several_requests_on_one_connection(hub: HfMirror) -> None:
    hub.add_file(REPO, REV, "m.bin", CONTENT)
    connection = http.client.HTTPConnection("127.0.0.1", hub.port, timeout=5)
    try:
        for start in (0, 100, 200):
            connection.request(
                "GET", f"/{REPO}/resolve/{REV}/m.bin", headers={"Range": f"bytes={start}-"}
            )
            response = connection.getresponse()
            assert response.read() == CONTENT[start:]
            assert not response.will_close
    finally:
        connection.close()


def test_cut_after_closes_mid_body_then_serves_normally(
    hub: HfMirror, client: httpx.Client
) -> None:
    hub.add_file(REPO, REV, "m.bin", CONTENT, cut_after=4, cut_times=2)
    url = hub.url_for(REPO, REV, "m.bin")
    for _ in range(2):
        with pytest.raises(httpx.RemoteProtocolError):
            client.get(url)
    resumed = client.get(url, headers={"Range": "bytes=4-"})
    assert resumed.content == CONTENT[4:]
    assert [r.body_bytes for r in hub.requests] == [4, 4, len(CONTENT) - 4]


def test_ignore_range_answers_200_with_everything(hub: HfMirror, client: httpx.Client) -> None:
    hub.add_file(REPO, REV, "m.bin", CONTENT, ignore_range=True)
    response = client.get(hub.url_for(REPO, REV, "m.bin"), headers={"Range": "bytes=100-"})
    assert response.status_code == 200
    assert response.content == CONTENT
    assert hub.requests[0].range_start == 100


def test_etag_sequence_changes_the_upstream_between_attempts(
    hub: HfMirror, client: httpx.Client
) -> None:
    hub.add_file(REPO, REV, "m.bin", CONTENT, etag_sequence=['"v1"', '"v2"'])
    url = hub.url_for(REPO, REV, "m.bin")
    assert client.get(url).headers["etag"] == '"v1"'
    stale = client.get(url, headers={"Range": "bytes=3-", "If-Range": '"v1"'})
    assert (stale.status_code, stale.headers["etag"]) == (200, '"v2"')
    assert client.get(url, headers={"Range": "bytes=3-", "If-Range": '"v2"'}).status_code == 206


def test_wrong_bytes_keeps_the_length_but_not_the_content(
    hub: HfMirror, client: httpx.Client
) -> None:
    hub.add_file(REPO, REV, "m.bin", CONTENT, wrong_bytes=True)
    url = hub.url_for(REPO, REV, "m.bin")
    body = client.get(url).content
    assert len(body) == len(CONTENT)
    assert body != CONTENT
    assert body[1:-1] == CONTENT[1:-1]
    assert client.get(url, headers={"Range": "bytes=50-"}).content != CONTENT[50:]
    assert client.get(url).headers["etag"] == _etag(CONTENT)


def test_fail_statuses_come_first_with_retry_after(hub: HfMirror, client: httpx.Client) -> None:
    hub.add_file(REPO, REV, "m.bin", CONTENT, fail_statuses=[503, 429, 500])
    url = hub.url_for(REPO, REV, "m.bin")
    responses = [client.get(url) for _ in range(4)]
    assert [r.status_code for r in responses] == [503, 429, 500, 200]
    assert responses[0].headers["retry-after"] == "0"
    assert responses[1].headers["retry-after"] == "0"
    assert "retry-after" not in responses[2].headers
    assert responses[3].content == CONTENT


def test_delay_makes_a_client_time_out_once(hub: HfMirror) -> None:
    hub.add_file(REPO, REV, "m.bin", CONTENT, delay_s=0.5, delay_times=1)
    url = hub.url_for(REPO, REV, "m.bin")
    with httpx.Client(timeout=0.1) as impatient, pytest.raises(httpx.ReadTimeout):
        impatient.get(url)
    with httpx.Client(timeout=2.0) as patient:
        assert patient.get(url).content == CONTENT


def test_throttle_caps_the_rate_and_a_client_can_leave_mid_body(hub: HfMirror) -> None:
    hub.add_file(REPO, REV, "m.bin", CONTENT, throttle_bps=40_000)
    url = hub.url_for(REPO, REV, "m.bin")
    with httpx.Client(timeout=5.0) as http:
        began = time.monotonic()
        assert http.get(url, headers={"Range": "bytes=6240-"}).content == CONTENT[6240:]
        assert time.monotonic() - began >= 0.08  # 4000 bytes at 40 kB/s: about 0.1 s
        with http.stream("GET", url) as response:
            first = next(response.iter_raw(1))
            assert first
    served = hub.requests[-1].body_bytes
    assert 0 < served < len(CONTENT)


def test_redirect_to_a_cdn_mirror_serves_the_same_content(hub: HfMirror) -> None:
    with HfMirror() as cdn:
        hub.add_file(REPO, REV, "m.bin", CONTENT, redirect_to=cdn)
        with httpx.Client(timeout=5.0, follow_redirects=True) as http:
            response = http.get(
                hub.url_for(REPO, REV, "m.bin"),
                headers={"Authorization": "Bearer hf_secret", "Range": "bytes=10-"},
            )
        assert response.status_code == 206
        assert response.content == CONTENT[10:]
        [origin] = hub.requests
        assert origin.status == 302
        assert origin.authorization == "Bearer hf_secret"
        assert response.history[0].headers["location"] == cdn.url_for(REPO, REV, "m.bin")
        assert response.history[0].headers["x-linked-etag"] == _etag(CONTENT)
        [hop] = cdn.requests
        assert (hop.status, hop.range_start) == (206, 10)
        # httpx drops credentials on a cross-origin hop; the CDN can tell.
        assert not hop.has_authorization
        assert cdn.entry(REPO, REV, "m.bin").etag == _etag(CONTENT)


def test_require_token_answers_401_without_the_bearer(hub: HfMirror, client: httpx.Client) -> None:
    hub.add_file(REPO, REV, "m.bin", CONTENT, require_token="hf_right")
    url = hub.url_for(REPO, REV, "m.bin")
    assert client.get(url).status_code == 401
    assert client.get(url, headers={"Authorization": "Bearer hf_wrong"}).status_code == 401
    assert client.get(url, headers={"Authorization": "Bearer hf_right"}).content == CONTENT
    assert [(r.status, r.has_authorization) for r in hub.requests] == [
        (401, False),
        (401, True),
        (200, True),
    ]
    assert hub.requests[2].authorization == "Bearer hf_right"


def test_knobs_set_later_on_the_entry_take_effect(hub: HfMirror, client: httpx.Client) -> None:
    entry = hub.add_file(REPO, REV, "m.bin", CONTENT)
    url = hub.url_for(REPO, REV, "m.bin")
    assert client.get(url).status_code == 200
    entry.fail_statuses = [502]
    entry.cut_after = 10
    assert client.get(url).status_code == 502
    with pytest.raises(httpx.RemoteProtocolError):
        client.get(url)
    assert client.get(url).content == CONTENT


def test_recording_counts_bytes_and_clears(hub: HfMirror, client: httpx.Client) -> None:
    hub.add_file(REPO, REV, "a.bin", b"a" * 100)
    hub.add_file(REPO, REV, "b.bin", b"b" * 7)
    client.get(hub.url_for(REPO, REV, "a.bin"))
    client.get(hub.url_for(REPO, REV, "b.bin"), headers={"Range": "bytes=2-"})
    assert hub.bytes_served() == 105
    assert hub.bytes_served("a.bin") == 100
    assert hub.bytes_served(f"/{REPO}/resolve/{REV}/b.bin") == 5
    hub.clear()
    assert hub.requests == []
    assert hub.bytes_served() == 0


def test_revision_with_slashes_is_percent_encoded(hub: HfMirror, client: httpx.Client) -> None:
    hub.add_file(REPO, "refs/pr/1", "sub dir/w.bin", b"pr")
    url = hub.url_for(REPO, "refs/pr/1", "sub dir/w.bin")
    assert "refs%2Fpr%2F1" in url
    assert client.get(url).content == b"pr"


def test_file_on_disk_streams_with_ranges_and_faults(
    hub: HfMirror, client: httpx.Client, tmp_path: Path
) -> None:
    data = (b"0123456789abcdef" * 65536) * 9 + b"tail"  # 9 MiB + 4: more than one sendfile chunk
    source = tmp_path / "big.bin"
    source.write_bytes(data)
    entry = hub.add_file(REPO, REV, "big.bin", source)
    assert entry.etag == _etag(data)
    url = hub.url_for(REPO, REV, "big.bin")
    assert client.get(url).content == data
    assert client.get(url, headers={"Range": "bytes=1000000-"}).content == data[1_000_000:]
    entry.wrong_bytes = True
    wrong = client.get(url).content
    assert len(wrong) == len(data)
    assert wrong != data
    entry.wrong_bytes = False
    entry.cut_after = 5
    with pytest.raises(httpx.RemoteProtocolError):
        client.get(url)
    assert hub.bytes_served("big.bin") == 2 * len(data) - 1_000_000 + len(data) + 5


def test_stop_releases_connections_and_port() -> None:
    mirror = HfMirror().start()
    mirror.add_file(REPO, REV, "m.bin", CONTENT, delay_s=30)
    url = mirror.url_for(REPO, REV, "m.bin")
    with httpx.Client(timeout=5.0) as http:
        idle = http.get(f"{mirror.url}/nothing")  # leaves a keep-alive connection open
        assert idle.status_code == 404
        began = time.monotonic()
        mirror.stop()
        assert time.monotonic() - began < 2
        with pytest.raises(httpx.TransportError):
            http.get(url)


def test_standalone_server_prints_its_url(tmp_path: Path) -> None:
    source = tmp_path / "weights.bin"
    source.write_bytes(CONTENT)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.hf_server",
            "--file",
            f"{REPO}:{REV}:weights.bin={source}",
        ],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        announced = json.loads(process.stdout.readline())
        assert announced["files"][0]["etag"] == _etag(CONTENT)
        with httpx.Client(timeout=5.0) as http:
            response = http.get(f"{announced['url']}/{REPO}/resolve/{REV}/weights.bin")
        assert response.content == CONTENT
    finally:
        process.terminate()
        assert process.wait(timeout=10) == 0
        if process.stdout is not None:
            process.stdout.close()
