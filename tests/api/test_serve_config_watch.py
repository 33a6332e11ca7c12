"""The file watcher of a real ``sbproxy serve`` process, and what ``sbproxy config status``
shows: a ConfigMap symlink swap, a file replaced by rename and one edited in place are
reloaded; a touch is not; a bad edit is refused with its reason while the old config keeps
serving."""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.api.configmap import mount_configmap, update_configmap
from tests.api.test_serve import PASSWORD, write_config
from tests.api.test_serve_reload import (
    add_second,
    admin_cli,
    chat,
    deployments,
    edit,
    remove_second,
    serving,
    status,
    wait_for,
)
from tests.model_host.engines.support import free_port


def sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def config_of(admin_port: int) -> dict[str, Any]:
    config: dict[str, Any] = status(admin_port)["config"]
    return config


def config_status(admin_port: int) -> dict[str, Any]:
    """``sbproxy config status --format json`` against the server."""
    done = admin_cli(admin_port, "config", "status", "--format", "json")
    assert done.returncode == 0, done.stderr
    body: dict[str, Any] = json.loads(done.stdout)
    assert body["schema_version"] == 1 and body["command"] == "config.status"
    return body


def last_tried(admin_port: int) -> str | None:
    """The content hash the newest recorded reload tried (``None`` before one ends)."""
    last = config_of(admin_port)["last_reload"]
    return None if last is None else last["content_sha256"]


def changed(text: str, change: Any) -> str:
    document = yaml.safe_load(text)
    change(document)
    return yaml.safe_dump(document)


def test_a_configmap_swap_is_reloaded_and_config_status_shows_it(tmp_path: Path) -> None:
    gateway_port, admin_port = free_port(), free_port()
    first = write_config(tmp_path, gateway_port, admin_port).read_text()
    volume = tmp_path / "configmap"
    mount_configmap(volume, {"sb.yml": first}, stamp="2026_12_01_00_00_00.1")
    config = volume / "sb.yml"
    with serving(config):
        body = config_status(admin_port)
        active = body["config"]
        assert active["path"] == str(config)
        assert active["resolved_path"] == str(
            (volume / "..2026_12_01_00_00_00.1" / "sb.yml").resolve()
        )
        assert active["content_sha256"] == sha(first)
        assert active["revision"] == body["runtime_revision"]
        assert active["last_reload"] is None
        assert active["watch"]["poll_interval_s"] > 0
        revision = active["revision"]

        second = changed(first, add_second)
        update_configmap(volume, {"sb.yml": second}, stamp="2026_12_01_00_00_00.2")
        wait_for(lambda: config_of(admin_port)["content_sha256"] == sha(second))
        assert chat(gateway_port, "second-chat").status_code == 200
        body = config_status(admin_port)
        active = body["config"]
        assert active["resolved_path"] == str(
            (volume / "..2026_12_01_00_00_00.2" / "sb.yml").resolve()
        )
        assert active["revision"] == body["runtime_revision"] == revision + 1
        last = active["last_reload"]
        assert (last["source"], last["result"], last["revision"]) == ("watch", "committed", 2)
        assert last["content_sha256"] == sha(second)
        assert last["job_id"] and last["at"].endswith("Z")
        assert last["reason_code"] is None and last["message"] is None

        # The text report names the same facts.
        text = admin_cli(admin_port, "config", "status")
        assert text.returncode == 0, text.stderr
        assert sha(second) in text.stdout
        assert "committed (watch)" in text.stdout
        assert last["job_id"] in text.stdout


def test_a_renamed_or_edited_file_is_reloaded_and_a_touch_is_not(tmp_path: Path) -> None:
    gateway_port, admin_port = free_port(), free_port()
    config = write_config(tmp_path, gateway_port, admin_port)
    first = config.read_text()
    with serving(config):
        revision = status(admin_port)["runtime_revision"]
        # A touch, and a rewrite with the same bytes: looked at, nothing reloaded.
        looks = config_of(admin_port)["watch"]["looks"]
        os.utime(config)
        config.write_text(first)
        wait_for(lambda: config_of(admin_port)["watch"]["looks"] > looks)
        assert config_of(admin_port)["last_reload"] is None
        assert status(admin_port)["runtime_revision"] == revision

        # Replaced by rename (a new inode), as many editors save.
        second = changed(first, add_second)
        staged = tmp_path / ".sb.yml.swp-new"
        staged.write_text(second)
        staged.replace(config)
        wait_for(lambda: "second" in deployments(admin_port))
        # The routes swap inside the reload job; its result is recorded when the job ends.
        wait_for(lambda: last_tried(admin_port) == sha(second))
        active = config_of(admin_port)
        assert active["content_sha256"] == sha(second)
        assert active["last_reload"]["source"] == "watch"
        assert active["last_reload"]["result"] == "committed"

        # Rewritten in place (the same inode).
        inode = config.stat().st_ino
        third = changed(second, remove_second)
        with config.open("r+") as file:
            file.write(third)
            file.truncate()
        assert config.stat().st_ino == inode
        wait_for(lambda: "second" not in deployments(admin_port))
        wait_for(lambda: last_tried(admin_port) == sha(third))
        assert config_of(admin_port)["content_sha256"] == sha(third)
        assert status(admin_port)["runtime_revision"] == revision + 2


