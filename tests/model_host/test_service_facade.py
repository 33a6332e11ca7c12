"""The read and write methods of the one model-host facade that api/ uses on a serving host
(and the CLI offline): jobs, engine logs, the configuration in force. Over a real cache root
and journal."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbproxy.errors import SbproxyError
from sbproxy.model_host.artifacts import CacheLayout
from sbproxy.model_host.flows import GcInput, gc_workflow
from sbproxy.model_host.service import open_service
from sbproxy.store import JobStatus

pytestmark = pytest.mark.anyio


async def test_jobs_are_read_and_changed_through_the_facade(tmp_path: Path) -> None:
    async with open_service(CacheLayout(root=tmp_path / "cache")) as service:
        queued = await service.engine.submit(
            gc_workflow, GcInput(budget_bytes=1), idempotency_key="gc:1"
        )
        job_id = queued.job.id
        assert [j.id for j in await service.jobs(kind="gc")] == [job_id]
        assert await service.jobs(statuses=(JobStatus.SUCCEEDED,)) == []
        cancelled = await service.cancel_job(job_id)
        assert cancelled.status == JobStatus.CANCELLED
        assert (await service.job(job_id)).status == JobStatus.CANCELLED
        assert await service.job_steps(job_id) == []
        events = await service.job_events(job_id)
        assert events and [e.seq for e in events] == sorted(e.seq for e in events)
        followed = [e.seq async for e in service.follow_job(job_id)]
        assert followed == [e.seq for e in events]  # a finished job's stream just ends
        counts, _ = service.job_outcomes()
        assert counts.get(("gc", "cancelled")) == 1


async def test_engine_logs_are_listed_newest_first_and_tailed(tmp_path: Path) -> None:
    layout = CacheLayout(root=tmp_path / "cache")
    async with open_service(layout) as service:
        assert service.engine_logs() == {}
        for generation in (1, 3, 2):
            path = layout.engine_log("tiny", generation)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"generation {generation}\nAuthorization: Bearer sk-secret0123456789\n")
        (layout.logs / "notes.txt").write_text("not an engine log")
        assert service.engine_logs() == {"tiny": [3, 2, 1]}
        tail = service.engine_log("tiny", 2)
        assert tail.text.startswith("generation 2")
        assert "sk-secret0123456789" not in tail.text
        assert service.engine_log("tiny", 9).text == ""


async def test_without_a_configuration_the_served_one_and_usage_are_refused(
    tmp_path: Path,
) -> None:
    async with open_service(CacheLayout(root=tmp_path / "cache")) as service:
        with pytest.raises(SbproxyError) as info:
            _ = service.served
        assert info.value.code == "no_config_source"
        with pytest.raises(SbproxyError) as info:
            service.usage()
        assert info.value.code == "not_serving"
