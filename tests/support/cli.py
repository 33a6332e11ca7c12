"""Running the ``sbproxy`` CLI as a real process in tests."""

from __future__ import annotations

import os
import signal
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


def stop_process(process: subprocess.Popen[str], *, timeout_s: float = 30) -> int:
    """Stop a served ``sbproxy`` as an operator would: SIGTERM, then SIGKILL if it has not
    exited within ``timeout_s``; its exit status (at once when it already exited)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode
