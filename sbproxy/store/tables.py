"""Table mappings of the journal (SQLModel). The DDL itself lives in versioned migrations;
a test keeps these mappings and the migrated schema identical.
"""

from __future__ import annotations

from sqlmodel import Field, SQLModel

__all__ = [
    "DesiredRevisionRow",
    "EventRow",
    "GenerationRow",
    "JobRow",
    "RevisionRow",
    "StepRow",
    "UsageRow",
]


class JobRow(SQLModel, table=True):
    """One workflow run."""

    __tablename__ = "jobs"

    id: str = Field(primary_key=True)
    kind: str
    workflow_version: int
    subject: str | None = None
    input_json: str
    idempotency_key: str | None = None
    status: str
    attempt: int = 0
    lease_owner: str | None = None
    # Wall-clock lease of schemas 1-3, always NULL since schema 4 (see migration 4).
    lease_expires_at_ms: int | None = None
    cancel_requested: int = 0
    progress_json: str | None = None
    output_json: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    trace_context: str | None = None
    created_at_ms: int
    updated_at_ms: int
    started_at_ms: int | None = None
    ended_at_ms: int | None = None
    # The lease, on the lease clock (``leaseclock.py``): boot id, deadline in ms on that boot's
    # CLOCK_MONOTONIC, lease length in ms.
    lease_clock: str | None = None
    lease_deadline_ms: int | None = None
    lease_ms: int | None = None
    # Recoveries since a step last completed (migration 5); reset by a completed step and by
    # an operator's retry.
    recoveries: int = 0
    # The node that submitted the job (migration 6); NULL: any node.
    node: str | None = None


class StepRow(SQLModel, table=True):
    """One journal entry: a step of a job, by position."""

    __tablename__ = "steps"

    job_id: str = Field(primary_key=True, foreign_key="jobs.id")
    seq: int = Field(primary_key=True)
    name: str
    status: str
    attempts: int = 0
    output_json: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    started_at_ms: int
    ended_at_ms: int | None = None


class EventRow(SQLModel, table=True):
    """One job event; ``seq`` is global, durable and strictly increasing."""

    __tablename__ = "job_events"

    seq: int | None = Field(default=None, primary_key=True)
    job_id: str = Field(foreign_key="jobs.id")
    at_ms: int
    type: str
    data_json: str


class GenerationRow(SQLModel, table=True):
    """The last generation number handed out per deployment (monotonic across restarts)."""

    __tablename__ = "deployment_generations"

    deployment: str = Field(primary_key=True)
    generation: int
    updated_at_ms: int


class RevisionRow(SQLModel, table=True):
    """A committed desired state of the runtime."""

    __tablename__ = "runtime_revisions"

    revision: int | None = Field(default=None, primary_key=True)
    content_digest: str
    desired_json: str
    committed_at_ms: int


class DesiredRevisionRow(SQLModel, table=True):
    """One ``admin_managed`` revision document of hosts sharing a PostgreSQL journal."""

    __tablename__ = "desired_revisions"

    revision: int = Field(primary_key=True)
    document: str
    committed_at_ms: int


class UsageRow(SQLModel, table=True):
    """Tokens one API key used in one UTC hour (``hour_start_ms``: epoch ms, a multiple of
    3,600,000)."""

    __tablename__ = "token_usage"

    key_name: str = Field(primary_key=True)
    hour_start_ms: int = Field(primary_key=True)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    requests: int = 0
    updated_at_ms: int
