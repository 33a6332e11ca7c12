"""`sbproxy certify` as a real process: the stand-in llama-server (found on PATH, as an
operator's install is) serves a verified snapshot in a throw-away cache; the entries land in a
throw-away ledger, appended, never rewritten; a failing check is recorded as failed and never
makes a cell live."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sbproxy.model_host.artifacts import ArtifactCache, CacheLayout
from sbproxy.model_host.certify import Target
from sbproxy.model_host.certify import certify as certify_targets
from tests.model_host.engines.support import fake_llama_server, verified_snapshot


def sbproxy(*args: str, path_dir: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI with no cache or config from outside; ``path_dir`` first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBPROXY_", "HF_"))}
    if path_dir is not None:
        env["PATH"] = f"{path_dir}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(
        [sys.executable, "-m", "sbproxy.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**env, "PYTHONWARNINGS": "ignore"},
    )


def cache_with_model(root: Path) -> Path:
    """A cache root holding one published (verified) GGUF artifact."""
    metadata, _ = verified_snapshot(root, {"tiny.gguf": b"GGUF stand-in"})
    (root / "metadata").mkdir(parents=True)
    (root / "metadata" / f"{metadata.artifact_digest}.json").write_text(metadata.model_dump_json())
    return root


def certify(
    tmp_path: Path, *, mode: str | None = None, ledger: str = "ledger"
) -> tuple[subprocess.CompletedProcess[str], Path]:
    engine_dir = fake_llama_server(tmp_path / f"bin-{mode}", mode=mode)
    cache = tmp_path / "cache"
    if not cache.exists():
        cache_with_model(cache)
    ledger_dir = tmp_path / ledger
    done = sbproxy(
        "certify", "--format", "json", "--cache-dir", str(cache), "--ledger-dir", str(ledger_dir),
        path_dir=engine_dir.parent,
    )  # fmt: skip
    return done, ledger_dir


def test_certify_runs_load_chat_stream_stop_and_records_the_evidence(tmp_path: Path) -> None:
    done, ledger = certify(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    entries = json.loads(done.stdout)["entries"]
    cpu = next(e for e in entries if e["accelerator"] == "cpu")
    assert cpu["engine"] == "llama_cpp"
    assert cpu["outcome"] == "passed"
    assert [c["name"] for c in cpu["checks"]] == ["load", "chat", "stream", "stop"]
    assert all(c["ok"] and c["seconds"] >= 0 for c in cpu["checks"])
    assert cpu["model"]["digest"] and cpu["engine_build"]["source"] == "PATH"
    assert cpu["hardware"]["worker"].startswith(("cpu", "cuda"))
    assert cpu["recorded_at"].endswith("Z")
    # The same entries are the JSON ledger, and a section of the Markdown one.
    written = [
        json.loads(line) for line in (ledger / "certification.jsonl").read_text().splitlines()
    ]
    assert written == entries
    markdown = (ledger / "certification.md").read_text()
    assert "llama_cpp on cpu -- passed" in markdown
    assert "| stream | pass |" in markdown
    # And the matrix reads them: the CPU cells it checked are live.
    shown = sbproxy("capabilities", "--format", "json", "--ledger-dir", str(ledger))
    cells = {
        (c["engine"], c["accelerator"], c["feature"]): c for c in json.loads(shown.stdout)["cells"]
    }
    assert cells["llama_cpp", "cpu", "chat"]["status"] == "live"
    assert cells["llama_cpp", "cpu", "streaming"]["status"] == "live"


def test_without_a_gpu_cuda_is_recorded_skipped_with_why(tmp_path: Path) -> None:
    done, _ = certify(tmp_path)
    entries = {e["engine"] + "/" + e["accelerator"]: e for e in json.loads(done.stdout)["entries"]}
    if entries["llama_cpp/cuda"]["hardware"]["gpus"]:
        return  # a GPU machine: the CUDA entry is whatever its build allows
    assert entries["llama_cpp/cuda"]["outcome"] == "skipped"
    assert "no NVIDIA GPU" in entries["llama_cpp/cuda"]["reason"]
    assert entries["vllm/cuda"]["outcome"] == "skipped"
    assert entries["vllm/cuda"]["reason"]


def test_a_failing_check_is_recorded_failed_and_makes_nothing_live(tmp_path: Path) -> None:
    done, ledger = certify(tmp_path, mode="drop_completions")
    assert done.returncode == 1, done.stdout + done.stderr
    cpu = next(e for e in json.loads(done.stdout)["entries"] if e["accelerator"] == "cpu")
    assert cpu["outcome"] == "failed"
    assert cpu["reason"].startswith("chat failed")
    checks = {c["name"]: c["ok"] for c in cpu["checks"]}
    assert checks["load"] is True and checks["chat"] is False and checks["stop"] is True
    assert "llama_cpp on cpu -- failed" in (ledger / "certification.md").read_text()
    shown = sbproxy("capabilities", "--format", "json", "--ledger-dir", str(ledger))
    cells = {
        (c["engine"], c["accelerator"], c["feature"]): c for c in json.loads(shown.stdout)["cells"]
    }
    assert cells["llama_cpp", "cpu", "chat"]["status"] == "planned"
    assert cells["llama_cpp", "cpu", "streaming"]["status"] == "planned"


def test_a_second_run_appends_and_leaves_earlier_entries_byte_for_byte(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    earlier_json = json.dumps({"engine": "llama_cpp", "accelerator": "cpu", "outcome": "x"}) + "\n"
    earlier_md = "# Certification ledger\n\nAn entry written by hand long ago.\n"
    (ledger / "certification.jsonl").write_text(earlier_json)
    (ledger / "certification.md").write_text(earlier_md)
    first, _ = certify(tmp_path)
    assert first.returncode == 0, first.stderr
    after_first = {
        name: (ledger / name).read_text() for name in ("certification.jsonl", "certification.md")
    }
    second, _ = certify(tmp_path)
    assert second.returncode == 0, second.stderr
    json_text = (ledger / "certification.jsonl").read_text()
    md_text = (ledger / "certification.md").read_text()
    assert json_text.startswith(after_first["certification.jsonl"])
    assert after_first["certification.jsonl"].startswith(earlier_json)
    assert md_text.startswith(after_first["certification.md"])
    assert after_first["certification.md"].startswith(earlier_md)
    assert md_text.count("# Certification ledger") == 1
    assert len(json_text.splitlines()) == 1 + 2 * len(json.loads(first.stdout)["entries"])


def test_dry_run_says_what_would_run_and_writes_nothing(tmp_path: Path) -> None:
    engine_dir = fake_llama_server(tmp_path / "bin")
    cache = cache_with_model(tmp_path / "cache")
    ledger = tmp_path / "ledger"
    done = sbproxy(
        "certify", "--dry-run", "--format", "json", "--cache-dir", str(cache),
        "--ledger-dir", str(ledger), path_dir=engine_dir.parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    targets = json.loads(done.stdout)["targets"]
    assert targets[0]["engine"] == "llama_cpp" and targets[0]["run"] is True
    assert not ledger.exists()


def test_without_an_engine_or_a_model_it_says_what_to_run_first(tmp_path: Path) -> None:
    # Nothing on PATH, an empty cache: no engine.
    done = sbproxy(
        "certify", "--format", "json", "--cache-dir", str(tmp_path / "empty"),
        "--ledger-dir", str(tmp_path / "ledger"), path_dir=tmp_path / "nothing",
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    error = json.loads(done.stdout)["error"]
    assert error["code"] == "certify_inputs_missing"
    assert "scripts/main.sh" in error["remediation"]
    # An engine but no model.
    engine_dir = fake_llama_server(tmp_path / "bin")
    done = sbproxy(
        "certify", "--cache-dir", str(tmp_path / "empty"),
        "--ledger-dir", str(tmp_path / "ledger"), path_dir=engine_dir.parent,
    )  # fmt: skip
    assert done.returncode == 2
    assert "no cached GGUF model" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "ledger").exists()


@pytest.mark.anyio
async def test_a_launch_across_several_devices_records_the_multi_device_check(
    tmp_path: Path,
) -> None:
    # No GPU needed to exercise the bookkeeping: the stand-in ignores CUDA_VISIBLE_DEVICES.
    executable = fake_llama_server(tmp_path / "bin")
    cache = cache_with_model(tmp_path / "cache")
    (metadata,) = ArtifactCache(CacheLayout(root=cache)).published()
    target = Target(
        "llama_cpp",
        "cuda",
        executable,
        {"build_id": "stand-in"},
        metadata,
        cache / "snapshots" / metadata.artifact_digest,
        (0, 1),
    )
    (entry,) = await certify_targets([target], scratch=tmp_path / "scratch", gpus=[])
    names = [check["name"] for check in entry["checks"]]  # type: ignore[attr-defined]
    assert names == ["load", "chat", "multi_device", "stream", "stop"]
    assert entry["outcome"] == "passed"
