"""OpenTelemetry: the tracer, span attribute names, and trace-context carriers for jobs.

Only the OpenTelemetry *API* is imported here; the SDK is imported lazily by
:func:`configure_tracing`, so importing sbproxy (and every CLI call) stays cheap and tracing
costs nothing until it is configured. Until then the API's no-op tracer is used.

:func:`configure_from_environment` turns on OTLP/HTTP export when
``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set, the
standard OpenTelemetry variables; without them nothing is exported and :func:`enabled` stays
false, which the HTTP layer reads to skip request spans entirely (the hot path then pays one
boolean test, not a no-op span).

Jobs store the W3C trace context of the request that created them (:func:`current_carrier`)
and each run of a job links to it (:func:`link_from_carrier`), so a job resumed by another
process after a restart still points at its original trace.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from opentelemetry import propagate, trace

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

__all__ = [
    "ATTR_DEPLOYMENT",
    "ATTR_INPUT_TOKENS",
    "ATTR_JOB_ATTEMPT",
    "ATTR_JOB_ID",
    "ATTR_JOB_KIND",
    "ATTR_KEY_NAME",
    "ATTR_MODEL",
    "ATTR_OUTPUT_TOKENS",
    "ATTR_PEER_NODE",
    "ATTR_SPILLED",
    "ATTR_STEP",
    "ATTR_STEP_ATTEMPT",
    "configure_from_environment",
    "configure_tracing",
    "current_carrier",
    "enabled",
    "link_from_carrier",
    "shutdown_tracing",
    "tracer",
]

logger = logging.getLogger(__name__)

ATTR_DEPLOYMENT = "sbproxy.deployment"
ATTR_JOB_ID = "sbproxy.job.id"
ATTR_JOB_KIND = "sbproxy.job.kind"
ATTR_JOB_ATTEMPT = "sbproxy.job.attempt"
ATTR_STEP = "sbproxy.step.name"
ATTR_STEP_ATTEMPT = "sbproxy.step.attempt"
# The public model name a gateway request asked for (the deployment is ATTR_DEPLOYMENT).
ATTR_MODEL = "sbproxy.model"
# The configured name of the caller's API key -- never the key itself.
ATTR_KEY_NAME = "sbproxy.key.name"
# Token usage of a gateway answer (OpenTelemetry GenAI semantic conventions).
ATTR_INPUT_TOKENS = "gen_ai.usage.input_tokens"
ATTR_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
# On a host of a fleet: the node of the peer replica that answered a gateway request, and the
# code of this host's own refusal when the request spilled over to it.
ATTR_PEER_NODE = "sbproxy.peer.node"
ATTR_SPILLED = "sbproxy.peer.spilled"

_provider: TracerProvider | None = None


def enabled() -> bool:
    """Whether an SDK tracer provider was installed by :func:`configure_tracing`."""
    return _provider is not None


def tracer() -> trace.Tracer:
    """The sbproxy tracer (resolved at call time, so a provider set later is honoured)."""
    return trace.get_tracer("sbproxy")


def configure_tracing(exporter: SpanExporter, *, simple: bool = False) -> None:
    """Install an SDK tracer provider exporting to ``exporter`` (a second call adds
    ``exporter`` to the provider already installed).

    Args:
        exporter: Where spans go (OTLP, console, or an in-memory exporter in tests).
        simple: Export each span synchronously (tests) instead of in batches.
    """
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    global _provider  # noqa: PLW0603 - one provider per process, like OpenTelemetry's own
    processor = SimpleSpanProcessor(exporter) if simple else BatchSpanProcessor(exporter)
    if _provider is not None:  # OpenTelemetry refuses a second global provider: extend it
        _provider.add_span_processor(processor)
        return
    provider = TracerProvider(resource=Resource.create({"service.name": "sbproxy"}))
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    _provider = provider


def configure_from_environment(environ: Mapping[str, str] | None = None) -> bool:
    """Export spans over OTLP/HTTP (protobuf) when the environment asks for it.

    Reads the standard variables: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (the full URL) or
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` (a base URL; ``/v1/traces`` is appended), plus the
    exporter's own ``OTEL_EXPORTER_OTLP_HEADERS``/``_TIMEOUT`` and the batch processor's
    ``OTEL_BSP_*``. ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` turn it off.
    Idempotent: a process that already has a provider keeps it. The SDK provider flushes
    its batched spans at interpreter exit (its own ``atexit`` hook), so a server stopped by
    SIGTERM exports its last spans.

    Returns:
        Whether tracing is on after the call.
    """
    env = os.environ if environ is None else environ
    if _provider is not None:
        return True
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if not endpoint or not endpoint.strip():
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    configure_tracing(OTLPSpanExporter())
    # The endpoint may carry credentials (userinfo, a query string): it is not logged.
    logger.info("exporting traces over OTLP/HTTP")
    return True


def shutdown_tracing() -> None:
    """Flush and stop the installed provider (at process exit); a no-op without one."""
    if _provider is not None:
        _provider.shutdown()


def current_carrier() -> dict[str, str]:
    """The current trace context as W3C headers (``traceparent``); empty without a span."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def link_from_carrier(carrier: Mapping[str, str] | None) -> trace.Link | None:
    """A span link to the context stored in ``carrier``, if it holds a valid one."""
    if not carrier:
        return None
    context = propagate.extract(dict(carrier))
    span_context = trace.get_current_span(context).get_span_context()
    return trace.Link(span_context) if span_context.is_valid else None
