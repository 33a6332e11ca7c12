"""What workflow and step code sees while a job runs."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from opentelemetry import trace
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from sbproxy.errors import SbproxyError, sole_error
from sbproxy.store import (
    EndedStep,
    ErrorInfo,
    JobJournal,
    JobRecord,
    StepRecord,
    StepRefusal,
    StepStatus,
    journal_fault,
)
from sbproxy.telemetry import ATTR_JOB_ID, ATTR_JOB_KIND, ATTR_STEP, ATTR_STEP_ATTEMPT, tracer
from sbproxy.workflows.declare import StepDef
from sbproxy.workflows.errors import (
    JobCancelled,
    LeaseLost,
    NondeterminismError,
    StepFailed,
    WorkflowError,
)
from sbproxy.workflows.faults import fault_point

__all__ = ["StepContext", "WorkflowContext"]

logger = logging.getLogger(__name__)

A = TypeVar("A")
R = TypeVar("R")
T = TypeVar("T")

# Progress is persisted at most this often (plus always at completion); one event is one
# durable commit (~0.2-0.4 ms with the SQLite journal's synchronous=FULL here,
# benchmarks/journal.py), so a few per second per job is cheap.
PROGRESS_INTERVAL_S = 0.25
# A retry event quotes the error that caused it; the whole message is the step's error if the
# last attempt fails too, so the event keeps only enough to say what went wrong.
RETRY_MESSAGE_CHARS = 300


def journal_fault_in(exc: BaseException) -> SbproxyError | None:
    """The journal's own failure that ``exc`` is (or, a task group's, wraps alone), else
    ``None`` (see :func:`sbproxy.store.journal_fault`)."""
    error = sole_error(exc)
    return error if error is not None and journal_fault(error) else None


def _is_retryable(exc: BaseException) -> bool:
    # A lost lease is "retryable" for the job (another run resumes it), never for this run;
    # so is a journal that cannot record (the run stops and resumes; a retry could not even
    # announce itself).
    return (
        isinstance(exc, SbproxyError)
        and exc.retryable
        and not isinstance(exc, JobCancelled | LeaseLost)
        and not journal_fault(exc)
    )


class _JobState:
    """Mutable run state shared by the workflow and step contexts (one job run)."""

    def __init__(self, job: JobRecord, owner: str, resources: Sequence[object] = ()) -> None:
        self.job = job
        self.owner = owner
        self.resources = tuple(resources)
        self.cancel_requested = job.cancel_requested
        self.lease_lost = False

    @property
    def attempt(self) -> int:
        """The claim this run holds: the job's ``attempt`` when it was claimed."""
        return self.job.attempt

    def lose_lease(self, what: str) -> LeaseLost:
        """Mark this run as having lost its lease; the error to raise (``lease_lost``).

        ``what`` names the fenced write that changed nothing (``end of step fetch``).
        """
        self.lease_lost = True
        logger.warning(
            "job %s: %s changed nothing: attempt %d no longer holds the job; stopping this run",
            self.job.id,
            what,
            self.attempt,
        )
        return LeaseLost(
            f"job {self.job.id}: attempt {self.attempt} lost its lease ({what} was fenced off); "
            "another run resumes the job",
            details={"job_id": self.job.id, "attempt": self.attempt},
        )


