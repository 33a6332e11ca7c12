"""One in-memory span exporter for the whole test process (the OpenTelemetry SDK allows one
global tracer provider per process, so every test module that looks at spans shares it)."""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sbproxy.telemetry import configure_tracing

_exporter = InMemorySpanExporter()
_configured = False


def memory_spans() -> InMemorySpanExporter:
    """The process's in-memory exporter (installed on first use), emptied."""
    global _configured  # noqa: PLW0603 - installed once per process
    if not _configured:
        configure_tracing(_exporter, simple=True)
        _configured = True
    _exporter.clear()
    return _exporter
