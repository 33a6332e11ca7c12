"""`sbproxy capabilities`: the matrix from the code's refusals and plans, `live` only from a
passing ledger entry for that cell."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PASSING_CHECKS = [
    {"name": name, "ok": True, "seconds": 0.1, "evidence": "ok"}
    for name in ("load", "chat", "stream", "stop")
]


def capabilities(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sbproxy.cli", "capabilities", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


def matrix(ledger_dir: Path) -> dict[tuple[str, str, str], dict[str, object]]:
    done = capabilities("--format", "json", "--ledger-dir", str(ledger_dir))
    assert done.returncode == 0, done.stderr
    cells = json.loads(done.stdout)["cells"]
    return {(c["engine"], c["accelerator"], c["feature"]): c for c in cells}


def entry(**changes: object) -> dict[str, object]:
    base: dict[str, object] = {
        "schema_version": 1,
        "recorded_at": "2026-01-01T00:00:00Z",
        "engine": "llama_cpp",
        "accelerator": "cpu",
        "outcome": "passed",
        "checks": PASSING_CHECKS,
    }
    return {**base, **changes}


def write_ledger(directory: Path, *entries: dict[str, object]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(e) + "\n" for e in entries)
    (directory / "certification.jsonl").write_text(lines)
    return directory


def test_without_a_ledger_nothing_is_live_and_refusals_carry_the_codes_raised(
    tmp_path: Path,
) -> None:
    cells = matrix(tmp_path / "none")
    assert {c["status"] for c in cells.values()} == {"planned", "unsupported"}
    assert {key[1] for key in cells} == {"cpu", "cuda"}
    # CUDA is what the planners accept, never certified here: planned.
    assert cells["llama_cpp", "cuda", "chat"]["status"] == "planned"
    assert cells["llama_cpp", "cuda", "multi_device"]["status"] == "planned"
    assert cells["vllm", "cuda", "multi_device"]["status"] == "planned"
    assert cells["vllm", "cuda", "container"]["status"] == "planned"
    refused = {
        ("vllm", "cpu", "chat"): "engine_incompatible",
        ("llama_cpp", "cpu", "multi_device"): "engine_incompatible",
        ("llama_cpp", "cpu", "rpc_split"): "unsafe_argument",
        ("llama_cpp", "cuda", "container"): "invalid_config",
    }
    for key, code in refused.items():
        assert cells[key]["status"] == "unsupported", key
        assert cells[key]["reason_code"] == code, key


def test_a_passing_entry_makes_its_checked_cells_live(tmp_path: Path) -> None:
    cells = matrix(write_ledger(tmp_path, entry()))
    assert cells["llama_cpp", "cpu", "chat"]["status"] == "live"
    assert cells["llama_cpp", "cpu", "streaming"]["status"] == "live"
    assert cells["llama_cpp", "cpu", "chat"]["detail"] == "2026-01-01T00:00:00Z"
    # Only that engine on that accelerator, only the features it checked.
    assert cells["llama_cpp", "cuda", "chat"]["status"] == "planned"
    assert cells["llama_cpp", "cpu", "multi_device"]["status"] == "unsupported"


def test_a_failed_or_skipped_entry_makes_nothing_live(tmp_path: Path) -> None:
    failing = [*PASSING_CHECKS[:1], {"name": "chat", "ok": False, "seconds": 1, "evidence": "x"}]
    ledger = write_ledger(
        tmp_path,
        entry(outcome="failed", checks=failing),
        entry(outcome="failed", checks=PASSING_CHECKS),
        entry(accelerator="cuda", outcome="skipped", checks=[]),
    )
    cells = matrix(ledger)
    assert cells["llama_cpp", "cpu", "chat"]["status"] == "planned"
    assert cells["llama_cpp", "cpu", "streaming"]["status"] == "planned"
    assert cells["llama_cpp", "cuda", "chat"]["status"] == "planned"


def test_a_passing_entry_without_a_features_check_leaves_that_feature_planned(
    tmp_path: Path,
) -> None:
    chat_only = [c for c in PASSING_CHECKS if c["name"] != "stream"]
    cells = matrix(write_ledger(tmp_path, entry(checks=chat_only)))
    assert cells["llama_cpp", "cpu", "chat"]["status"] == "live"
    assert cells["llama_cpp", "cpu", "streaming"]["status"] == "planned"


def test_an_entry_never_makes_a_refused_cell_live(tmp_path: Path) -> None:
    claims = entry(engine="vllm", checks=PASSING_CHECKS)
    cells = matrix(write_ledger(tmp_path, claims))
    assert cells["vllm", "cpu", "chat"]["status"] == "unsupported"


def test_a_corrupt_ledger_is_refused_with_its_line(tmp_path: Path) -> None:
    (tmp_path / "certification.jsonl").write_text(json.dumps(entry()) + "\nnot json\n")
    done = capabilities("--format", "json", "--ledger-dir", str(tmp_path))
    assert done.returncode == 2
    error = json.loads(done.stdout)["error"]
    assert error["code"] == "ledger_invalid"
    assert "certification.jsonl:2" in error["error"]
    assert "Traceback" not in done.stderr


def test_text_output_names_each_cell(tmp_path: Path) -> None:
    done = capabilities("--ledger-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "llama_cpp cpu chat: planned" in done.stdout
    assert "vllm cpu chat: unsupported (engine_incompatible:" in done.stdout
