"""The HTTP surface: the only package that imports litestar (gateway, admin, jobs, metrics).

* :func:`create_gateway_app` -- the OpenAI-compatible listener (``/v1/*``).
* :func:`create_admin_app` -- the authenticated admin listener (``/admin/*``, ``/metrics``).
* :func:`open_host` -- the runtime manager and job worker assembled from a configuration.
* :func:`serve` -- both listeners, the runtime and the worker in one process (``sbproxy serve``).
"""

from __future__ import annotations

from sbproxy.api.admin import Admin, create_admin_app
from sbproxy.api.gateway import Gateway, Routing, create_gateway_app
from sbproxy.api.host import ServedHost, open_host
from sbproxy.api.keys import KeyPlane
from sbproxy.api.metrics import Rejections, build_registry
from sbproxy.api.server import serve

__all__ = [
    "Admin",
    "Gateway",
    "KeyPlane",
    "Rejections",
    "Routing",
    "ServedHost",
    "build_registry",
    "create_admin_app",
    "create_gateway_app",
    "open_host",
    "serve",
]