class StepContext:
    """Passed to a step: progress reporting and cooperative cancellation.

    Attributes:
        job_id: The job's id.
        step_name: This step's journal name.
        seq: Position of the step in the journal.
        attempt: 1 for the first run of this step, more after a crash or a retry.
    """

    def __init__(
        self, *, store: JobJournal, state: _JobState, step_name: str, seq: int, attempt: int
    ) -> None:
        self._store = store
        self._state = state
        self.job_id = state.job.id
        self.step_name = step_name
        self.seq = seq
        self.attempt = attempt
        self._last_progress = 0.0

    def resource(self, kind: type[T]) -> T:
        """The engine's resource of type ``kind`` (a cache, a client, ...).

        Raises:
            WorkflowError: ``missing_resource`` when the engine was built without one.
        """
        for candidate in self._state.resources:
            if isinstance(candidate, kind):
                return candidate
        raise WorkflowError(
            f"step {self.step_name} needs a {kind.__name__}, which this engine does not have",
            code="missing_resource",
        )

    def find_resource(self, kind: type[T]) -> T | None:
        """The engine's resource of type ``kind``, or ``None`` when it has none (a resource
        only some hosts give, such as a fleet's peers)."""
        for candidate in self._state.resources:
            if isinstance(candidate, kind):
                return candidate
        return None

    async def record_event(self, kind: str, data: Mapping[str, Any]) -> None:
        """Append a ``kind`` event with ``data`` to the job's events (a note for readers of
        the job, e.g. where a file came from; never a decision, not fenced)."""
        await self._store.record_event(self.job_id, kind=kind, data=data)

    @property
    def cancel_requested(self) -> bool:
        """Whether cancellation was seen (refreshed by the heartbeat)."""
        return self._state.cancel_requested

    def check_cancelled(self) -> None:
        """Raise :class:`JobCancelled` if cancellation was requested; call it in long loops."""
        if self._state.cancel_requested:
            raise JobCancelled(f"job {self.job_id} was cancelled during step {self.step_name}")

    async def report_progress(
        self,
        *,
        done: int,
        total: int | None = None,
        unit: str = "bytes",
        current: str | None = None,
        force: bool = False,
    ) -> None:
        """Report progress (``done`` of ``total`` ``unit``; ``current`` item name).

        Throttled to one write every 0.25 s unless ``force`` or the work is complete.

        Raises:
            LeaseLost: ``lease_lost`` when this run no longer holds the job (the write was
                fenced off); the step must let it propagate.
        """
        now = time.monotonic()
        complete = total is not None and done >= total
        if not (force or complete) and now - self._last_progress < PROGRESS_INTERVAL_S:
            return
        self._last_progress = now
        progress: dict[str, Any] = {"done": done, "total": total, "unit": unit}
        if current is not None:
            progress["current"] = current
        progress["step"] = self.step_name
        written = await self._store.report_progress(
            self.job_id,
            owner=self._state.owner,
            attempt=self._state.attempt,
            progress=progress,
            event=True,
        )
        if not written:
            raise self._state.lose_lease(f"progress of step {self.step_name}")


