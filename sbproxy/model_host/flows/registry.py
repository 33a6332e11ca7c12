"""The registry of every model-host workflow kind."""

from __future__ import annotations

from sbproxy.workflows import Registry

__all__ = ["registry"]

registry = Registry()
