"""The registry of every model-host workflow kind.

It lives outside `flows/` so that engine modules can register their acquisition workflows
without importing the flows package (which imports them back to register everything).
"""

from __future__ import annotations

from sbproxy.workflows import Registry

__all__ = ["registry"]

registry = Registry()
