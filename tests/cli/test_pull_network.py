"""A pull that cannot reach its host says which host, why, and what to do next."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sbproxy.model_host.artifacts.download import unreachable
from tests.model_host.engines.support import free_port


def test_the_reason_is_named() -> None:
    named = unreachable("https://hf.example/x", socket.gaierror(-2, "Name or service not known"))
    assert "cannot reach hf.example (its name does not resolve)" in named.message
    refused = unreachable("http://127.0.0.1:9/x", ConnectionRefusedError(111, "refused"))
    assert "cannot reach 127.0.0.1:9 (the connection was refused)" in refused.message
    assert refused.retryable
    assert refused.details["host"] == "127.0.0.1:9"


def test_a_pull_with_no_route_names_the_host_and_the_next_steps(tmp_path: Path) -> None:
    port = free_port()  # nothing listens here
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("SBPROXY_", "HF_"))},
        "SBPROXY_CACHE_DIR": str(tmp_path / "cache"),
        "HF_ENDPOINT": f"http://127.0.0.1:{port}",
    }
    done = subprocess.run(
        [sys.executable, "-m", "sbproxy.cli", "models", "pull", "smollm2-135m-instruct",
         "--format", "json"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    (row,) = json.loads(done.stdout)["artifacts"]
    message = row["error"]["message"]
    assert f"cannot reach 127.0.0.1:{port} (the connection was refused)" in message
    for step in ("HF_ENDPOINT", "--offline", "sbproxy models import"):
        assert step in message


ADVICE = "Check the network or HF_ENDPOINT"


@pytest.mark.parametrize(
    ("endpoint", "reason"),
    [
        ("closed-port", "the connection was refused"),
        ("http://sbproxy-test.invalid", "its name does not resolve"),
    ],
)
def test_one_failure_gives_its_advice_once_and_each_retry_one_short_line(
    tmp_path: Path, endpoint: str, reason: str
) -> None:
    """``models pull`` and a ``jobs watch`` of the same job, both real processes: each retry
    is one line (the error quoted the first time only), and the advice comes once, with the
    failure at the end."""
    if endpoint == "closed-port":
        endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    host = endpoint.removeprefix("http://")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("SBPROXY_", "HF_"))},
        "SBPROXY_CACHE_DIR": str(tmp_path / "cache"),
        "HF_ENDPOINT": endpoint,
    }
    cli = [sys.executable, "-m", "sbproxy.cli"]
    pull = subprocess.Popen(
        [*cli, "models", "pull", "smollm2-135m-instruct"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert pull.stderr is not None
    first = pull.stderr.readline()  # "<model>:<variant>: job <id> for artifact sha256:..."
    job_id = first.split(" job ", 1)[1].split()[0]
    # The watch starts while the pull retries, and follows it to the end.
    watch = subprocess.run(
        [*cli, "jobs", "watch", job_id],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    _, pull_rest = pull.communicate(timeout=300)
    pull_err = first + pull_rest
    assert pull.returncode == 1, pull_err
    assert watch.returncode == 1, watch.stderr

    assert pull_err.count(ADVICE) == 1, pull_err
    (last,) = [line for line in pull_err.splitlines() if ADVICE in line]
    assert last == pull_err.splitlines()[-1]  # at the end, with the failure
    assert f"cannot reach {host} ({reason})" in last
    # jobs watch: the events on stderr, the outcome (error and advice) on stdout.
    assert watch.stderr.count(ADVICE) == 0, watch.stderr
    assert watch.stdout.count(ADVICE) == 1, watch.stdout
    assert f"{job_id}: failed" in watch.stdout

    for err in (pull_err, watch.stderr):
        retries = [line for line in err.splitlines() if " retry " in line]
        assert len(retries) == 5, err  # the fetch step's six attempts: five retries
        assert re.search(r" retry 2/6 in \d+\.\d s: transport: cannot reach ", retries[0])
        assert f"cannot reach {host} ({reason})" in retries[0]
        assert all(line.endswith(": same error") for line in retries[1:]), retries
        assert err.count(f"cannot reach {host}") == (2 if err is pull_err else 1), err
        assert f"{job_id}: failed: transport" in err.splitlines()
