"""``sbproxy models ps``, ``models load`` and ``models stop`` against a real ``sbproxy serve``:
Basic-auth admin calls, the JSON envelope, ``--wait`` following the job, errors with reason
codes, and the admin password never echoed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sbproxy.cli import models_admin_cmd
from sbproxy.cli.models_admin_cmd import admin_request, devices_cell
from tests.api.test_serve import PASSWORD, write_config
from tests.api.test_serve_reload import ENV, admin_cli, serving, status
from tests.model_host.engines.support import free_port


def models(
    admin_port: int, *args: str, password: str = PASSWORD
) -> subprocess.CompletedProcess[str]:
    return admin_cli(admin_port, "models", *args, password=password)


def test_ps_load_and_stop_through_the_admin_api(tmp_path: Path) -> None:
    admin_port = free_port()
    config = write_config(tmp_path, free_port(), admin_port)
    with serving(config, "--no-watch"):
        listed = models(admin_port, "ps", "--format", "json")
        assert listed.returncode == 0, listed.stderr
        body = json.loads(listed.stdout)
        assert (body["schema_version"], body["command"]) == (1, "models.ps")
        assert [(d["deployment"], d["state"]) for d in body["deployments"]] == [
            ("tiny", "configured")
        ]

        loaded = models(admin_port, "load", "tiny", "--wait", "--format", "json")
        assert loaded.returncode == 0, loaded.stderr
        load = json.loads(loaded.stdout)
        assert (load["command"], load["state"], load["job"]["status"]) == (
            "models.load",
            "ready",
            "succeeded",
        )
        text = models(admin_port, "ps")
        assert text.returncode == 0
        header, row = (line.split() for line in text.stdout.splitlines())
        assert header == [
            "DEPLOYMENT", "STATE", "GEN", "PORT", "ACTIVE", "QUEUED", "DEVICES", "REASON"
        ]  # fmt: skip
        # A CPU host of one device: the ready generation holds memory on device 0.
        assert (row[0], row[1], row[6]) == ("tiny", "ready", "0")
        shown = json.loads(models(admin_port, "ps", "--format", "json").stdout)
        assert shown["deployments"][0]["selected_devices"] == [0]

        stopped = models(admin_port, "stop", "tiny", "--wait", "--format", "json")
        assert stopped.returncode == 0, stopped.stderr
        stop = json.loads(stopped.stdout)
        assert (stop["command"], stop["state"], stop["job"]["status"]) == (
            "models.stop",
            "stopped",
            "succeeded",
        )

        unknown = models(admin_port, "stop", "nope", "--format", "json")
        assert unknown.returncode == 2
        assert json.loads(unknown.stdout)["error"]["code"] == "unknown_deployment"

        wrong = models(admin_port, "ps", password="not-the-password")
        assert wrong.returncode == 2
        assert "unauthorized" in wrong.stderr
        for run in (listed, loaded, text, stopped, unknown, wrong):
            assert PASSWORD not in run.stdout + run.stderr
            assert "not-the-password" not in run.stdout + run.stderr


def test_ctrl_c_while_a_load_is_followed_leaves_the_job_running_and_names_it(
    tmp_path: Path,
) -> None:
    # The job runs in the server: interrupting the CLI that follows it stops the following
    # only (exit 130, the job named), and the load goes on to ready.
    hold = tmp_path / "hold"
    hold.touch()  # the engine stays loading while it exists
    admin_port = free_port()
    config = write_config(tmp_path, free_port(), admin_port, mode=f"hold_file={hold}")
    with serving(config, "--no-watch"):
        follow = subprocess.Popen(
            [sys.executable, "-m", "sbproxy.cli", "models", "load", "tiny", "--wait"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**ENV, "SB_ADMIN_URL": f"http://127.0.0.1:{admin_port}",
                 "SB_ADMIN_PASSWORD": PASSWORD},
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while [d["state"] for d in status(admin_port)["deployments"]] != ["preparing"]:
            assert time.monotonic() < deadline, "the load never started"
            time.sleep(0.05)
        follow.send_signal(signal.SIGINT)
        _, err = follow.communicate(timeout=30)
        assert follow.returncode == 130, err
        [job] = [d["job_id"] for d in status(admin_port)["deployments"]]
        assert f"interrupted; job {job} goes on" in err and "Traceback" not in err, err
        hold.unlink()
        while [d["state"] for d in status(admin_port)["deployments"]] != ["ready"]:
            assert time.monotonic() < deadline + 60, "the load did not go on"
            time.sleep(0.05)


def test_a_job_still_running_when_the_wait_ends_is_named_to_follow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    hold = tmp_path / "hold"
    hold.touch()  # the engine stays loading: the load job runs on
    admin_port = free_port()
    config = write_config(tmp_path, free_port(), admin_port, mode=f"hold_file={hold}")
    with serving(config, "--no-watch"):
        base = f"http://127.0.0.1:{admin_port}"
        job = admin_request(
            "POST", f"{base}/admin/model-host/load", auth=("admin", PASSWORD),
            json_body={"deployment": "tiny"},
        )["job_id"]  # fmt: skip
        monkeypatch.setattr(models_admin_cmd, "FOLLOW_S", 0.5)
        with pytest.raises(SystemExit) as ended:
            models_admin_cmd._follow(
                "models.load", base, job, auth=("admin", PASSWORD), output_format="text"
            )
        assert ended.value.code == 1
        err = capsys.readouterr().err
        assert f"job {job} is still " in err and "after 0.5 s of following" in err, err
        assert f"sbproxy jobs watch {job}" in err, err
        hold.unlink()


def test_the_devices_column_lists_a_generations_devices() -> None:
    assert [devices_cell(d) for d in (None, [], [0], [0, 1], [3, 1, 2])] == [
        "-",
        "-",
        "0",
        "0,1 tp2",
        "3,1,2 tp3",
    ]
