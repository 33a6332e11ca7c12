"""Errors click finds while parsing options keep the JSON contract when JSON is asked for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SBPROXY = Path(sys.executable).parent / "sbproxy"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SBPROXY), *args], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize("style", [("--format", "json"), ("--format=json",)])
def test_a_bad_option_value_with_json_is_one_json_error_and_exit_2(
    tmp_path: Path, style: tuple[str, ...]
) -> None:
    done = run("models", "gc", "--budget-gib", "nan", "--cache-dir", str(tmp_path), *style)
    assert done.returncode == 2
    payload = json.loads(done.stdout)
    assert payload["schema_version"] == 1
    assert payload["command"] == "models.gc"
    assert payload["ok"] is False
    assert payload["error"]["code"] == "usage"
    assert "--budget-gib" in payload["error"]["error"]
    assert "Error:" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "jobs").exists()


def test_a_bad_option_value_without_json_is_a_message_on_stderr_only(tmp_path: Path) -> None:
    done = run("models", "gc", "--budget-gib", "inf", "--cache-dir", str(tmp_path))
    assert done.returncode == 2
    assert done.stdout == ""
    assert "--budget-gib" in done.stderr


def test_an_unknown_command_with_json_names_the_root(tmp_path: Path) -> None:
    done = run("nosuch", "--format", "json")
    assert done.returncode == 2
    payload = json.loads(done.stdout)
    assert (payload["command"], payload["error"]["code"]) == ("sbproxy", "usage")


def test_help_and_version_still_exit_0() -> None:
    assert run("--version").returncode == 0
    helped = run("models", "pull", "--help")
    assert helped.returncode == 0 and "Usage:" in helped.stdout
