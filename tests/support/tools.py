"""Machine tools some tests drive (Debian's chromium, faketime): skip without them on a
developer's machine, but never in CI, where `.ci/run` sets ``SBPROXY_REQUIRE_TOOLS=1`` and
``scripts/test.sh`` installs them -- a missing tool there is a failure, not a silent skip."""

from __future__ import annotations

import os

import pytest

__all__ = ["tools_required", "without_tool"]


def tools_required() -> bool:
    """Whether this run must have every tool (CI)."""
    return os.environ.get("SBPROXY_REQUIRE_TOOLS") == "1"


def without_tool(reason: str) -> None:
    """Skip the calling module (fail it in CI) because a tool is missing: ``reason`` says
    which and how to install it."""
    if tools_required():
        raise RuntimeError(f"SBPROXY_REQUIRE_TOOLS=1 but {reason}")
    pytest.skip(reason, allow_module_level=True)
