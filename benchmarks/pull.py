"""What a verified pull costs against a plain download of the same bytes on loopback.

For each ``--size-mib`` (default 1024 and 4096 MiB: a small GGUF and a 7-8B Q4 one), generates
one random file, serves it from a separate ``python -m tests.support.hf_server`` process in
the Hugging Face ``resolve`` shape, and then, ``--runs`` times each, interleaved so drift in
the machine hits every contender alike:

* ``curl``: ``curl -s -o FILE URL`` -- the floor: no hashing, no fsync;
* ``sbproxy``: the real ``sbproxy models pull`` CLI process with a fresh cache root each
  time, ``HF_ENDPOINT`` pointed at the server and an operator catalog pinning the file's
  SHA-256 and size. Timed from process start to exit, so it includes interpreter start,
  opening the journal, the durable job (plan, download hashing SHA-256 and BLAKE3 while it
  streams, checkpoints, promote, publish with fsync) and the result. ``job_s`` is the same
  pull measured inside the journal (job claimed to job finished), and ``outside_job_s`` the
  rest of the process (interpreter and imports, opening the journal, resolving the
  artifact, printing). The package's bytecode is compiled once before the runs, as
  installing a wheel does (``PYTHONDONTWRITEBYTECODE``, set on some machines, would
  otherwise make every run recompile sbproxy's sources);
* ``httpx_sha256``: for reference, an in-process httpx streaming download that hashes
  SHA-256 and writes the file (what a minimal verifying downloader costs).

Prints ONE JSON object on stdout. Per size: per-run seconds and MiB/s, medians, and
``sbproxy_over_curl`` (median sbproxy MiB/s over median curl MiB/s, whole process; the
target is >= 0.8), ``sbproxy_job_over_curl`` for the in-journal time and
``sbproxy_fetch_over_curl`` for the fetch step alone (download with SHA-256 and BLAKE3 while
streaming, checkpoints, final fsync and promotion into the blob store). Then
``sbproxy_outside_job_s`` (the CLI's fixed cost, median over all runs) and, with two or more
sizes, ``marginal``: each contender's MiB/s over the extra bytes of the largest size against
the smallest, in which fixed costs such as process start-up cancel out.

Usage: ``python benchmarks/pull.py [--size-mib 1024 4096] [--runs 3] [--dir PATH]``. Run it
from the repository root with the project's virtual environment; ``--dir`` picks the file
system (it should be the disk a cache would live on, not tmpfs). Peak disk use is about
three times the largest size.

With ``--baseline-commit REV`` (repeatable) it compares this checkout's pull with older
commits' instead, in one run: each commit's ``sbproxy`` package is extracted (``git
archive``) into a temporary directory, compiled, and run by the same interpreter and virtual
environment (``python -m sbproxy.cli models pull`` with ``PYTHONPATH``; this checkout runs the
same way), against the same server and file. ``--pairs`` rounds (default 5) each run every
contender once -- ``curl`` first, then the pulls in an order that rotates from round to
round. ``--through-proxy`` adds ``current_through_proxy``: this checkout's pull with
``HTTP_PROXY`` pointing at a real forward proxy (``proxy.py``, started for the run), so the
proxy's own cost is in it, and ``curl_through_proxy``, curl through the same proxy (the
proxy's ceiling). It prints ONE JSON object: every round's figures, and per baseline
the per-round ratios of the current MiB/s over the baseline's (whole process, in-journal job,
fetch step) with their median and range, and whether the median fetch ratio reaches
``--min-ratio`` (default 0.95: within 5%), and likewise the ratio of the pull processes' CPU
seconds (baseline over current), which a machine loaded by others disturbs less than wall
time.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import yaml
from baseline import ROOT, checkout, compile_package, extract, spread

SBPROXY = Path(sys.executable).parent / "sbproxy"
REPO = "bench/random-GGUF"
REVISION = "0123456789abcdef0123456789abcdef01234567"
FILENAME = "random.gguf"
MODEL = "bench-random"
MIB = 1 << 20
WRITE_BLOCK = 8 * MIB
READ_BLOCK = 1 * MIB


def generate(path: Path, size_mib: int) -> str:
    """Write ``size_mib`` MiB of random bytes to ``path``; their SHA-256."""
    digest = hashlib.sha256()
    with path.open("wb") as handle:
        remaining = size_mib * MIB
        while remaining:
            block = os.urandom(min(WRITE_BLOCK, remaining))
            digest.update(block)
            handle.write(block)
            remaining -= len(block)
    return digest.hexdigest()


def write_catalog(path: Path, *, sha256: str, size: int) -> None:
    """An operator catalog (v2) whose one model pins the served file."""
    document = {
        "schema_version": 2,
        "catalog_revision": "bench-1",
        "models": {
            MODEL: {
                "params": "0B",
                "license": "other",
                "family": "bench",
                "context_length": 2048,
                "variants": [
                    {
                        "id": "raw",
                        "format": "gguf",
                        "quant": "RAW",
                        "engines": ["llama_cpp"],
                        "source": f"hf:{REPO}",
                        "revision": REVISION,
                        "files": [{"path": FILENAME, "sha256": sha256, "size_bytes": size}],
                        "requirements": {
                            "accelerators": ["cpu", "metal", "cuda"],
                            "min_memory_bytes": 1024,
                        },
                        "stability": "stable",
                        "certification": "bench",
                    }
                ],
            }
        },
    }
    path.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")


class Server:
    """``python -m tests.support.hf_server`` in its own process."""

    def __init__(self, source: Path) -> None:
        self.process = subprocess.Popen(  # noqa: S603 - our own fixed argv
            [
                sys.executable,
                "-m",
                "tests.support.hf_server",
                "--file",
                f"{REPO}:{REVISION}:{FILENAME}={source}",
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        banner = json.loads(self.process.stdout.readline())
        self.endpoint: str = banner["url"]
        self.url = f"{self.endpoint}/{REPO}/resolve/{REVISION}/{FILENAME}"

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


PROXY_VARIABLES = {
    f"{name}_proxy" if lower else f"{name.upper()}_PROXY"
    for name in ("http", "https", "all", "no")
    for lower in (True, False)
}


def child_env(endpoint: str) -> dict[str, str]:
    dropped = {"SB_CONFIG_FILE", "SBPROXY_CACHE_DIR", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"}
    dropped |= PROXY_VARIABLES  # direct to the loopback server unless a contender says
    env = {key: value for key, value in os.environ.items() if key not in dropped}
    env["HF_ENDPOINT"] = endpoint
    return env


def run_curl(server: Server, work: Path, size: int, *, proxy: str | None = None) -> dict[str, Any]:
    target = work / "curl.out"
    via = ["--proxy", proxy] if proxy else []
    began = time.perf_counter()
    subprocess.run(["curl", "-s", *via, "-o", str(target), server.url], check=True)  # noqa: S603,S607
    elapsed = time.perf_counter() - began
    assert target.stat().st_size == size
    target.unlink()
    return {"seconds": elapsed}


def _children_cpu_s() -> float:
    """User plus system CPU seconds of this process's finished children so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_sbproxy(
    server: Server,
    work: Path,
    size: int,
    catalog: Path,
    *,
    tree: Path | None = None,
    module: bool = False,
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One ``models pull`` into a fresh cache: the ``sbproxy`` script of this environment,
    or with ``module`` (or a ``tree``: an extracted package) ``python -m sbproxy.cli``."""
    cache = work / "sbproxy-cache"
    env = child_env(server.endpoint) | (extra_env or {})
    launcher = [str(SBPROXY)]
    if module or tree is not None:
        launcher = [sys.executable, "-m", "sbproxy.cli"]
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    cpu_before = _children_cpu_s()
    began = time.perf_counter()
    done = subprocess.run(  # noqa: S603 - our own fixed argv
        [
            *launcher,
            "models",
            "pull",
            MODEL,
            "--catalog-file",
            str(catalog),
            "--cache-dir",
            str(cache),
            "--format",
            "json",
        ],
        env=env,
        cwd=tree or ROOT,  # `-m` puts the working directory first on sys.path
        capture_output=True,
        text=True,
        check=False,
    )
    elapsed = time.perf_counter() - began
    cpu_s = _children_cpu_s() - cpu_before
    if done.returncode != 0:
        raise RuntimeError(f"sbproxy models pull failed: {done.stderr}")
    (row,) = json.loads(done.stdout)["artifacts"]
    assert row["verified_bytes"] == size and row["cache_hit"] is False
    shown = subprocess.run(  # noqa: S603 - our own fixed argv
        [
            *launcher,
            "jobs",
            "show",
            row["job_id"],
            "--cache-dir",
            str(cache),
            "--format",
            "json",
        ],
        env=env,
        cwd=tree or ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    shown_json = json.loads(shown.stdout)
    job = shown_json["job"]
    (fetch,) = [s for s in shown_json["steps"] if s["name"].startswith("fetch:")]
    shutil.rmtree(cache)
    job_s = (job["ended_at_ms"] - job["started_at_ms"]) / 1000
    return {
        "seconds": elapsed,
        "job_s": job_s,
        "fetch_s": (fetch["ended_at_ms"] - fetch["started_at_ms"]) / 1000,
        "outside_job_s": round(elapsed - job_s, 3),
        "cpu_s": round(cpu_s, 3),
    }


def run_httpx(server: Server, work: Path, size: int, sha256: str) -> dict[str, Any]:
    target = work / "httpx.out"
    digest = hashlib.sha256()
    began = time.perf_counter()
    with (
        httpx.Client(timeout=60) as client,
        client.stream("GET", server.url) as response,
        target.open("wb") as handle,
    ):
        response.raise_for_status()
        for block in response.iter_bytes(READ_BLOCK):
            digest.update(block)
            handle.write(block)
    elapsed = time.perf_counter() - began
    assert digest.hexdigest() == sha256 and target.stat().st_size == size
    target.unlink()
    return {"seconds": elapsed}


def summarise(runs: list[dict[str, Any]], size: int) -> dict[str, Any]:
    for run in runs:
        run["mib_per_s"] = round(size / MIB / run["seconds"], 1)
        run["seconds"] = round(run["seconds"], 3)
        for key in ("job", "fetch"):
            if f"{key}_s" in run:
                run[f"{key}_mib_per_s"] = round(size / MIB / run[f"{key}_s"], 1)
    out: dict[str, Any] = {
        "runs": runs,
        "median_mib_per_s": round(statistics.median(r["mib_per_s"] for r in runs), 1),
    }
    for key in ("job", "fetch"):
        if all(f"{key}_mib_per_s" in r for r in runs):
            out[f"median_{key}_mib_per_s"] = round(
                statistics.median(r[f"{key}_mib_per_s"] for r in runs), 1
            )
    if all("outside_job_s" in r for r in runs):
        out["median_outside_job_s"] = round(statistics.median(r["outside_job_s"] for r in runs), 3)
    return out


def measure(work: Path, size_mib: int, runs: int) -> dict[str, Any]:
    """Every contender ``runs`` times, interleaved, on one freshly generated file."""
    source = work / FILENAME
    sha256 = generate(source, size_mib)
    size = source.stat().st_size
    catalog = work / "catalog.yaml"
    write_catalog(catalog, sha256=sha256, size=size)
    server = Server(source)
    try:
        contenders: dict[str, Callable[[], dict[str, Any]]] = {
            "curl": lambda: run_curl(server, work, size),
            "sbproxy": lambda: run_sbproxy(server, work, size, catalog),
            "httpx_sha256": lambda: run_httpx(server, work, size, sha256),
        }
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
        for _ in range(runs):
            for name, contender in contenders.items():
                results[name].append(contender())
    finally:
        server.stop()
        source.unlink()

    summary = {name: summarise(rows, size) for name, rows in results.items()}
    curl = summary["curl"]["median_mib_per_s"]
    return {
        "size_bytes": size,
        **summary,
        "sbproxy_over_curl": round(summary["sbproxy"]["median_mib_per_s"] / curl, 3),
        "sbproxy_job_over_curl": round(summary["sbproxy"]["median_job_mib_per_s"] / curl, 3),
        "sbproxy_fetch_over_curl": round(summary["sbproxy"]["median_fetch_mib_per_s"] / curl, 3),
        "httpx_sha256_over_curl": round(summary["httpx_sha256"]["median_mib_per_s"] / curl, 3),
    }


def marginal(small: dict[str, Any], large: dict[str, Any]) -> dict[str, Any]:
    """Throughput over the extra bytes of ``large``: fixed costs (process start) cancel out."""
    extra_mib = float(large["size_bytes"] - small["size_bytes"]) / MIB

    def rate(name: str) -> float:
        before, after = (
            float(statistics.median(r["seconds"] for r in sized[name]["runs"]))
            for sized in (small, large)
        )
        return extra_mib / (after - before)

    curl, sbproxy = rate("curl"), rate("sbproxy")
    return {
        "from_bytes": small["size_bytes"],
        "to_bytes": large["size_bytes"],
        "curl_mib_per_s": round(curl, 1),
        "sbproxy_mib_per_s": round(sbproxy, 1),
        "sbproxy_over_curl": round(sbproxy / curl, 3),
    }


# --------------------------------------------------------------------------- baselines


def _through_proxy(stack: contextlib.ExitStack, work: Path) -> dict[str, str]:
    """Start a real forward proxy (``proxy.py``) for the run: the env that uses it."""
    sys.path.insert(0, str(ROOT))
    from tests.support.forward_proxy import ForwardProxy

    proxy = stack.enter_context(ForwardProxy(work / "forward-proxy"))
    return {"HTTP_PROXY": proxy.url}


def compare_commits(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--baseline-commit`` comparison (see the module docstring)."""
    head, dirty, baselines = checkout(args.baseline_commit)
    (size_mib,) = args.size_mib if len(args.size_mib) == 1 else (min(args.size_mib),)
    rounds: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="sbproxy-pull-bench-", dir=args.dir) as temp,
        contextlib.ExitStack() as stack,
    ):
        work = Path(temp)
        trees: dict[str, Path | None] = {"current": None}
        for short in baselines:
            trees[short] = extract(short, work / "trees" / short, compile_bytecode=True)
        proxied = _through_proxy(stack, work) if args.through_proxy else None
        source = work / FILENAME
        sha256 = generate(source, size_mib)
        size = source.stat().st_size
        catalog = work / "catalog.yaml"
        write_catalog(catalog, sha256=sha256, size=size)
        server = Server(source)
        stack.callback(server.stop)
        contenders: dict[str, Callable[[], dict[str, Any]]] = {
            name: partial(run_sbproxy, server, work, size, catalog, tree=tree, module=True)
            for name, tree in trees.items()
        }
        if proxied is not None:
            contenders["current_through_proxy"] = partial(
                run_sbproxy, server, work, size, catalog, module=True, extra_env=proxied
            )
            # The proxy's own ceiling: curl through the same proxy.
            contenders["curl_through_proxy"] = partial(
                run_curl, server, work, size, proxy=proxied["HTTP_PROXY"]
            )
        names = list(contenders)
        for index in range(args.pairs):
            order = names[index % len(names) :] + names[: index % len(names)]
            figures: dict[str, Any] = {"order": order, "curl": run_curl(server, work, size)}
            for name in order:
                figures[name] = contenders[name]()
            for run in (figures[name] for name in ["curl", *order]):
                run["mib_per_s"] = round(size / MIB / run["seconds"], 1)
                for key in ("job", "fetch"):
                    if f"{key}_s" in run:
                        run[f"{key}_mib_per_s"] = round(size / MIB / run[f"{key}_s"], 1)
            rounds.append(figures)
            print(f"round {index + 1}/{args.pairs} done", file=sys.stderr, flush=True)

    fields = ("mib_per_s", "job_mib_per_s", "fetch_mib_per_s", "cpu_s")
    against: dict[str, Any] = {}
    for short, rev in baselines.items():
        ratios = {
            field: spread([r["current"][field] / r[short][field] for r in rounds])
            for field in fields
        }
        # CPU seconds of the whole pull process, baseline over current (above 1: the current
        # pull costs less CPU): steadier than wall time on a machine others load.
        ratios["cpu_baseline_over_current"] = spread(
            [r[short]["cpu_s"] / r["current"]["cpu_s"] for r in rounds]
        )
        of_medians = {  # cpu_s: current over baseline, below 1 is cheaper
            field: round(
                statistics.median(r["current"][field] for r in rounds)
                / statistics.median(r[short][field] for r in rounds),
                3,
            )
            for field in fields
        }
        against[short] = {
            "rev": rev,
            "current_over_baseline": ratios,
            "median_over_median": of_medians,
            "checks": {
                metric: {
                    "target": f">= {args.min_ratio}",
                    "median": ratios[metric]["median"],
                    "met": ratios[metric]["median"] >= args.min_ratio,
                }
                for metric in ("fetch_mib_per_s", "cpu_baseline_over_current")
            },
        }
    medians = {
        name: {
            field: statistics.median(r[name][field] for r in rounds)
            for field in fields
            if field in rounds[0][name]
        }
        for name in names
    }
    medians["curl"] = {"mib_per_s": statistics.median(r["curl"]["mib_per_s"] for r in rounds)}
    return {
        "benchmark": "pull",
        "mode": "baseline comparison",
        "current": f"{head}{' + uncommitted changes' if dirty else ''}",
        "size_bytes": size,
        "pairs": args.pairs,
        "url_shape": "HF resolve on 127.0.0.1 (python -m tests.support.hf_server, sendfile)",
        "launch": "python -m sbproxy.cli models pull, PYTHONPATH=<extracted package> for a "
        "baseline; bytecode compiled for both",
        "ratio_meaning": "current MiB/s over baseline MiB/s, per round: above 1 is faster",
        "against": against,
        "medians": medians,
        "rounds": rounds,
        "environment": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size-mib",
        type=int,
        nargs="+",
        default=[1024, 4096],
        help="file sizes in MiB, each measured in turn",
    )
    parser.add_argument("--runs", type=int, default=3, help="runs of each contender per size")
    parser.add_argument("--dir", type=Path, default=None, help="where files are written")
    parser.add_argument(
        "--baseline-commit",
        action="append",
        default=[],
        metavar="REV",
        help="compare with the pull of this commit (repeatable); see the module docstring",
    )
    parser.add_argument("--pairs", type=int, default=5, help="rounds of the comparison")
    parser.add_argument(
        "--min-ratio", type=float, default=0.95, help="required median fetch MiB/s ratio"
    )
    parser.add_argument(
        "--through-proxy",
        action="store_true",
        help="with --baseline-commit: also pull through a real forward proxy (proxy.py)",
    )
    args = parser.parse_args()

    compile_package()
    if args.baseline_commit:
        print(json.dumps(compare_commits(args), indent=2))
        return
    with tempfile.TemporaryDirectory(prefix="sbproxy-pull-bench-", dir=args.dir) as temp:
        sizes = [measure(Path(temp), size_mib, args.runs) for size_mib in sorted(args.size_mib)]

    report: dict[str, Any] = {
        "benchmark": "pull",
        "runs_each": args.runs,
        "url_shape": "HF resolve on 127.0.0.1 (python -m tests.support.hf_server, sendfile)",
        "bytecode": "sbproxy compiled before the runs (compileall), as a wheel install does",
        "sizes": sizes,
        "sbproxy_outside_job_s": round(
            statistics.median(r["outside_job_s"] for s in sizes for r in s["sbproxy"]["runs"]),
            3,
        ),
        "target_ratio": 0.8,
    }
    if len(sizes) > 1:
        report["marginal"] = marginal(sizes[0], sizes[-1])
    report["environment"] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "curl": subprocess.run(
            ["curl", "--version"],  # noqa: S607
            capture_output=True,
            text=True,
            check=False,
        ).stdout.split("\n", 1)[0],
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
