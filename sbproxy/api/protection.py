"""The one model-host facade (:class:`~sbproxy.model_host.service.ModelHostService`) the
admin API and the console use, as the CLI does, with the serving runtime's protection
(which cached artifacts removal and collection must leave alone, and why).
"""

from __future__ import annotations

from sbproxy.model_host.runtime.manager import RuntimeManager
from sbproxy.model_host.service import ModelHostService

__all__ = ["host_service"]


def host_service(manager: RuntimeManager) -> ModelHostService:
    """The model-host facade over the serving host's cache root, journal, catalog and
    configuration now (built per call: a reload may change the last two), with the
    runtime's protection (configured and resident artifacts)."""
    return ModelHostService(
        layout=manager.layout,
        catalog=manager.catalog,
        engine=manager.engine,
        config=manager.compiled,
        protection=manager.artifact_protection,
    )
