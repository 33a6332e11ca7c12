"""How the admin verbs find a running ``sbproxy run``: an owner-only discovery file, used
only for what flags and environment leave unset, never for another URL, ignored once the
run is gone."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

from sbproxy.cli._discovery import RunRecord, discovery_dir, find_run, published
from sbproxy.workflows import process_start_ticks
from tests.api.test_serve import PASSWORD, write_config
from tests.api.test_serve_reload import ENV, serving
from tests.model_host.engines.support import free_port


def me(admin_url: str = "http://127.0.0.1:1", password: str = PASSWORD) -> RunRecord:
    return RunRecord(
        admin_url=admin_url,
        username="admin",
        password=password,
        gateway_url="http://127.0.0.1:2",
        pid=os.getpid(),
        start_ticks=process_start_ticks(os.getpid()) or "0",
    )


def test_the_file_is_owner_only_live_only_and_removed_on_exit(tmp_path: Path) -> None:
    folder = tmp_path / "sbproxy"
    with published(me(), directory=folder) as path:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert find_run(directory=folder) == me()
    assert not path.exists()
    assert find_run(directory=folder) is None
    # A file a killed run left behind names a pid that no longer has those start ticks.
    stale = {**me().__dict__, "start_ticks": "1"}
    (folder / "run-1.json").write_text(json.dumps(stale))
    assert find_run(directory=folder) is None


def test_the_directory_is_the_runtime_dir_else_the_default_cache(tmp_path: Path) -> None:
    runtime = tmp_path / "xdg-run"
    runtime.mkdir()
    assert discovery_dir({"XDG_RUNTIME_DIR": str(runtime)}) == runtime / "sbproxy"
    cache = {"SBPROXY_CACHE_DIR": str(tmp_path / "cache"), "HOME": str(tmp_path)}
    assert discovery_dir(cache) == tmp_path / "cache" / "run"


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sbproxy.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def test_admin_verbs_use_a_running_run_unless_flags_or_environment_say_otherwise(
    tmp_path: Path,
) -> None:
    admin_port = free_port()
    config = write_config(tmp_path, free_port(), admin_port)
    runtime = tmp_path / "xdg-run"
    runtime.mkdir()
    env = {k: v for k, v in ENV.items() if not k.startswith("SB_ADMIN")}
    env["XDG_RUNTIME_DIR"] = str(runtime)
    url = f"http://127.0.0.1:{admin_port}"
    with serving(config, "--no-watch"), published(me(url, PASSWORD), directory=runtime / "sbproxy"):
        found = cli("models", "ps", "--format", "json", env=env)
        assert found.returncode == 0, found.stderr
        assert json.loads(found.stdout)["deployments"][0]["deployment"] == "tiny"
        assert PASSWORD not in found.stdout + found.stderr

        # Another URL never gets the discovered password.
        elsewhere = cli(
            "models", "ps", "--format", "json", env={**env, "SB_ADMIN_URL": "http://127.0.0.1:9"}
        )
        assert elsewhere.returncode == 2
        assert json.loads(elsewhere.stdout)["error"]["code"] == "admin_password_required"

        # A password given wins over the discovered one.
        wrong = cli("models", "ps", "--password", "not-it", env=env)
        assert wrong.returncode == 2
        assert "401" in wrong.stderr
    gone = cli("models", "ps", env=env)
    assert gone.returncode == 2
    assert "no running `sbproxy run`" in gone.stderr
