"""`sbproxy models pull` as real processes: SIGKILL mid-download and resume under the same
job id; two processes pulling one artifact at once; the token never lands on disk or in logs."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from sbproxy.model_host.artifacts.errors import SourceError
from sbproxy.model_host.artifacts.sources import hf_endpoint
from tests.support.hf_server import HfMirror

REPO = "acme/crash-GGUF"
REVISION = "0123456789abcdef0123456789abcdef01234567"
FILE = "crash.gguf"
SIZE = 48 * 1024 * 1024


@pytest.fixture(scope="module")
def payload() -> bytes:
    return hashlib.shake_256(b"crash-resume").digest(SIZE)


@pytest.fixture
def mirror() -> Iterator[HfMirror]:
    with HfMirror() as server:
        yield server


def write_catalog(path: Path, data: bytes) -> Path:
    document = {
        "schema_version": 2,
        "catalog_revision": "crash-test-1",
        "models": {
            "crashy": {
                "params": "1M",
                "license": "apache-2.0",
                "family": "test",
                "context_length": 2048,
                "variants": [
                    {
                        "id": "q4_k_m",
                        "format": "gguf",
                        "quant": "Q4_K_M",
                        "engines": ["llama_cpp"],
                        "source": f"hf:{REPO}",
                        "revision": REVISION,
                        "files": [
                            {
                                "path": FILE,
                                "sha256": hashlib.sha256(data).hexdigest(),
                                "size_bytes": len(data),
                            }
                        ],
                        "requirements": {
                            "accelerators": ["cpu", "metal", "cuda"],
                            "min_memory_bytes": 1,
                        },
                        "stability": "preview",
                        "certification": "test",
                    }
                ],
            }
        },
    }
    path.write_text(yaml.safe_dump(document))
    return path


def pull_command(tmp_path: Path, catalog: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "sbproxy.cli",
        "models",
        "pull",
        "crashy",
        "--variant",
        "q4_k_m",
        "--catalog-file",
        str(catalog),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--format",
        "json",
    ]


def child_env(mirror: HfMirror, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBPROXY_FAULT", "HF_"))}
    env["HF_ENDPOINT"] = mirror.url
    env.update(extra)
    return env


def journal_jobs(tmp_path: Path) -> list[dict[str, object]]:
    import sqlite3

    with sqlite3.connect(tmp_path / "cache" / "jobs" / "journal.db") as raw:
        raw.row_factory = sqlite3.Row
        return [dict(row) for row in raw.execute("SELECT id, kind, status, attempt FROM jobs")]


def killed_pull(
    tmp_path: Path, mirror: HfMirror, payload: bytes, *, checkpoint: int
) -> tuple[list[str], dict[str, object]]:
    """A pull SIGKILLed at its ``checkpoint``-th durable checkpoint: its argv and its job.

    The file is throttled so that time-based checkpoints (every 2 s) happen mid-file; the
    first checkpoint is at byte 0, so the third comes about 4 s in.
    """
    mirror.add_file(REPO, REVISION, FILE, payload, throttle_bps=8 * 1024 * 1024)
    catalog = write_catalog(tmp_path / "catalog.yaml", payload)
    command = pull_command(tmp_path, catalog)
    killed = subprocess.run(
        command,
        env=child_env(mirror, SBPROXY_FAULT_POINTS=f"download.checkpoint={checkpoint}"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    (first,) = journal_jobs(tmp_path)
    return command, first


@pytest.mark.slow
def test_sigkilled_pull_resumes_under_the_same_job_id(
    tmp_path: Path, mirror: HfMirror, payload: bytes
) -> None:
    command, first = killed_pull(tmp_path, mirror, payload, checkpoint=3)
    assert first["status"] == "running"
    served_before = mirror.bytes_served()

    resumed = subprocess.run(
        command, env=child_env(mirror), capture_output=True, text=True, timeout=120, check=False
    )
    assert resumed.returncode == 0, resumed.stderr
    result = json.loads(resumed.stdout)
    (artifact,) = result["artifacts"]
    assert artifact["job_id"] == first["id"]
    jobs = journal_jobs(tmp_path)
    assert [(j["id"], j["status"], j["attempt"]) for j in jobs] == [(first["id"], "succeeded", 2)]

    gets = [r for r in mirror.requests if r.method == "GET"]
    assert gets[0].range_start is None
    assert gets[-1].range_start is not None and gets[-1].range_start > 0
    assert served_before < SIZE
    assert mirror.bytes_served() < 1.5 * SIZE
    snapshot = Path(artifact["snapshot_path"]) / FILE
    assert snapshot.read_bytes() == payload


@pytest.mark.slow
def test_an_offline_pull_does_not_finish_a_crashed_download(
    tmp_path: Path, mirror: HfMirror, payload: bytes
) -> None:
    """`--offline` joining the unfinished job of a killed online pull refuses, and leaves it."""
    command, first = killed_pull(tmp_path, mirror, payload, checkpoint=2)
    requests_before = len(mirror.requests)

    offline = subprocess.run(
        [*command, "--offline"],
        env=child_env(mirror),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert offline.returncode == 1, offline.stderr
    error = json.loads(offline.stdout)["error"]
    assert error["code"] == "offline_artifact_missing"
    assert str(first["id"]) in error["error"]
    assert "without --offline" in (error.get("remediation") or "")
    assert len(mirror.requests) == requests_before  # no network from an offline process
    assert journal_jobs(tmp_path) == [first]  # the job is left for an online pull

    resumed = subprocess.run(
        command, env=child_env(mirror), capture_output=True, text=True, timeout=120, check=False
    )
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["artifacts"][0]["job_id"] == first["id"]


@pytest.mark.slow
def test_two_processes_pulling_one_artifact_download_it_once(
    tmp_path: Path, mirror: HfMirror, payload: bytes
) -> None:
    mirror.add_file(REPO, REVISION, FILE, payload, throttle_bps=16 * 1024 * 1024)
    catalog = write_catalog(tmp_path / "catalog.yaml", payload)
    command = pull_command(tmp_path, catalog)
    children = [
        subprocess.Popen(
            command,
            env=child_env(mirror),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [child.communicate(timeout=120) for child in children]
    results = []
    for child, (stdout, stderr) in zip(children, outputs, strict=True):
        assert child.returncode == 0, stderr
        results.append(json.loads(stdout)["artifacts"][0])
    assert results[0]["job_id"] == results[1]["job_id"]
    assert results[0]["snapshot_path"] == results[1]["snapshot_path"]
    assert len([r for r in mirror.requests if r.method == "GET"]) == 1
    assert mirror.bytes_served() == SIZE


def test_hf_token_never_reaches_the_cache_or_the_logs(tmp_path: Path, mirror: HfMirror) -> None:
    token = "hf_SecretTokenForTheScanTest0123456789"
    data = hashlib.shake_256(b"token").digest(300_000)
    mirror.add_file(REPO, REVISION, FILE, data, require_token=token, cut_after=100_000)
    catalog = write_catalog(tmp_path / "catalog.yaml", data)
    done = subprocess.run(
        pull_command(tmp_path, catalog),
        env=child_env(mirror, HF_TOKEN=token),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert all(r.authorization == f"Bearer {token}" for r in mirror.requests)
    assert token not in done.stdout
    assert token not in done.stderr
    for path in (tmp_path / "cache").rglob("*"):
        if path.is_file():
            assert token.encode() not in path.read_bytes(), path

    # A failing pull (wrong token) must not echo it either.
    mirror.entry(REPO, REVISION, FILE).require_token = "hf_SomethingElseEntirely0000000000"
    failed = subprocess.run(
        [*pull_command(tmp_path / "other", catalog)],
        env=child_env(mirror, HF_TOKEN=token),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert failed.returncode == 1
    assert "401" in failed.stderr + failed.stdout
    assert token not in failed.stdout + failed.stderr
    for path in (tmp_path / "other").rglob("*"):
        if path.is_file():
            assert token.encode() not in path.read_bytes(), path


@pytest.mark.parametrize("userinfo", ["user:{secret}", "{secret}", "user:{secret}:more"])
def test_hf_endpoint_with_credentials_is_refused_before_anything_is_written(
    tmp_path: Path, mirror: HfMirror, userinfo: str
) -> None:
    secret = "Sup3rSecretEndpointPassw0rd"
    data = hashlib.shake_256(b"endpoint").digest(100_000)
    mirror.add_file(REPO, REVISION, FILE, data)
    catalog = write_catalog(tmp_path / "catalog.yaml", data)
    endpoint = mirror.url.replace("://", f"://{userinfo.format(secret=secret)}@", 1)
    done = subprocess.run(
        pull_command(tmp_path, catalog),
        env=child_env(mirror, HF_ENDPOINT=endpoint),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    error = json.loads(done.stdout)["error"]
    assert error["code"] == "invalid_endpoint"
    assert "credentials in HF_ENDPOINT are not supported" in error["error"]
    assert "HF_TOKEN" in error["remediation"]
    assert f"http://***@127.0.0.1:{mirror.port}" in error["error"]
    assert secret not in done.stdout + done.stderr
    assert mirror.requests == []
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
    assert not (tmp_path / "cache").exists()


def test_hf_endpoint_with_credentials_fails_a_step_without_building_a_url() -> None:
    # The server's pulls read HF_ENDPOINT inside the job: the same refusal, never a URL.
    with pytest.raises(SourceError) as info:
        hf_endpoint({"HF_ENDPOINT": "https://me:Passw0rdInUrl@hub.example:8443/"})
    assert info.value.code == "invalid_endpoint"
    assert "Passw0rdInUrl" not in str(info.value)
    assert "https://***@hub.example:8443" in str(info.value)
    assert hf_endpoint({"HF_ENDPOINT": "https://hub.example/"}) == "https://hub.example"


def test_ctrl_c_during_a_pull_exits_130_and_the_rerun_resumes_the_same_job(
    tmp_path: Path, mirror: HfMirror
) -> None:
    data = hashlib.shake_256(b"interrupt").digest(4 * 1024 * 1024)
    mirror.add_file(REPO, REVISION, FILE, data, throttle_bps=512 * 1024)  # about 8 s
    catalog = write_catalog(tmp_path / "catalog.yaml", data)
    command = pull_command(tmp_path, catalog)
    child = subprocess.Popen(
        command, env=child_env(mirror), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while mirror.bytes_served() == 0 and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert child.poll() is None, child.communicate()
    child.send_signal(signal.SIGINT)
    stdout, stderr = child.communicate(timeout=60)
    assert child.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert "Aborted!" not in stderr
    assert "sbproxy models pull: interrupted" in stderr
    assert "resumes under the same job" in stderr
    assert stdout == ""
    (first,) = journal_jobs(tmp_path)
    assert first["status"] != "succeeded"

    mirror.entry(REPO, REVISION, FILE).throttle_bps = None
    resumed = subprocess.run(
        command, env=child_env(mirror), capture_output=True, text=True, timeout=120, check=False
    )
    assert resumed.returncode == 0, resumed.stderr
    (artifact,) = json.loads(resumed.stdout)["artifacts"]
    assert artifact["job_id"] == first["id"]
    assert (Path(artifact["snapshot_path"]) / FILE).read_bytes() == data


@pytest.mark.parametrize(
    ("endpoint", "shown"),
    [
        ("http://[::1", "not a valid URL"),
        ("http://127.0.0.1:99999", "not a valid URL"),
        ("http://127.0.0.1:0", "port 1-65535"),
        ("ftp://mirror.example", "http(s) URL"),
        ("https://", "http(s) URL"),
        ("http://127.0.0.1:8080/?token=hunter2SECRET", "query or fragment"),
        ("http://127.0.0.1:8080/#frag", "query or fragment"),
    ],
)
def test_a_malformed_hf_endpoint_is_invalid_endpoint(endpoint: str, shown: str) -> None:
    from sbproxy.model_host.artifacts.errors import SourceError

    with pytest.raises(SourceError) as info:
        hf_endpoint({"HF_ENDPOINT": endpoint})
    assert info.value.code == "invalid_endpoint"
    assert shown in info.value.message
    assert "hunter2SECRET" not in info.value.message


def test_a_query_token_in_hf_endpoint_exits_2_and_is_stored_nowhere(
    tmp_path: Path, mirror: HfMirror, payload: bytes
) -> None:
    mirror.add_file(REPO, REVISION, FILE, payload)
    catalog = write_catalog(tmp_path / "catalog.yaml", payload)
    env = child_env(mirror)
    env["HF_ENDPOINT"] = f"{mirror.url}/?token=hunter2SECRET"
    done = subprocess.run(
        pull_command(tmp_path, catalog),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert json.loads(done.stdout)["error"]["code"] == "invalid_endpoint"
    assert "hunter2SECRET" not in done.stdout + done.stderr
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert b"hunter2SECRET" not in path.read_bytes(), path
    assert mirror.requests == []