def test_a_bad_edit_is_refused_in_config_status_while_the_old_config_serves(
    tmp_path: Path,
) -> None:
    gateway_port, admin_port = free_port(), free_port()
    config = write_config(tmp_path, gateway_port, admin_port)
    good = config.read_text()
    with serving(config) as process:
        revision = status(admin_port)["runtime_revision"]
        edit(
            config,
            lambda d: d["proxy"]["model_host"]["deployments"]["tiny"].update(max_concurrency=0),
        )
        bad = config.read_bytes()
        wait_for(lambda: (config_of(admin_port)["last_reload"] or {}).get("result") == "refused")
        body = config_status(admin_port)
        active = body["config"]
        last = active["last_reload"]
        assert (last["source"], last["reason_code"]) == ("watch", "invalid_config")
        assert "proxy.model_host.deployments.tiny.max_concurrency" in last["message"]
        assert last["content_sha256"] == sha(bad)
        assert last["job_id"] is None  # the file did not validate: no job ran
        assert active["content_sha256"] == sha(good)  # still the active content
        assert active["revision"] == body["runtime_revision"] == revision
        assert chat(gateway_port, "tiny-chat").status_code == 200
        text = admin_cli(admin_port, "config", "status")
        assert text.returncode == 0, text.stderr
        assert "refused (watch)" in text.stdout
        assert "invalid_config" in text.stdout
        assert "proxy.model_host.deployments.tiny.max_concurrency" in text.stdout
        assert sha(good) in text.stdout

        # A change the running process cannot make: its reload job refuses it.
        moved = changed(good, lambda d: d["proxy"].update(http_bind_port=free_port()))
        config.write_text(moved)
        wait_for(lambda: config_of(admin_port)["last_reload"]["content_sha256"] == sha(moved))
        last = config_of(admin_port)["last_reload"]
        assert (last["result"], last["reason_code"]) == ("refused", "restart_required")
        assert last["job_id"]
        assert chat(gateway_port, "tiny-chat").status_code == 200

        # The good file back is the active content: nothing to reload; SIGHUP and the admin
        # API reload on demand and are recorded with their source.
        config.write_text(good)
        process.send_signal(signal.SIGHUP)
        wait_for(lambda: config_of(admin_port)["last_reload"]["source"] == "sighup")
        assert config_of(admin_port)["last_reload"]["result"] == "committed"
        reloaded = httpx.post(
            f"http://127.0.0.1:{admin_port}/admin/reload", auth=("admin", PASSWORD)
        )
        assert reloaded.status_code == 200, reloaded.text
        last = config_of(admin_port)["last_reload"]
        assert (last["source"], last["result"]) == ("admin", "committed")
        assert last["job_id"] == reloaded.json()["job_id"]
        applied = admin_cli(admin_port, "apply", "-f", str(config), "--format", "json")
        assert applied.returncode == 0, applied.stderr
        last = config_of(admin_port)["last_reload"]
        assert (last["source"], last["result"]) == ("apply", "committed")
        assert last["job_id"] == json.loads(applied.stdout)["job_id"]
        assert config_of(admin_port)["content_sha256"] == sha(good)


def test_config_status_without_the_watcher(tmp_path: Path) -> None:
    gateway_port, admin_port = free_port(), free_port()
    config = write_config(tmp_path, gateway_port, admin_port)
    with serving(config, "--no-watch"):
        active = config_status(admin_port)["config"]
        assert active["watch"] is None
        assert active["content_sha256"] == sha(config.read_bytes())
        text = admin_cli(admin_port, "config", "status")
        assert "watch" in text.stdout and "off" in text.stdout
        wrong = admin_cli(admin_port, "config", "status", "--format", "json", password="nope")
        assert wrong.returncode == 2
        assert json.loads(wrong.stdout)["error"]["code"] == "unauthorized"
