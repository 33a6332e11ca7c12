"""`sbproxy run`: refusals and the generated configuration (the real run is in tests/e2e)."""

from __future__ import annotations

import subprocess
import sys

import yaml

from sbproxy.config import load_config_text


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sbproxy.cli", "run", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_dry_run_prints_a_valid_canonical_configuration() -> None:
    done = run("gemma-3-270m", "--dry-run", "--port", "8099")
    assert done.returncode == 0, done.stderr
    first, _, body = done.stdout.partition("\n")
    assert first == "# resolved gemma-3-270m:q4_k_m with llama_cpp"
    for fragment in ("model_host:", "provider_type: managed_model", "warm: true", "enabled: true"):
        assert fragment in body
    assert "serve:" not in body
    assert "changeme" not in body
    document = yaml.safe_load(body)
    assert document["proxy"]["http_bind_port"] == 8099
    deployment = document["proxy"]["model_host"]["deployments"]["local"]
    assert (deployment["pull"], deployment["warm"]) == ("on_boot", True)
    # With a real password in place, the file is a valid configuration.
    document["proxy"]["admin"]["password"] = "x" * 64
    compiled = load_config_text(yaml.safe_dump(document))
    assert {r.origin for r in compiled.routes} == {"127.0.0.1", "localhost"}
    assert all(r.deployment == "local" and r.default for r in compiled.routes)


def test_raw_references_are_refused() -> None:
    for reference in (
        "hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF",
        "Qwen/Qwen2.5",
        "qwen:q4",
        "/models/x.gguf",
    ):
        done = run(reference)
        assert done.returncode == 2, reference
        assert "raw model reference" in done.stderr
        assert "catalog" in done.stderr


def test_unknown_models_and_variants_exit_2() -> None:
    done = run("no-such-model")
    assert done.returncode == 2
    assert "not in the catalog" in done.stderr
    done = run("gemma-3-270m", "--variant", "bf16")
    assert done.returncode == 2
    assert "no variant 'bf16'" in done.stderr
