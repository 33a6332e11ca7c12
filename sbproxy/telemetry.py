"""OpenTelemetry: the tracer, span attribute names, and trace-context carriers for jobs.

Only the OpenTelemetry *API* is imported here; the SDK is imported lazily by
:func:`configure_tracing`, so importing sbproxy (and every CLI call) stays cheap and tracing
costs nothing until it is configured. Until then the API's no-op tracer is used.

Jobs store the W3C trace context of the request that created them (:func:`current_carrier`)
and each run of a job links to it (:func:`link_from_carrier`), so a job resumed by another
process after a restart still points at its original trace.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from opentelemetry import propagate, trace

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

__all__ = [
    "ATTR_DEPLOYMENT",
    "ATTR_JOB_ATTEMPT",
    "ATTR_JOB_ID",
    "ATTR_JOB_KIND",
    "ATTR_STEP",
    "ATTR_STEP_ATTEMPT",
    "configure_tracing",
    "current_carrier",
    "link_from_carrier",
    "tracer",
]

ATTR_DEPLOYMENT = "sbproxy.deployment"
ATTR_JOB_ID = "sbproxy.job.id"
ATTR_JOB_KIND = "sbproxy.job.kind"
ATTR_JOB_ATTEMPT = "sbproxy.job.attempt"
ATTR_STEP = "sbproxy.step.name"
ATTR_STEP_ATTEMPT = "sbproxy.step.attempt"


def tracer() -> trace.Tracer:
    """The sbproxy tracer (resolved at call time, so a provider set later is honoured)."""
    return trace.get_tracer("sbproxy")


def configure_tracing(exporter: SpanExporter, *, simple: bool = False) -> None:
    """Install an SDK tracer provider exporting to ``exporter``.

    Args:
        exporter: Where spans go (OTLP, console, or an in-memory exporter in tests).
        simple: Export each span synchronously (tests) instead of in batches.
    """
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "sbproxy"}))
    processor = SimpleSpanProcessor(exporter) if simple else BatchSpanProcessor(exporter)
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)


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
