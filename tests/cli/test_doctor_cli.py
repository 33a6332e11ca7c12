"""`sbproxy doctor`: host, engines, cache and per-deployment blockers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from tests.model_host.engines.support import fake_llama_server
from tests.model_host.runtime.host import write_catalog


def doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sbproxy.cli", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def config(tmp_path: Path, *, pull: str, llama: dict[str, object]) -> Path:
    write_catalog(tmp_path)
    document = {
        "proxy": {
            "model_host": {
                "catalog_file": str(tmp_path / "catalog.yaml"),
                "cache": {"directory": str(tmp_path / "cache")},
                "engines": {"llama_cpp": llama},
                "deployments": {
                    "ok": {"model": "tiny", "variant": "q4_k_m", "pull": pull},
                    "ghost": {"model": "tiny", "variant": "nope"},
                },
            }
        }
    }
    path = tmp_path / "sb.yml"
    path.write_text(yaml.safe_dump(document))
    return path


def test_doctor_reports_blockers_with_remediations(tmp_path: Path) -> None:
    exe = fake_llama_server(tmp_path / "bin")
    path = config(tmp_path, pull="manual", llama={"path": str(exe)})
    done = doctor("-f", str(path), "--format", "json")
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert report["command"] == "doctor"
    assert report["host"]["cpu_count"] >= 1
    engines = {e["engine"]: e for e in report["engines"]}
    assert engines["llama_cpp"]["availability"] == "available"
    assert engines["vllm"]["availability"] in ("incompatible", "acquirable")
    assert report["cache"]["root"] == str(tmp_path / "cache")
    rows = {row["deployment"]: row for row in report["deployments"]}
    assert rows["ghost"]["runnable"] is False
    assert rows["ghost"]["blockers"][0]["code"] == "unknown_catalog_variant"
    assert rows["ok"]["runnable"] is False
    assert rows["ok"]["blockers"][0]["code"] == "manual_artifact_missing"
    assert "sbproxy models pull tiny" in rows["ok"]["blockers"][0]["remediation"]


def test_doctor_without_config_describes_the_host(tmp_path: Path) -> None:
    done = doctor("--cache-dir", str(tmp_path / "c"), "--format", "json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["deployments"] == []
    assert report["cache"]["exists"] is False
    assert "\x1b" not in done.stdout


def test_doctor_rejects_an_invalid_config(tmp_path: Path) -> None:
    bad = tmp_path / "sb.yml"
    bad.write_text("proxy:\n  http_bind_port: 0\n")
    done = doctor("-f", str(bad))
    assert done.returncode == 2
    assert "proxy.http_bind_port" in done.stderr
