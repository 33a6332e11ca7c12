"""One span per job run and per step; a job links to the trace that created it."""

from __future__ import annotations

from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import BaseModel

from sbproxy.telemetry import tracer
from sbproxy.workflows import Registry, StepContext, WorkflowContext, WorkflowEngine, step
from tests.support.spans import memory_spans

pytestmark = pytest.mark.anyio


@pytest.fixture
def spans() -> InMemorySpanExporter:
    return memory_spans()


class Payload(BaseModel):
    value: int


@step("double")
async def double(ctx: StepContext, arg: Payload) -> Payload:
    """Idempotency: pure."""
    return Payload(value=arg.value * 2)


registry = Registry()


@registry.workflow("traced")
async def traced(ctx: WorkflowContext, arg: Payload) -> Payload:
    first = await ctx.step(double, arg, name="double:1")
    return await ctx.step(double, first, name="double:2")


async def test_job_and_step_spans_link_to_the_submitting_trace(
    tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    engine = await WorkflowEngine.open(tmp_path / "journal.db", registry)
    with tracer().start_as_current_span("POST /admin/model-host/load") as request:
        submitted = await engine.submit(traced, Payload(value=3))
        request_context = request.get_span_context()
    job = await engine.join(submitted.job.id)
    await engine.close()
    assert job.trace_context is not None
    assert "traceparent" in job.trace_context

    finished = {span.name: span for span in spans.get_finished_spans()}
    job_span = finished["job traced"]
    assert job_span.attributes is not None
    assert job_span.attributes["sbproxy.job.id"] == job.id
    assert job_span.attributes["sbproxy.job.kind"] == "traced"
    assert job_span.attributes["sbproxy.job.attempt"] == 1
    assert [link.context.trace_id for link in job_span.links] == [request_context.trace_id]
    for name in ("double:1", "double:2"):
        step_span = finished[f"step {name}"]
        assert step_span.attributes is not None
        assert step_span.attributes["sbproxy.step.name"] == name
        assert step_span.attributes["sbproxy.step.attempt"] == 1
        assert step_span.parent is not None
        assert step_span.parent.span_id == job_span.context.span_id
