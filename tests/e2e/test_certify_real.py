"""`sbproxy certify` against the real llama-server (built from the pinned source) and the real
SmolLM2 chat GGUF: the CPU entry passes load, chat, stream and stop, and the matrix shows it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.e2e.conftest import E2E_TIMEOUT_S, sbproxy

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(E2E_TIMEOUT_S)]


def test_certify_records_the_real_cpu_engine_live(
    llama_server: Path, smol_cache: Path, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SBPROXY_")}
    # The built engine reached as an operator's install is: first on PATH.
    env["PATH"] = f"{llama_server.parent}{os.pathsep}{env.get('PATH', '')}"
    ledger = tmp_path / "ledger"
    done = sbproxy(
        "certify", "--format", "json", "--cache-dir", str(smol_cache),
        "--ledger-dir", str(ledger), env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    cpu = next(e for e in json.loads(done.stdout)["entries"] if e["accelerator"] == "cpu")
    assert cpu["outcome"] == "passed", cpu
    assert cpu["model"]["id"] == "smollm2-135m-instruct"
    assert [c["name"] for c in cpu["checks"] if c["ok"]] == ["load", "chat", "stream", "stop"]
    shown = sbproxy("capabilities", "--format", "json", "--ledger-dir", str(ledger), env=env)
    cells = {
        (c["engine"], c["accelerator"], c["feature"]): c["status"]
        for c in json.loads(shown.stdout)["cells"]
    }
    assert cells["llama_cpp", "cpu", "chat"] == "live"
    assert cells["llama_cpp", "cpu", "streaming"] == "live"