class WorkflowContext:
    """Passed to a workflow body: runs steps through the journal.

    Attributes:
        job_id: The job's id (stable across restarts; use it to name temporary files).
        attempt: How many times a worker has claimed this job.
    """

    def __init__(
        self,
        *,
        store: JobJournal,
        state: _JobState,
        journal: Mapping[int, StepRecord],
    ) -> None:
        self._store = store
        self._state = state
        self._journal = dict(journal)
        self._seq = 0
        # The last step that succeeded here, its result not journaled yet: it is recorded
        # with the next step's start, or by settle() before the job's outcome.
        self._ended: EndedStep | None = None
        # Whether the job's recovery count may still need its reset by a completed step:
        # only while it was not 0 at the claim and no step of this run has reset it (nothing
        # else changes it while the claim holds).
        self._reset_pending = state.job.recoveries != 0
        self.job_id = state.job.id
        self.attempt = state.job.attempt

    @property
    def steps_run(self) -> int:
        """How many steps the body has reached so far."""
        return self._seq

    def journal_tail(self) -> int:
        """Highest recorded step position plus one (0 for an empty journal)."""
        return max(self._journal, default=-1) + 1

    async def step(self, definition: StepDef[A, R], arg: A, *, name: str | None = None) -> R:
        """Run (or replay) one step and return its result.

        Args:
            definition: The declared step.
            arg: Its single argument.
            name: Journal name when one step function runs several times in a workflow
                (``download:<path>``); defaults to the declared name.

        Raises:
            NondeterminismError: the journal holds a different step at this position.
            JobCancelled: cancellation was requested.
            StepFailed: the step failed permanently or ran out of retries (its reason code).
            LeaseLost: ``lease_lost``: a fenced journal write changed nothing because this
                run no longer holds the job; nothing more is written.
            SbproxyError: the journal's own failure (``journal_unavailable``, ``disk_full``,
                ``store_failed``; :func:`~sbproxy.store.journal_fault`), as itself: the step
                is not retried and nothing more is written; the run stops, holding its claim.
        """
        seq = self._seq
        self._seq += 1
        step_name = name or definition.name
        recorded = self._journal.get(seq)
        if recorded is not None and recorded.name != step_name:
            raise NondeterminismError(
                f"job {self.job_id} journaled step {seq} as {recorded.name!r} but the "
                f"workflow now runs {step_name!r} there",
                remediation="Finish or cancel jobs before changing a workflow's steps; "
                "`sbproxy jobs cancel` discards this one.",
            )
        if recorded is not None and recorded.status == StepStatus.SUCCEEDED:
            assert recorded.output_json is not None  # noqa: S101 - succeeded steps have output
            output = definition.decode(recorded.output_json)
            if definition.observe is None or await definition.observe(
                StepContext(
                    store=self._store,
                    state=self._state,
                    step_name=step_name,
                    seq=seq,
                    attempt=recorded.attempts,
                ),
                output,
            ):
                return output
            logger.info(
                "job %s: the recorded output of step %s no longer holds; running it again",
                self.job_id,
                step_name,
            )
        ended, self._ended = self._ended, None
        started = await self._store.begin_step(
            self.job_id,
            owner=self._state.owner,
            attempt=self._state.attempt,
            seq=seq,
            name=step_name,
            ending=ended,
        )
        if started == StepRefusal.LEASE_LOST:
            what = f"end of step {ended.name} and " if ended else ""
            raise self._state.lose_lease(f"{what}start of step {step_name}")
        if ended is not None:
            # Its result is durable: a crash from here on replays it, never reruns it.
            self._reset_pending = False
            fault_point(f"step:{ended.name}:committed")
        if started == StepRefusal.CANCELLED:
            self._state.cancel_requested = True
            raise JobCancelled(f"job {self.job_id} was cancelled before step {step_name}")
        assert isinstance(started, StepRecord)  # noqa: S101 - the refusals are handled above
        with tracer().start_as_current_span(
            f"step {step_name}",
            attributes={
                ATTR_JOB_ID: self.job_id,
                ATTR_JOB_KIND: self._state.job.kind,
                ATTR_STEP: step_name,
                ATTR_STEP_ATTEMPT: started.attempts,
            },
        ) as span:
            fault_point(f"step:{step_name}:before")
            context = StepContext(
                store=self._store,
                state=self._state,
                step_name=step_name,
                seq=seq,
                attempt=started.attempts,
            )
            try:
                result = await self._run(definition, context, arg)
            except LeaseLost:
                self._state.lease_lost = True
                raise  # a fenced write already changed nothing; write nothing more
            except JobCancelled as exc:
                await self._end(seq, step_name, error=ErrorInfo(exc.code, exc.message))
                raise
            except Exception as exc:
                fault = journal_fault_in(exc)
                if fault is not None:
                    # The journal could not record (a write or a read met it away): nothing
                    # more of this step is written; the run stops, and the job resumes from
                    # its last recorded step.
                    raise fault from None
                raise await self._failed(span, seq, step_name, exc) from exc
            encoded = definition.encode(result)
            fault_point(f"step:{step_name}:after")
        # The result is journaled with the next step's start (or by settle()): one commit
        # per step. Until then a crash runs this step again, as a crash before its end did.
        self._ended = EndedStep(
            seq=seq, name=step_name, output_json=encoded, reset_recoveries=self._reset_pending
        )
        # Return what a replay would return, so a resumed run sees identical values.
        return definition.decode(encoded)

    async def settle(self) -> None:
        """Journal the result of the last step that succeeded, if it is not yet (the
        workflow body returned or raised after it): before the job's outcome is.

        Raises:
            LeaseLost: ``lease_lost`` when the write was fenced off.
            SbproxyError: the journal's own failure (as :meth:`step`).
        """
        ended, self._ended = self._ended, None
        if ended is None:
            return
        await self._end(ended.seq, ended.name, output_json=ended.output_json)
        fault_point(f"step:{ended.name}:committed")

    async def _failed(
        self, span: trace.Span, seq: int, step_name: str, exc: Exception
    ) -> StepFailed:
        """Journal the step's failure ``exc``; the :class:`StepFailed` the workflow sees, with
        the step's reason code (``internal`` for a crash)."""
        if isinstance(exc, SbproxyError):
            span.set_status(trace.StatusCode.ERROR, exc.code)
            # The step's record says what happened; the advice (remediation) goes with the
            # job's error only, so a reader following the job meets it once.
            await self._end(seq, step_name, error=ErrorInfo(exc.code, exc.message))
            return StepFailed(f"step {step_name} failed: {exc}", code=exc.code, retryable=False)
        span.set_status(trace.StatusCode.ERROR, "internal")
        message = f"{type(exc).__name__}: {exc}"
        await self._end(seq, step_name, error=ErrorInfo("internal", message))
        return StepFailed(f"step {step_name} crashed: {message}", code="internal", retryable=False)

    async def _end(
        self,
        seq: int,
        step_name: str,
        *,
        output_json: str | None = None,
        error: ErrorInfo | None = None,
    ) -> None:
        """Journal the step's outcome under this run's claim.

        Raises:
            LeaseLost: ``lease_lost`` when the write was fenced off (another run holds the
                job now and its record of this step stands).
        """
        written = await self._store.end_step(
            self.job_id,
            owner=self._state.owner,
            attempt=self._state.attempt,
            seq=seq,
            name=step_name,
            output_json=output_json,
            error=error,
        )
        if not written:
            raise self._state.lose_lease(f"end of step {step_name}")

    async def _run(self, definition: StepDef[A, R], context: StepContext, arg: A) -> R:
        policy = definition.retry
        if policy.max_attempts <= 1:
            # One attempt, nothing to retry: what tenacity would do (run it once, raise its
            # error as is), without the ~30 us its machinery costs on every step.
            context.check_cancelled()
            return await definition.fn(context, arg)

        async def announce(state: RetryCallState) -> None:
            await self._announce_retry(context, state, max_attempts=policy.max_attempts)

        retrying = AsyncRetrying(
            retry=retry_if_exception(_is_retryable),
            stop=stop_after_attempt(policy.max_attempts),
            wait=wait_random_exponential(multiplier=policy.initial_delay_s, max=policy.max_delay_s),
            before_sleep=announce,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                context.check_cancelled()
                return await definition.fn(context, arg)
        raise AssertionError("unreachable")  # pragma: no cover - tenacity reraises

    async def _announce_retry(
        self, context: StepContext, state: RetryCallState, *, max_attempts: int
    ) -> None:
        """Journal a ``retry`` event before the step's next attempt, so that a reader of the
        job sees the step is retrying, and why, instead of a silent wait.

        The event: ``{"step", "attempt"`` (the attempt about to run, from 2)``,
        "max_attempts", "delay_s"`` (seconds until it starts)``, "error": {"code",
        "message"}}``; the message is the failed attempt's, without its advice and cut to
        :data:`RETRY_MESSAGE_CHARS`. Not fenced: a note, never a decision.
        """
        failure = state.outcome.exception() if state.outcome is not None else None
        if not isinstance(failure, SbproxyError):
            return
        delay_s = round(state.upcoming_sleep, 3)
        attempt = state.attempt_number + 1
        logger.info(
            "job %s: step %s failed (%s); attempt %d/%d in %.1f s",
            self.job_id,
            context.step_name,
            failure.code,
            attempt,
            max_attempts,
            delay_s,
        )
        await self._store.record_event(
            self.job_id,
            kind="retry",
            data={
                "step": context.step_name,
                "attempt": attempt,
                "max_attempts": max_attempts,
                "delay_s": delay_s,
                "error": {
                    "code": failure.code,
                    "message": failure.message[:RETRY_MESSAGE_CHARS],
                },
            },
        )
