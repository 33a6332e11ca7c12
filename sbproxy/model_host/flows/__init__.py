"""The durable workflows of the model host (pull, verify, prepare, warm, drain, ...).

``registry`` holds every model-host workflow kind; the server's worker loop and CLI processes
that run jobs in-process use it.
"""

from __future__ import annotations

from sbproxy.workflows import Registry

__all__ = ["registry"]

registry = Registry()
