"""Running the ``sbproxy`` CLI as a real process in tests."""

from __future__ import annotations

import os
import subprocess
import sys


def run_cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m sbproxy.cli ARGS`` with this interpreter; its exit status, stdout and
    stderr (text)."""
    return subprocess.run(
        [sys.executable, "-m", "sbproxy.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        check=False,
    )
