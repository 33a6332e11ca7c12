"""``sbproxy jobs``: real CLI processes reading a real SQLite journal that other processes write.

Jobs are run by ``python -m tests.cli.jobflows`` in their own process; ``sbproxy jobs ...``
runs as a second process (or in-process through click's runner where only the output matters).
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from click.testing import CliRunner, Result
from ulid import ULID

from sbproxy.cli import jobs_control_cmd
from sbproxy.cli.main import cli
from tests.cli import jobflows

ROOT = Path(__file__).resolve().parents[2]
SBPROXY = Path(sys.executable).parent / "sbproxy"
TIMEOUT_S = 30
CONTROL_BYTES = re.compile(r"[\x1b\r]")


def clean_env() -> dict[str, str]:
    """This environment without anything that would pick another journal or kill a process."""
    dropped = {"SB_CONFIG_FILE", "SBPROXY_CACHE_DIR", "SBPROXY_FAULT_POINTS"}
    return {key: value for key, value in os.environ.items() if key not in dropped}


class Cache:
    """One cache root: run flows against its journal and `sbproxy jobs` verbs over it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.journal = root / "jobs" / "journal.db"
        self.workdir = root / "work"
        self.workdir.mkdir(parents=True, exist_ok=True)

    def flow_command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "tests.cli.jobflows", str(self.journal), *args]

    def flow(self, *args: str, env: dict[str, str] | None = None) -> str:
        """Run a jobflows action to its end; the id of the job it submitted or resumed."""
        done = subprocess.run(
            self.flow_command(*args),
            cwd=ROOT,
            env=env or clean_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        if args[0] == "resume":
            return args[1]
        return job_id_of(done.stdout.splitlines()[0])

    def run(self, kind: str) -> str:
        return self.flow("run", kind, str(self.workdir))

    def submit(self, kind: str, key: str | None = None) -> str:
        return self.flow("submit", kind, str(self.workdir), *([key] if key else []))

    def jobs(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``sbproxy jobs ARGS --cache-dir ROOT`` as a separate process."""
        return subprocess.run(
            [str(SBPROXY), "jobs", *args, "--cache-dir", str(self.root)],
            cwd=ROOT,
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )

    def invoke(self, *args: str) -> Result:
        """The same verb in this process (faster; same code path below click)."""
        return CliRunner().invoke(
            cli,
            ["jobs", *args, "--cache-dir", str(self.root)],
            env={"SB_CONFIG_FILE": None, "SBPROXY_CACHE_DIR": None},
            catch_exceptions=False,
        )

    def effects(self) -> Counter[str]:
        return Counter((self.workdir / "effects").read_text().split())


def job_id_of(line: str) -> str:
    assert line.startswith("job "), line
    return line.split()[1]


def envelope(stdout: str, command: str) -> dict[str, Any]:
    """Parse a JSON result and check the conventions every JSON output follows."""
    assert not CONTROL_BYTES.search(stdout), repr(stdout)
    payload: dict[str, Any] = json.loads(stdout)
    assert payload["schema_version"] == 1
    assert payload["command"] == command
    return payload


@pytest.fixture
def cache(tmp_path: Path) -> Cache:
    return Cache(tmp_path / "cache")


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> tuple[Cache, dict[str, str]]:
    """A journal other tests only read: one job succeeded, one failed, one still queued."""
    shared = Cache(tmp_path_factory.mktemp("history") / "cache")
    ids = {
        "succeeded": shared.run("slow-download"),
        "failed": shared.run("flaky"),
        "queued": shared.submit("flaky"),
    }
    return shared, ids


def lines_of(stream: IO[str]) -> queue.Queue[str | None]:
    """Read ``stream`` line by line on a thread; ``None`` marks its end."""
    found: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in stream:
            found.put(line.rstrip("\n"))
        found.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return found


def drain(found: queue.Queue[str | None]) -> Iterator[str]:
    while (line := found.get(timeout=TIMEOUT_S)) is not None:
        yield line


# --- watch ----------------------------------------------------------------------------------


def popen(command: list[str], *, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=env or clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_watch_shows_live_progress_of_a_job_run_by_another_process(cache: Cache) -> None:
    (cache.workdir / "use-gate").touch()
    with popen(cache.flow_command("run", "slow-download", str(cache.workdir))) as runner:
        assert runner.stdout is not None
        job_id = job_id_of(runner.stdout.readline())
        watch_command = ["watch", job_id, "--cache-dir", str(cache.root), "--format", "json"]
        with popen([str(SBPROXY), "jobs", *watch_command]) as watch:
            try:
                assert watch.stderr is not None and watch.stdout is not None
                stderr = lines_of(watch.stderr)
                first = stderr.get(timeout=TIMEOUT_S)  # the watcher follows the journal now
                assert first is not None and first.startswith(job_id), first
                (cache.workdir / "gate").touch()  # only now does the download start
                rest = list(drain(stderr))
                stdout = watch.stdout.read()
                assert watch.wait(timeout=TIMEOUT_S) == 0, rest
                assert runner.wait(timeout=TIMEOUT_S) == 0
            finally:
                watch.kill()
                runner.kill()

    progress = [
        line
        for line in rest
        if re.fullmatch(
            rf"{job_id}: running step download:model\.gguf "
            r"\d+\.\d MiB / 241\.4 MiB \(\d+%\)",
            line,
        )
    ]
    assert len(progress) >= 3, rest  # several live reports, not one summary
    assert progress[-1].endswith("241.4 MiB / 241.4 MiB (100%)")
    assert f"{job_id}: step publish succeeded" in rest
    assert rest[-1] == f"{job_id}: succeeded"
    job = envelope(stdout, "jobs.watch")["job"]
    assert job["id"] == job_id
    assert job["status"] == "succeeded"
    assert job["output"]["size_bytes"] == jobflows.DOWNLOAD_BYTES


def test_watch_keeps_following_when_the_runner_dies_and_another_process_resumes(
    cache: Cache,
) -> None:
    (cache.workdir / "use-gate").touch()
    doomed = {**clean_env(), "SBPROXY_FAULT_POINTS": "step:publish:before"}
    with popen(
        cache.flow_command("run", "slow-download", str(cache.workdir)), env=doomed
    ) as runner:
        assert runner.stdout is not None
        job_id = job_id_of(runner.stdout.readline())
        with popen(
            [str(SBPROXY), "jobs", "watch", job_id, "--cache-dir", str(cache.root)]
        ) as watch:
            try:
                assert watch.stderr is not None and watch.stdout is not None
                stderr = lines_of(watch.stderr)
                assert stderr.get(timeout=TIMEOUT_S) is not None
                (cache.workdir / "gate").touch()
                assert runner.wait(timeout=TIMEOUT_S) == -signal.SIGKILL
                cache.flow("resume", job_id)  # a new process recovers the dead owner's job
                rest = list(drain(stderr))
                stdout = watch.stdout.read()
                assert watch.wait(timeout=TIMEOUT_S) == 0, rest
            finally:
                watch.kill()
                runner.kill()
    assert f"{job_id}: queued (owner_gone)" in rest
    assert rest.count(f"{job_id}: step publish started") == 2
    assert stdout.startswith(f"{job_id}: succeeded")


def test_watch_exits_nonzero_with_the_failed_job_on_stdout(cache: Cache) -> None:
    job_id = cache.run("flaky")
    watched = cache.jobs("watch", job_id, "--format", "json")
    assert watched.returncode == 1
    job = envelope(watched.stdout, "jobs.watch")["job"]
    assert job["status"] == "failed"
    assert job["error"]["code"] == "flaky_first_run"
    assert f"{job_id}: step flaky failed: flaky_first_run" in watched.stderr

    text = cache.invoke("watch", job_id)
    assert text.exit_code == 1
    assert text.stdout.startswith(f"{job_id}: failed in ")


# --- list and show --------------------------------------------------------------------------


def test_list_prints_every_job_newest_first_in_a_json_envelope(
    history: tuple[Cache, dict[str, str]],
) -> None:
    shared, ids = history
    listed = shared.jobs("list", "--format", "json")
    assert listed.returncode == 0, listed.stderr
    payload = envelope(listed.stdout, "jobs.list")
    assert payload["journal"] == str(shared.journal)
    jobs = payload["jobs"]
    assert [job["id"] for job in jobs] == [ids["queued"], ids["failed"], ids["succeeded"]]
    assert [job["status"] for job in jobs] == ["queued", "failed", "succeeded"]
    assert {job["kind"] for job in jobs} == {"flaky", "slow-download"}


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        (["--state", "failed"], ["failed"]),
        (["--state", "failed", "--state", "queued"], ["queued", "failed"]),
        (["--state", "parked"], []),
        (["--kind", "slow-download"], ["succeeded"]),
        (["--kind", "flaky", "--state", "succeeded"], []),
        (["--limit", "1"], ["queued"]),
    ],
)
def test_list_filters_by_state_kind_and_limit(
    history: tuple[Cache, dict[str, str]], filters: list[str], expected: list[str]
) -> None:
    shared, ids = history
    result = shared.invoke("list", *filters, "--format", "json")
    assert result.exit_code == 0, result.stderr
    listed = [job["id"] for job in envelope(result.stdout, "jobs.list")["jobs"]]
    assert listed == [ids[name] for name in expected]


def test_list_text_is_an_aligned_table_with_an_empty_state_line(
    history: tuple[Cache, dict[str, str]],
) -> None:
    shared, ids = history
    lines = shared.invoke("list").stdout.splitlines()
    assert lines[0].split() == [
        "ID",
        "KIND",
        "STATUS",
        "ATTEMPT",
        "PROGRESS",
        "SUBJECT",
        "CREATED",
    ]
    status_column = lines[0].index("STATUS")
    assert [line[status_column:].split()[0] for line in lines[1:]] == [
        "queued",
        "failed",
        "succeeded",
    ]
    assert lines[1].startswith(ids["queued"])
    assert re.search(r"(just now|\d+[sm] ago)$", lines[1])

    empty = shared.invoke("list", "--state", "parked")
    assert empty.exit_code == 0
    assert empty.stdout.strip() == f"no jobs with state parked in {shared.journal}"


def test_show_gives_the_job_its_steps_and_the_last_error(
    history: tuple[Cache, dict[str, str]],
) -> None:
    shared, ids = history
    shown = shared.jobs("show", ids["failed"], "--format", "json")
    assert shown.returncode == 0, shown.stderr
    payload = envelope(shown.stdout, "jobs.show")
    assert payload["job"]["id"] == ids["failed"]
    assert payload["job"]["status"] == "failed"
    assert [(s["name"], s["status"]) for s in payload["steps"]] == [
        ("prepare", "succeeded"),
        ("flaky", "failed"),
    ]
    assert payload["last_error"]["code"] == "flaky_first_run"

    text = shared.invoke("show", ids["failed"]).stdout
    assert text.startswith(f"{ids['failed']}  flaky v1  failed (attempt 1)")
    assert "error      flaky_first_run: step flaky failed" in text
    assert re.search(r"^\s+1\s+flaky\s+failed\s+1\s+", text, re.MULTILINE)


def test_list_and_show_read_the_cache_root_named_by_the_config_file(
    history: tuple[Cache, dict[str, str]], tmp_path: Path
) -> None:
    shared, ids = history
    config = tmp_path / "sb.yml"
    config.write_text(f"proxy:\n  model_host:\n    cache:\n      directory: {shared.root}\n")
    listed = CliRunner().invoke(
        cli, ["jobs", "list", "-f", str(config), "--format", "json"], catch_exceptions=False
    )
    assert listed.exit_code == 0, listed.stderr
    assert len(envelope(listed.stdout, "jobs.list")["jobs"]) == 3

    from_env = CliRunner().invoke(
        cli, ["jobs", "show", ids["succeeded"]], env={"SB_CONFIG_FILE": str(config)}
    )
    assert from_env.exit_code == 0, from_env.stderr

    config.write_text("proxy:\n  model_host:\n    cache:\n      directory: relative/models\n")
    invalid = CliRunner().invoke(cli, ["jobs", "list", "-f", str(config)])
    assert invalid.exit_code == 2
    assert "proxy.model_host.cache.directory" in invalid.stderr


# --- cancel and retry -----------------------------------------------------------------------


def test_cancel_of_a_queued_job_cancels_it_at_once(cache: Cache) -> None:
    job_id = cache.submit("flaky")
    cancelled = cache.jobs("cancel", job_id, "--format", "json")
    assert cancelled.returncode == 0, cancelled.stderr
    assert envelope(cancelled.stdout, "jobs.cancel")["job"]["status"] == "cancelled"

    again = cache.invoke("cancel", job_id)
    assert again.exit_code == 0
    assert again.stdout.strip() == f"{job_id}: already cancelled; nothing to cancel"

    watched = cache.invoke("watch", job_id, "--format", "json")
    assert watched.exit_code == 1
    assert envelope(watched.stdout, "jobs.watch")["job"]["status"] == "cancelled"
    assert not (cache.workdir / "effects").exists()  # it never ran


def test_cancel_of_a_running_job_stops_it_at_the_next_step_boundary(cache: Cache) -> None:
    (cache.workdir / "use-gate").touch()
    with popen(cache.flow_command("run", "slow-download", str(cache.workdir))) as runner:
        try:
            assert runner.stdout is not None
            job_id = job_id_of(runner.stdout.readline())
            requested = cache.jobs("cancel", job_id, "--format", "json")
            assert requested.returncode == 0, requested.stderr
            job = envelope(requested.stdout, "jobs.cancel")["job"]
            assert (job["status"], job["cancel_requested"]) in {
                ("running", True),
                ("cancelled", True),  # cancelled before the runner claimed it
            }
            (cache.workdir / "gate").touch()
            assert runner.wait(timeout=TIMEOUT_S) == 0
        finally:
            runner.kill()
    watched = cache.jobs("watch", job_id)
    assert watched.returncode == 1
    assert watched.stdout.startswith(f"{job_id}: cancelled")
    assert "download:model.gguf started" not in watched.stderr


def test_retry_requeues_a_failed_job_that_resumes_after_its_last_completed_step(
    cache: Cache,
) -> None:
    job_id = cache.run("flaky")
    retried = cache.jobs("retry", job_id, "--format", "json")
    assert retried.returncode == 0, retried.stderr
    payload = envelope(retried.stdout, "jobs.retry")
    assert payload["job"]["status"] == "queued"
    assert payload["ran_here"] is False  # this CLI has no "flaky" workflow: a worker runs it

    cache.flow("resume", job_id)
    shown = envelope(cache.jobs("show", job_id, "--format", "json").stdout, "jobs.show")
    assert shown["job"]["status"] == "succeeded"
    assert shown["job"]["output"] == ["prepared", "fixed", "finished"]
    assert [(s["name"], s["attempts"]) for s in shown["steps"]] == [
        ("prepare", 1),
        ("flaky", 2),
        ("finish", 1),
    ]
    assert cache.effects() == Counter({"prepare": 1, "flaky": 2, "finish": 1})


def test_retry_runs_a_workflow_this_process_knows_and_exits_with_its_outcome(
    cache: Cache, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = cache.run("flaky")
    monkeypatch.setattr(jobs_control_cmd, "registry", jobflows.registry)
    result = cache.invoke("retry", job_id)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith(f"{job_id}: succeeded")
    stderr = result.stderr.splitlines()
    assert stderr[0] == f"{job_id}: queued (retry)"
    assert f"{job_id}: step flaky succeeded" in stderr
    assert not any("step prepare" in line for line in stderr)  # replayed, not re-run
    assert cache.effects() == Counter({"prepare": 1, "flaky": 2, "finish": 1})


def test_retry_detach_only_queues_even_a_known_workflow(
    cache: Cache, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = cache.run("flaky")
    monkeypatch.setattr(jobs_control_cmd, "registry", jobflows.registry)
    result = cache.invoke("retry", job_id, "--detach")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith(f"{job_id}: queued; no `sbproxy serve` runs on this cache")
    assert "after step prepare" in result.stdout
    assert cache.effects() == Counter({"prepare": 1, "flaky": 1})


def test_retry_refuses_a_finished_job_and_answers_the_state_of_an_unfinished_one(
    history: tuple[Cache, dict[str, str]],
) -> None:
    shared, ids = history
    refused = shared.jobs("retry", ids["succeeded"])
    assert refused.returncode == 2
    assert f"job {ids['succeeded']} is succeeded; only failed or parked" in refused.stderr
    # Already queued: not an error; the job is left as it is and its state said.
    for flags in ((), ("--detach",)):
        queued = shared.invoke("retry", ids["queued"], *flags, "--format", "json")
        assert queued.exit_code == 0, queued.stderr
        payload = envelope(queued.stdout, "jobs.retry")
        assert (payload["job"]["status"], payload["ran_here"]) == ("queued", False)
        assert payload["serving_pid"] is None
        text = shared.invoke("retry", ids["queued"], *flags)
        assert text.stdout.startswith(f"{ids['queued']}: queued; no `sbproxy serve` runs")


def test_retry_names_the_newer_job_that_holds_the_idempotency_key(cache: Cache) -> None:
    failed = cache.flow("run", "flaky", str(cache.workdir), "same-key")
    newer = cache.submit("flaky", key="same-key")
    refused = cache.invoke("retry", failed)
    assert refused.exit_code == 2
    assert f"held by the unfinished job {newer}" in refused.stderr


# --- bad ids and missing journals -----------------------------------------------------------


@pytest.mark.parametrize("verb", ["show", "watch", "cancel", "retry"])
def test_malformed_and_unknown_ids_exit_2(history: tuple[Cache, dict[str, str]], verb: str) -> None:
    shared, _ids = history
    malformed = shared.invoke(verb, "not-a-ulid")
    assert malformed.exit_code == 2
    assert "'not-a-ulid' is not a job id (expected a ULID)" in malformed.stderr

    unknown = str(ULID())
    missing = shared.invoke(verb, unknown, "--format", "json")
    assert missing.exit_code == 2
    error = envelope(missing.stdout, f"jobs.{verb}")["error"]
    assert error["code"] == "job_not_found"
    assert f"no job {unknown}" in missing.stderr


def test_malformed_id_exits_2_from_a_real_process(history: tuple[Cache, dict[str, str]]) -> None:
    shared, ids = history
    result = shared.jobs("show", ids["failed"][:-1])
    assert result.returncode == 2
    assert "is not a job id (expected a ULID)" in result.stderr
    assert result.stdout == ""


def test_a_lower_case_id_names_the_same_job(history: tuple[Cache, dict[str, str]]) -> None:
    shared, ids = history
    result = shared.invoke("show", ids["failed"].lower(), "--format", "json")
    assert result.exit_code == 0
    assert envelope(result.stdout, "jobs.show")["job"]["id"] == ids["failed"]


def test_missing_journal_lists_nothing_and_refuses_ids_without_creating_it(
    cache: Cache,
) -> None:
    listed = cache.jobs("list", "--format", "json")
    assert listed.returncode == 0, listed.stderr
    assert envelope(listed.stdout, "jobs.list")["jobs"] == []
    assert cache.invoke("list").stdout.startswith("no jobs in ")
    for verb in ("show", "watch", "cancel", "retry"):
        refused = cache.invoke(verb, str(ULID()))
        assert refused.exit_code == 2, verb
        assert (
            f"no job journal at {cache.journal}; nothing has run with this cache directory"
            in refused.stderr
        )
    assert not cache.journal.exists()
    assert not cache.journal.parent.exists()
