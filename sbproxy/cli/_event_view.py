"""Following a job's events on stderr: plain lines, or a rich progress bar on a terminal.

``jobs watch`` and an in-process ``jobs retry`` feed every :class:`EventRecord` of one job to a
view. Events written before the watch began (the backlog) are replayed so the reader sees how
the job got where it is, but their progress reports are collapsed to the latest one per step:
a long download would otherwise replay thousands of lines. Nothing here writes to stdout, so
JSON output there stays clean whichever view is used.

One failure is told once: a step's retries are one short line each (the error the first time,
``same error`` after), a step's failure names its error without the advice, and a failed
job's status line gives only its code, since every verb that follows a job ends with the
job's outcome -- the error with its advice -- on the line after.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TextIO

import click

from sbproxy.cli._job_text import progress_text, size_text
from sbproxy.store import EventRecord

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import TaskID

__all__ = ["EventView", "LineView", "RichView", "open_view"]


def _pull_line(kind: str, data: Mapping[str, Any]) -> str | None:
    """A pull's ``source`` event (a file, and where its bytes came from: a fleet member or
    the upstream) or ``peer_failed`` event in words; ``None`` for any other kind."""
    path = data.get("path", "?")
    if kind == "source":
        resumed = int(data.get("resumed_from") or 0)
        tail = f", resumed from byte {resumed}" if resumed else ""
        size = size_text(int(data.get("bytes") or 0))
        return f"{path}: {size} from {data.get('source', '?')}{tail}"
    if kind == "peer_failed":
        return (
            f"{path}: peer {data.get('node', '?')} did not deliver it "
            f"({data.get('code', '?')}: {data.get('error', '')}); next source"
        )
    return None


def _error_text(data: Mapping[str, Any], *, code_only: bool = False) -> str:
    error = data.get("error")
    if not isinstance(error, Mapping):
        return ""
    if code_only:
        return f": {error.get('code', 'error')}"
    return f": {error.get('code', 'error')}: {error.get('message', '')}"


class EventView(ABC):
    """Turns one job's events into human lines; subclasses decide where they go.

    Args:
        job_id: The job being followed (prefix of every line).
        live_from_ms: Events written before this time are backlog (progress collapsed).
    """

    def __init__(self, job_id: str, *, live_from_ms: int) -> None:
        self.job_id = job_id
        self._live_from_ms = live_from_ms
        self._step_names: dict[int, str] = {}
        self._pending: dict[str, EventRecord] = {}
        # Step name -> (the attempt its last retry announced, the error that retry quoted).
        self._retries: dict[str, tuple[object, str]] = {}

    def show(self, event: EventRecord) -> None:
        """Render one event (backlog progress is held until something else happens)."""
        if event.type == "progress" and event.at_ms < self._live_from_ms:
            self._pending[str(event.data.get("step", ""))] = event
            return
        self._flush()
        self._render(event)

    def close(self) -> None:
        """Render whatever is still held and release the output."""
        self._flush()

    def _flush(self) -> None:
        pending, self._pending = self._pending, {}
        for event in pending.values():
            self._render(event)

    def _render(self, event: EventRecord) -> None:
        data = event.data
        if event.type == "progress":
            self.progress(data)
        elif event.type == "step":
            self.step(data)
        else:
            self.line(self.describe(event))

    def describe(self, event: EventRecord) -> str:
        """The line for a status change or any other non-progress, non-step event."""
        data = event.data
        if event.type == "status":
            status = str(data.get("status", "?"))
            reason = data.get("reason")
            detail = f" ({reason})" if reason else ""
            # The job's error (with its advice) is the outcome line every verb ends with.
            return f"{self.job_id}: {status}{detail}{_error_text(data, code_only=True)}"
        if event.type == "cancel_requested":
            return f"{self.job_id}: cancellation requested; stopping at the next check"
        if event.type == "retry":
            return self.retry_line(data)
        if event.type == "discarded":
            return (
                f"{self.job_id}: discarded: its owner {data.get('owner', '?')} is gone; "
                f"cancelled by the removal job {data.get('by_job', '?')}"
            )
        pulled = _pull_line(event.type, data)
        if pulled is not None:
            return f"{self.job_id}: {pulled}"
        extra = " ".join(f"{key}={value}" for key, value in sorted(data.items()))
        return f"{self.job_id}: {event.type} {extra}".rstrip()

    def step_line(self, data: Mapping[str, Any]) -> str:
        """The line for a step start or end (end events carry only the step's position)."""
        seq = int(data.get("seq", -1))
        name = data.get("name")
        if isinstance(name, str):
            self._step_names[seq] = name
        label = self._step_names.get(seq, f"#{seq}")
        status = str(data.get("status", "?"))
        verb = "started" if status == "running" else status
        error = _error_text(data)
        retried = self._retries.pop(label, None) if status != "running" else None
        if retried is not None and error:
            attempts, quoted = retried
            verb += f" after {attempts} attempts"
            # The retry lines quoted this error already (a retry quotes a bounded prefix).
            if error.removeprefix(": ").startswith(quoted):
                error = ": same error"
        return f"{self.job_id}: step {label} {verb}{error}"

    def retry_line(self, data: Mapping[str, Any]) -> str:
        """``<id>: step fetch:x retry 2/6 in 0.4 s: transport: cannot reach …``; a retry
        for the same error as the step's previous one says ``same error``."""
        step_name = str(data.get("step", "?"))
        said = _error_text(data).removeprefix(": ") or "error"
        before = self._retries.get(step_name)
        why = "same error" if before is not None and before[1] == said else said
        self._retries[step_name] = (data.get("attempt", "?"), said)
        delay = data.get("delay_s")
        when = f" in {delay:.1f} s" if isinstance(delay, int | float) else ""
        attempt = f"{data.get('attempt', '?')}/{data.get('max_attempts', '?')}"
        return f"{self.job_id}: step {step_name} retry {attempt}{when}: {why}"

    def progress_line(self, data: Mapping[str, Any]) -> str:
        """``<id>: running step <name> 120.0 MiB / 241.4 MiB (49%)``."""
        return f"{self.job_id}: running step {data.get('step', '?')} {progress_text(data)}"

    # -- output, per view ------------------------------------------------------------------

    @abstractmethod
    def line(self, text: str) -> None:
        """Write one line."""

    def step(self, data: Mapping[str, Any]) -> None:
        """A step started or ended."""
        self.line(self.step_line(data))

    def progress(self, data: Mapping[str, Any]) -> None:
        """A step reported progress."""
        self.line(self.progress_line(data))


class LineView(EventView):
    """One plain line per event on a stream (stderr when it is a pipe or a file)."""

    def __init__(self, job_id: str, *, live_from_ms: int, stream: TextIO | None = None) -> None:
        super().__init__(job_id, live_from_ms=live_from_ms)
        self._stream = stream
        self._last_progress: dict[str, str] = {}

    def line(self, text: str) -> None:
        """Write ``text`` and flush, so a reader of the pipe sees it at once."""
        click.echo(text, file=self._stream, err=self._stream is None)

    def progress(self, data: Mapping[str, Any]) -> None:
        """Write a progress line unless it reads exactly as the step's previous one (a build
        reports more often than its whole percent moves; a log gains nothing from repeats)."""
        text = self.progress_line(data)
        step_name = str(data.get("step", "?"))
        if self._last_progress.get(step_name) == text:
            return
        self._last_progress[step_name] = text
        self.line(text)


class RichView(EventView):
    """Status lines scroll above one live progress bar per running step (a terminal)."""

    def __init__(self, job_id: str, *, live_from_ms: int, console: Console) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        super().__init__(job_id, live_from_ms=live_from_ms)
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[amount]}"),
            TimeRemainingColumn(),
            console=console,
            transient=True,
            # Stdout carries the JSON result: the live display must never capture it.
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self._tasks: dict[str, TaskID] = {}
        self._progress.start()

    def line(self, text: str) -> None:
        """Print ``text`` above the bars."""
        self._progress.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def step(self, data: Mapping[str, Any]) -> None:
        """Print the step line; drop the step's bar once it has ended."""
        text = self.step_line(data)
        self.line(text)
        if data.get("status") != "running":
            name = self._step_names.get(int(data.get("seq", -1)))
            task = self._tasks.pop(name, None) if name is not None else None
            if task is not None:
                self._progress.remove_task(task)
                self._progress.refresh()

    def progress(self, data: Mapping[str, Any]) -> None:
        """Move (or create) the bar of the reporting step."""
        name = str(data.get("step", "?"))
        done = data.get("done")
        total = data.get("total")
        completed = int(done) if isinstance(done, int | float) else 0
        size = float(total) if isinstance(total, int | float) else None
        amount = progress_text(data)
        task = self._tasks.get(name)
        if task is None:
            self._tasks[name] = self._progress.add_task(
                name, total=size, completed=completed, amount=amount
            )
        else:
            self._progress.update(task, total=size, completed=completed, amount=amount)
        # Redraw now: the next status line may come sooner than the periodic refresh.
        self._progress.refresh()

    def close(self) -> None:
        """Stop the live display (its bars vanish; the status lines stay)."""
        super().close()
        self._progress.stop()


def open_view(job_id: str, *, live_from_ms: int) -> EventView:
    """A rich view when stderr is a terminal, plain lines otherwise."""
    if sys.stderr.isatty():
        from rich.console import Console  # rich only for a terminal: a pipe gets plain lines

        console = Console(stderr=True)
        if console.is_terminal and not console.is_dumb_terminal:
            return RichView(job_id, live_from_ms=live_from_ms, console=console)
    return LineView(job_id, live_from_ms=live_from_ms)
