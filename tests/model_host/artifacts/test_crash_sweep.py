"""Every CLI-driven artifact workflow, SIGKILLed at every point of every step, then rerun.

The durable artifact workflows are ``pull`` (run by ``sbproxy models pull`` and, with local
files, by ``sbproxy models import``), ``remove``, ``gc`` and ``prune``; ``models verify`` only
reads (it starts no job) and is one of the consistency checks here. Each workflow below lists
the steps a clean run journals (``test_the_sweep_lists_every_step_a_clean_run_journals``
keeps that list honest). For each step and each of its three fault points
(``step:<name>:before``, ``:after`` and ``:committed``, see ``sbproxy.workflows.faults``) a
case:

1. runs the verb as a real ``sbproxy`` process with that point armed, and checks that it died
   by SIGKILL with its job left ``running``;
2. runs the same verb again: the resume path the CLI offers (the idempotency key joins the
   dead owner's job, which this process recovers and finishes);
3. checks that the job finished under its original id on its second attempt and that no job
   is left unfinished; that the journal holds exactly the clean run's steps, the killed one
   begun twice unless its output had committed; that ``models verify --full`` passes on
   exactly the artifacts expected; that ``models prune --dry-run`` finds nothing leaked; that
   every blob which outlived the crash is the same file afterwards (nothing was fetched or
   copied twice); and, for pulls, that the mirror served each file once, in one request.

Artifacts are a few hundred KiB from a real local HTTP mirror (``HfMirror``); the caches that
``remove``, ``gc`` and ``prune`` start from are pulled once per module and copied per case.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sbproxy.catalog import load_catalog_file, variant_digest
from sbproxy.workflows.faults import ENV_VAR
from tests.catalog.builders import COMMIT, document, entry, variant, write
from tests.support.hf_server import HfMirror

ROOT = Path(__file__).resolve().parents[3]
SBPROXY = Path(sys.executable).parent / "sbproxy"
TIMEOUT_S = 60
GIB = 2**30
POINTS = ("before", "after", "committed")
DUO_REPO = "acme/duo"
TRIO_REPO = "acme/trio-GGUF"
DROPPED_ENV = {"SB_CONFIG_FILE", "SBPROXY_CACHE_DIR", ENV_VAR}


def payload(label: str, size: int) -> bytes:
    return hashlib.shake_256(label.encode()).digest(size)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# A two-file variant for pull and import; three one-file variants, pulled in this order (so
# least recently used first), for remove, gc and prune; and a blob nothing references.
DUO = {"config.json": b'{"layers": 2}\n', "model.safetensors": payload("duo", 128 * 1024)}
TRIO = {"old": payload("old", 40_000), "mid": payload("mid", 50_000), "new": payload("new", 60_000)}
ORPHAN = payload("orphan", 4096)


def file_entries(files: dict[str, bytes]) -> list[dict[str, Any]]:
    return [{"path": p, "sha256": sha256(d), "size_bytes": len(d)} for p, d in files.items()]


def catalog_doc() -> dict[str, Any]:
    models = {
        "duo": entry(
            variant("bf16", fmt="safetensors", source=f"hf:{DUO_REPO}", files=file_entries(DUO))
        )
    }
    for name, data in TRIO.items():
        models[name] = entry(
            variant("q4_k_m", source=f"hf:{TRIO_REPO}", files=file_entries({f"{name}.gguf": data}))
        )
    return document(models=models)


def serve(mirror: HfMirror) -> HfMirror:
    for path, data in DUO.items():
        mirror.add_file(DUO_REPO, COMMIT, path, data)
    for name, data in TRIO.items():
        mirror.add_file(TRIO_REPO, COMMIT, f"{name}.gguf", data)
    return mirror


@dataclass
class Site:
    """One case's directory: its cache root, the catalog, and the mirror that serves it."""

    root: Path
    mirror: HfMirror
    catalog: Path
    digests: dict[str, str]
    template: Path

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    def models(
        self, verb: str, *args: str, fault: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``sbproxy models VERB ARGS`` on this cache (and catalog), in JSON, as a process."""
        env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
        env = {k: v for k, v in env.items() if not k.startswith(("HF_", "HUGGING_FACE"))}
        env["HF_ENDPOINT"] = self.mirror.url
        if fault is not None:
            env[ENV_VAR] = fault
        catalog = () if verb == "prune" else ("--catalog-file", str(self.catalog))
        where = ("--cache-dir", str(self.cache), *catalog, "--format", "json")
        return subprocess.run(
            [str(SBPROXY), "models", verb, *args, *where],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )

    def result(self, verb: str, *args: str) -> dict[str, Any]:
        """The JSON result of a verb that must exit 0."""
        done = self.models(verb, *args)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "Traceback" not in done.stderr
        result: dict[str, Any] = json.loads(done.stdout)
        assert result["command"] == f"models.{verb}"
        return result

    def query(self, sql: str, *params: object) -> list[tuple[Any, ...]]:
        with closing(sqlite3.connect(self.cache / "jobs" / "journal.db")) as raw:
            return list(raw.execute(sql, params))

    def jobs(self, kind: str) -> list[tuple[Any, ...]]:
        """``(id, status, attempt)`` of every job of ``kind``."""
        return self.query("SELECT id, status, attempt FROM jobs WHERE kind = ? ORDER BY id", kind)

    def unfinished(self) -> list[tuple[Any, ...]]:
        """``(id, kind, status)`` of every job not succeeded, failed or cancelled."""
        return self.query(
            "SELECT id, kind, status FROM jobs "
            "WHERE status NOT IN ('succeeded', 'failed', 'cancelled')"
        )

    def steps(self, job_id: str) -> list[tuple[Any, ...]]:
        """``(name, status, attempts)`` of each journaled step of ``job_id``, in order."""
        return self.query(
            "SELECT name, status, attempts FROM steps WHERE job_id = ? ORDER BY seq", job_id
        )

    def progress(self, job_id: str) -> Counter[str]:
        """How many progress events of ``job_id`` name each file."""
        rows = self.query(
            "SELECT data_json FROM job_events WHERE job_id = ? AND type = 'progress'", job_id
        )
        return Counter(str(json.loads(data).get("current")) for (data,) in rows)

    def blobs(self) -> dict[str, tuple[int, int]]:
        """Stored blobs: sha256 -> (inode, mtime in ns), which a second fetch would change."""
        directory = self.cache / "blobs" / "sha256"
        if not directory.is_dir():
            return {}
        return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in directory.iterdir()}

    def snapshot(self, label: str) -> Path:
        return self.cache / "snapshots" / self.digests[label]

    def from_template(self, *, orphan: bool = False) -> None:
        """Start from the module's pulled cache (hard links kept), plus an orphan blob."""
        subprocess.run(["cp", "-a", str(self.template), str(self.cache)], check=True)
        if orphan:
            (self.cache / "blobs" / "sha256" / sha256(ORPHAN)).write_bytes(ORPHAN)


class Workflow:
    """One workflow as a CLI verb drives it: its steps, its start state, its end state."""

    name = ""
    kind = ""
    verb = ""
    steps: tuple[str, ...] = ()
    deleting: frozenset[str] = frozenset()  # steps whose output counts what they deleted

    def step_name(self, step: str, site: Site) -> str:
        """The journal name of a listed step (the list names artifacts by label)."""
        return step

    def prepare(self, site: Site) -> tuple[str, ...]:
        """Build the starting cache; the verb's arguments."""
        raise NotImplementedError

    def job_id(self, result: dict[str, Any]) -> str | None:
        return result["job_id"] if isinstance(result["job_id"], str) else None

    def published(self, site: Site) -> set[str]:
        """Digests that must be published and intact at the end."""
        raise NotImplementedError

    def blobs(self) -> set[str]:
        """SHA-256 names of exactly the blobs stored at the end."""
        raise NotImplementedError

    def check(self, site: Site, result: dict[str, Any], *, recounted: bool) -> None:
        """What the final result and the world must show besides the common checks.

        ``recounted``: the killed step deletes, and died after deleting but before its
        output was recorded; the rerun found the work done, so its output counts only what
        the rerun did (nothing). Every other case must report what a clean run reports.
        """


class Pull(Workflow):
    name = kind = verb = "pull"
    steps = ("plan", "fetch:config.json", "fetch:model.safetensors", "publish")

    def prepare(self, site: Site) -> tuple[str, ...]:
        return ("duo", "--variant", "bf16")

    def job_id(self, result: dict[str, Any]) -> str | None:
        (row,) = result["artifacts"]
        assert row["error"] is None, row
        return str(row["job_id"])

    def published(self, site: Site) -> set[str]:
        return {site.digests["duo"]}

    def blobs(self) -> set[str]:
        return {sha256(data) for data in DUO.values()}

    def check(self, site: Site, result: dict[str, Any], *, recounted: bool) -> None:
        (row,) = result["artifacts"]
        assert (row["verified_bytes"], row["cache_hit"]) == (sum(map(len, DUO.values())), False)
        for path, data in DUO.items():
            assert (site.snapshot("duo") / path).read_bytes() == data
        self.fetched_once(site, str(row["job_id"]))

    def fetched_once(self, site: Site, job_id: str) -> None:
        # Each file was downloaded once over both runs, whole, in one request: a step that
        # had fetched its file (even without recording that) was not fetched again.
        requests = site.mirror.requests
        assert sorted((r.method, r.file, r.status, r.range_start) for r in requests) == sorted(
            ("GET", path, 200, None) for path in DUO
        )
        for path, data in DUO.items():
            assert site.mirror.bytes_served(path) == len(data)


class Import(Pull):
    name = "import"
    verb = "import"

    def prepare(self, site: Site) -> tuple[str, ...]:
        checkout = site.root / "checkout"
        checkout.mkdir()
        for path, data in DUO.items():
            (checkout / path).write_bytes(data)
        return (str(checkout), "--model", "duo", "--variant", "bf16")

    def fetched_once(self, site: Site, job_id: str) -> None:
        for path, data in DUO.items():
            assert (site.root / "checkout" / path).read_bytes() == data  # copied, not moved
        assert site.mirror.requests == []  # an import never touches the network
        # A copy reports its file's progress once, when it is done: each file was copied
        # once over both runs (a second copy would be dropped for the same stored blob).
        assert site.progress(job_id) == Counter(list(DUO))


class Remove(Workflow):
    name = kind = verb = "remove"
    steps = ("delete",)
    deleting = frozenset({"delete"})

    def prepare(self, site: Site) -> tuple[str, ...]:
        site.from_template()
        return ("mid", "--variant", "q4_k_m")

    def published(self, site: Site) -> set[str]:
        return {site.digests["old"], site.digests["new"]}

    def blobs(self) -> set[str]:
        return {sha256(TRIO["old"]), sha256(TRIO["new"])}

    def check(self, site: Site, result: dict[str, Any], *, recounted: bool) -> None:
        assert result["artifact_digest"] == site.digests["mid"]
        if not recounted:
            assert (result["removed"], result["reclaimed_bytes"]) == (True, len(TRIO["mid"]))
        assert not site.snapshot("mid").exists()


class Gc(Workflow):
    name = kind = verb = "gc"
    steps = ("orphans", "plan", "delete:old", "delete:mid", "measure")
    # The report's freed bytes are measured (plan, measure); only the orphans are counted.
    deleting = frozenset({"orphans"})

    def step_name(self, step: str, site: Site) -> str:
        verb, _, label = step.partition(":")
        return f"{verb}:{site.digests[label]}" if label else step

    def prepare(self, site: Site) -> tuple[str, ...]:
        site.from_template(orphan=True)
        # Room for the newest only: the two least recently used go, oldest first.
        return ("--budget-gib", repr(len(TRIO["new"]) / GIB))

    def published(self, site: Site) -> set[str]:
        return {site.digests["new"]}

    def blobs(self) -> set[str]:
        return {sha256(TRIO["new"])}

    def check(self, site: Site, result: dict[str, Any], *, recounted: bool) -> None:
        if not recounted:
            before = sum(map(len, TRIO.values())) + len(ORPHAN)
            assert (result["before_bytes"], result["reclaimed_bytes"]) == (
                before,
                before - len(TRIO["new"]),
            )
        assert result["deleted_artifacts"] == [site.digests["old"], site.digests["mid"]]
        assert result["skipped_artifacts"] == {}
        assert result["after_bytes"] == len(TRIO["new"])
        assert result["budget_unsatisfied_bytes"] == 0


class Prune(Workflow):
    name = kind = verb = "prune"
    steps = ("orphans",)
    deleting = frozenset({"orphans"})

    def prepare(self, site: Site) -> tuple[str, ...]:
        site.from_template(orphan=True)
        return ()

    def published(self, site: Site) -> set[str]:
        return {site.digests[label] for label in TRIO}

    def blobs(self) -> set[str]:
        return {sha256(data) for data in TRIO.values()}

    def check(self, site: Site, result: dict[str, Any], *, recounted: bool) -> None:
        if not recounted:
            assert (result["orphan_blobs"], result["reclaimed_bytes"]) == (1, len(ORPHAN))
        assert result["abandoned_partials"] == 0


WORKFLOWS: dict[str, Workflow] = {w.name: w for w in (Pull(), Import(), Remove(), Gc(), Prune())}

# A `models remove` killed once its delete step has deleted (`after`, `committed`) leaves the
# artifact gone and its job `running`: the rerun finds the stale job before it looks the
# artifact up, and finishes it under its id (issue 14).
CASES = [
    pytest.param(name, step, point, id=f"{name}-{step}-{point}")
    for name, workflow in WORKFLOWS.items()
    for step in workflow.steps
    for point in POINTS
]


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(tmp_path_factory.mktemp("catalog") / "ops-catalog.yaml", catalog_doc())


@pytest.fixture(scope="module")
def digests(catalog: Path) -> dict[str, str]:
    """Artifact digest of each model's one variant, by the real catalog loader."""
    loaded = load_catalog_file(catalog)
    found = {}
    for model in ("duo", *TRIO):
        (pinned,) = loaded.entry(model).variants
        found[model] = variant_digest(
            catalog_revision=loaded.catalog_revision, logical_model=model, variant=pinned
        )
    return found


@pytest.fixture(scope="module")
def template(
    tmp_path_factory: pytest.TempPathFactory, catalog: Path, digests: dict[str, str]
) -> Iterator[Path]:
    """A cache with old, mid and new pulled in that order (least recently used first)."""
    root = tmp_path_factory.mktemp("template")
    with serve(HfMirror()) as mirror:
        site = Site(root, mirror, catalog, digests, template=root / "unused")
        for label in TRIO:
            site.result("pull", label, "--variant", "q4_k_m")
    yield site.cache


@pytest.fixture
def site(tmp_path: Path, catalog: Path, digests: dict[str, str], template: Path) -> Iterator[Site]:
    with serve(HfMirror()) as mirror:
        yield Site(tmp_path, mirror, catalog, digests, template)


# --- the sweep ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORKFLOWS))
def test_the_sweep_lists_every_step_a_clean_run_journals(site: Site, name: str) -> None:
    workflow = WORKFLOWS[name]
    args = workflow.prepare(site)
    job_id = workflow.job_id(site.result(workflow.verb, *args))
    assert job_id is not None
    names = [workflow.step_name(step, site) for step in workflow.steps]
    assert site.steps(job_id) == [(step, "succeeded", 1) for step in names]
    assert site.jobs(workflow.kind) == [(job_id, "succeeded", 1)]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "step", "point"), CASES)
