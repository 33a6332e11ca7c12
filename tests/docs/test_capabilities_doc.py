"""docs/capabilities.md is what `sbproxy capabilities --format markdown` prints (from the
checked-in ledger), and says plainly that CUDA is planned until a GPU is certified."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "capabilities.md"


def test_the_capabilities_page_is_current() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sbproxy.cli", "capabilities", "--format", "markdown"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert PAGE.read_text() == done.stdout, (
        "docs/capabilities.md is stale; regenerate it with "
        "`sbproxy capabilities --format markdown > docs/capabilities.md`"
    )


def test_the_page_shows_the_certified_cpu_cells_live_and_cuda_planned() -> None:
    text = PAGE.read_text()
    assert "| chat | live | planned |" in text
    assert "No GPU has been certified" in text
