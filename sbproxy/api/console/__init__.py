"""The operator console: server-rendered pages under ``/admin/ui/`` on the admin listener.

Deployments (with load, stop, drain and reset and their jobs' live progress), jobs (list and
detail, live from the durable event stream), recent gateway activity with charts, engine
output (bounded, redacted log tails), the cache (budget use and a gc dry run) and, on a host
of a fleet, the fleet (nodes, replicas, controller, placement jobs). The pages
sit behind the admin router's guard (allowlist and HTTP Basic). Every asset is served from
this package: no CDN, no build step.

The test contract: an element per deployment carries ``data-deployment`` and
``data-state``; action buttons carry ``data-action``; job rows carry ``data-job-id``.
"""

from __future__ import annotations

from sbproxy.api.console.routes import (
    CONSOLE_HEADER,
    console_router,
    console_sampler,
    console_templates,
)

__all__ = ["CONSOLE_HEADER", "console_router", "console_sampler", "console_templates"]