def test_a_verb_killed_at_a_step_point_finishes_its_job_when_run_again(
    site: Site, name: str, step: str, point: str
) -> None:
    workflow = WORKFLOWS[name]
    args = workflow.prepare(site)
    killed_step = workflow.step_name(step, site)

    killed = site.models(workflow.verb, *args, fault=f"step:{killed_step}:{point}")
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    ((job_id, status, attempt),) = site.jobs(workflow.kind)
    assert (status, attempt) == ("running", 1)
    survivors = site.blobs()

    result = site.result(workflow.verb, *args)
    # The rerun finished the killed job itself, under its id; nothing is left unfinished.
    assert site.jobs(workflow.kind) == [(job_id, "succeeded", 2)], result
    assert site.unfinished() == []
    assert workflow.job_id(result) == job_id

    # The journal is the clean run's; the killed step began again unless it had committed.
    # A step's result commits with the next step's start (one commit per step), so after a
    # kill at "committed" it is that next step, never run, that begins a second time.
    names = [workflow.step_name(s, site) for s in workflow.steps]
    began_twice: str | None = killed_step
    if point == "committed":
        after = names.index(killed_step) + 1
        began_twice = names[after] if after < len(names) else None
    assert site.steps(job_id) == [(s, "succeeded", 2 if s == began_twice else 1) for s in names]

    # The cache is consistent: exactly the expected artifacts, each intact; exactly their
    # blobs, each blob that outlived the crash the very same file; nothing half-done left.
    verified = site.result("verify", "--full")
    assert {row["artifact_digest"] for row in verified["artifacts"]} == workflow.published(site)
    assert all(row["ok"] for row in verified["artifacts"]), verified
    blobs = site.blobs()
    assert set(blobs) == workflow.blobs()
    assert {k: v for k, v in blobs.items() if k in survivors} == {
        k: v for k, v in survivors.items() if k in blobs
    }
    leaked = site.result("prune", "--dry-run")
    assert (leaked["orphan_blobs"], leaked["abandoned_partials"], leaked["reclaimed_bytes"]) == (
        0,
        0,
        0,
    )
    partials = site.cache / "partials"
    assert not partials.is_dir() or list(partials.iterdir()) == []
    leftovers = [p.name for p in (site.cache / "snapshots").iterdir() if p.name.startswith(".")]
    assert leftovers == []
    deletes = step in workflow.deleting
    workflow.check(site, result, recounted=deletes and point == "after")
