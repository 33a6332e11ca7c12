"""The model-host domain: artifacts, engines, runtime and the durable flows built on them."""

from __future__ import annotations

__all__: list[str] = []
