"""Declaring workflows and steps.

A **step** is an async function ``(ctx: StepContext, arg) -> result`` with a stable name, one
argument and a JSON-serialisable result (a pydantic model, or plain JSON types). Its result
is journaled; on replay the recorded result is returned instead of running it again. Its
docstring has an ``Idempotency:`` paragraph saying why running it twice is safe (a step
that was running when the process died runs again).

A **workflow** is an async function ``(ctx: WorkflowContext, input) -> result`` whose body is
deterministic: every side effect happens inside a step. It is registered under a kind name
and a version in a :class:`Registry`.
"""

from __future__ import annotations

import importlib
import inspect
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pydantic import BaseModel, TypeAdapter

if TYPE_CHECKING:
    from sbproxy.workflows.context import StepContext, WorkflowContext

__all__ = ["Registry", "RetryPolicy", "StepDef", "WorkflowDef", "step"]

A = TypeVar("A")
R = TypeVar("R")
I = TypeVar("I", bound=BaseModel)  # noqa: E741 - conventional type-variable name


@dataclass(frozen=True)
class RetryPolicy:
    """How a step retries errors marked ``retryable`` (network, 5xx, timeouts).

    Delays grow exponentially from ``initial_delay_s`` up to ``max_delay_s`` with full jitter
    (tenacity's ``wait_random_exponential``); after ``max_attempts`` runs the last error fails
    the job. Permanent errors (``retryable=False``) fail at once.
    """

    max_attempts: int = 3
    initial_delay_s: float = 0.5
    max_delay_s: float = 30.0


NO_RETRY = RetryPolicy(max_attempts=1)


def _return_adapter(fn: Callable[..., Any]) -> TypeAdapter[Any]:
    hints = typing.get_type_hints(fn)
    return TypeAdapter(hints.get("return", Any))


@dataclass(frozen=True)
class StepDef(Generic[A, R]):
    """A declared step: name, function, retry policy, and the adapter of its result.

    ``observe``, when set, marks a step whose output names live state (a process, a port):
    on replay the recorded output is returned only if ``observe(ctx, output)`` says it still
    holds; otherwise the step runs again, as a new attempt.
    """

    name: str
    fn: Callable[[StepContext, A], Awaitable[R]]
    retry: RetryPolicy
    result: TypeAdapter[R] = field(compare=False)
    observe: Callable[[StepContext, R], Awaitable[bool]] | None = field(default=None, compare=False)

    def encode(self, value: R) -> str:
        """The journal text of a result."""
        return self.result.dump_json(value).decode()

    def decode(self, recorded: str) -> R:
        """A result back from the journal."""
        return self.result.validate_json(recorded)


def step(
    name: str,
    *,
    retry: RetryPolicy = NO_RETRY,
    observe: Callable[[StepContext, Any], Awaitable[bool]] | None = None,
) -> Callable[[Callable[[StepContext, A], Awaitable[R]]], StepDef[A, R]]:
    """Declare a step under a stable ``name`` (the journal records it; never rename one).

    Args:
        name: The journal name.
        retry: How retryable errors are retried inside the step.
        observe: For a step whose output describes live state rather than a durable fact:
            ``observe(ctx, recorded_output) -> bool`` is asked on every replay, and a
            ``False`` runs the step again (see :class:`StepDef`).
    """

    def wrap(fn: Callable[[StepContext, A], Awaitable[R]]) -> StepDef[A, R]:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"step {name!r} must be an async function")
        return StepDef(name=name, fn=fn, retry=retry, result=_return_adapter(fn), observe=observe)

    return wrap


@dataclass(frozen=True)
class WorkflowDef(Generic[I, R]):
    """A registered workflow kind."""

    kind: str
    version: int
    fn: Callable[[WorkflowContext, I], Awaitable[R]]
    input_type: type[I]
    result: TypeAdapter[R] = field(compare=False)


class Registry:
    """The workflow kinds a worker can run."""

    def __init__(self) -> None:
        self._workflows: dict[str, WorkflowDef[Any, Any]] = {}
        self._deferred: dict[str, str] = {}

    def defer(self, kind: str, module: str) -> None:
        """Know ``kind`` before its module is imported: the first :meth:`get` of ``kind``
        imports ``module`` (``"package.module"``), which must register it.

        A process that never runs such a job (``sbproxy models pull`` and engine builds)
        then never pays for importing it.
        """
        if kind not in self._workflows:
            self._deferred[kind] = module

    def workflow(
        self, kind: str, *, version: int = 1
    ) -> Callable[[Callable[[WorkflowContext, I], Awaitable[R]]], WorkflowDef[I, R]]:
        """Register a workflow function under ``kind``; bump ``version`` when its step
        sequence changes (jobs journaled by another version are parked, not re-run)."""

        def wrap(fn: Callable[[WorkflowContext, I], Awaitable[R]]) -> WorkflowDef[I, R]:
            if kind in self._workflows:
                raise ValueError(f"workflow kind {kind!r} is already registered")
            hints = typing.get_type_hints(fn)
            params = list(inspect.signature(fn).parameters)
            if len(params) != 2:
                raise TypeError(f"workflow {kind!r} must take (ctx, input)")
            input_type = hints[params[1]]
            if not (isinstance(input_type, type) and issubclass(input_type, BaseModel)):
                raise TypeError(f"workflow {kind!r} input must be a pydantic model")
            definition: WorkflowDef[I, R] = WorkflowDef(
                kind=kind,
                version=version,
                fn=fn,
                input_type=typing.cast("type[I]", input_type),
                result=TypeAdapter(hints.get("return", Any)),
            )
            self._workflows[kind] = definition
            self._deferred.pop(kind, None)
            return definition

        return wrap

    def get(self, kind: str) -> WorkflowDef[Any, Any] | None:
        """The workflow registered as ``kind`` (importing its deferred module first)."""
        module = self._deferred.get(kind)
        if module is not None and kind not in self._workflows:
            importlib.import_module(module)
            self._deferred.pop(kind, None)
        return self._workflows.get(kind)

    def kinds(self) -> tuple[str, ...]:
        """Every registered kind, deferred ones included."""
        return (*self._workflows, *(k for k in self._deferred if k not in self._workflows))
