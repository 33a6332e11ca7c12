"""Autoscaling on real hosts: ``python benchmarks/autoscale.py [--cycles N]``.

Two real ``sbproxy serve`` hosts of one fleet on a throw-away PostgreSQL (the harness of
``tests/api/test_fleet_autoscale.py``: the stand-in llama-server, which answers a plain
request after ``--reply-delay-s`` and streams a token every 10 ms; fleet heartbeat 200 ms).
It prints ONE JSON object on stdout:

* ``scale_from_zero``: ``--cycles`` times, the deployment (``replicas: {min: 0, max: 1}``)
  is left idle until the fleet took it to zero (no engine anywhere), then one streamed
  request goes to the gateway of the host that does not hold the controller:
  ``first_token_s`` (request sent -> first streamed event), ``total_s``, and the
  ``fleet.scale`` decisions the cycle made (one to zero, one back);
* ``steady``: ``clients`` clients each keeping one request in flight, ``target`` 1 per
  replica, for ``seconds``: the decisions made, all of them and after the fleet first
  reached the count the load needs (``after_settled``, 0 = no flapping);
* ``burst``: then ``clients`` clients at once for ``seconds``: the decisions and their
  reasons; ``idle``: the load stopped, the decisions down to ``min`` and how long it took.

Progress lines, and ``sbproxy jobs list --kind fleet.scale`` at the end, go to stderr. Run
it from the repository root with the test environment (``.venv``; PostgreSQL's binaries, as
``scripts/test.sh`` installs them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.api.cluster_hosts import FleetHost, placements
from tests.api.pg_hosts import FILE, REPO, REVISION, catalog, poll, query, tiny_gguf
from tests.api.test_fleet_autoscale import Load, scale_jobs
from tests.api.test_fleet_hosts import TINY, apply, start_all, stop_all
from tests.model_host.engines.support import fake_llama_server
from tests.support.hf_server import HfMirror
from tests.support.postgres import running_server


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def live(host: FleetHost) -> int:
    return sum(1 for p in placements(host) if p["state"] != "stopping")


def first_token(host: FleetHost) -> tuple[float, float]:
    """One streamed request: (seconds to its first event, seconds to its end)."""
    body = {"model": "tiny-chat", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    started = time.monotonic()
    first = None
    with httpx.stream(
        "POST", f"http://localhost:{host.gateway}/v1/chat/completions", json=body, timeout=120
    ) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {response.read()!r}")
        for line in response.iter_lines():
            if line.startswith("data:") and first is None:
                first = time.monotonic() - started
    assert first is not None
    return first, time.monotonic() - started


def decisions(url: str, since: int) -> list[dict[str, Any]]:
    return [
        {k: j[k] for k in ("from_replicas", "to_replicas", "reason")}
        for j in scale_jobs(url)[since:]
    ]


def from_zero(url: str, hosts: list[FleetHost], cycles: int) -> dict[str, Any]:
    """The scale-from-zero cycles (module docstring)."""
    cold = {"min": 0, "max": 1, "window_ms": 2_000, "panic_window_ms": 500}
    cold["scale_down_delay_ms"] = 1_000
    apply(hosts[0], {"tiny": {**TINY, "replicas": cold, "queue_timeout_ms": 60_000}})
    controller = str((hosts[0].fleet("controller").get("controller") or {}).get("holder"))
    asker = next((h for h in hosts if h.node != controller), hosts[1])
    done = []
    for cycle in range(cycles):
        before = len(scale_jobs(url))
        poll(lambda: live(hosts[0]) == 0, timeout_s=60, what="scaled to zero")
        poll(lambda: not any(h.engines() for h in hosts), timeout_s=30, what="no engine")
        ttft, total = first_token(asker)
        made = decisions(url, before)
        done.append({"first_token_s": round(ttft, 3), "total_s": round(total, 3)} | {
            "decisions": made
        })  # fmt: skip
        log(f"cycle {cycle}: first token after {ttft:.2f} s from zero; {made}")
    return {
        "cycles": done,
        "first_token_s": sorted(c["first_token_s"] for c in done),
        "scale_down_delay_ms": cold["scale_down_delay_ms"],
    }


def load_phases(
    url: str, hosts: list[FleetHost], *, steady_s: float, burst_s: float
) -> dict[str, Any]:
    """The steady, burst and idle phases (module docstring)."""
    ranged = {"min": 1, "max": 4, "target": 1, "window_ms": 3_000, "panic_window_ms": 1_000}
    ranged["scale_down_delay_ms"] = 2_500
    apply(hosts[0], {"tiny": {**TINY, "replicas": ranged}})
    poll(lambda: live(hosts[0]) == 1, timeout_s=60, what="min 1 placed")
    figures: dict[str, Any] = {}
    start = len(scale_jobs(url))
    with Load(hosts, clients=2):
        poll(lambda: live(hosts[0]) == 2, timeout_s=60, what="2 for the steady load")
        settled = len(scale_jobs(url))
        time.sleep(steady_s)  # the measured interval itself
    steady = decisions(url, start)
    figures["steady"] = {
        "clients": 2,
        "target": 1,
        "seconds": steady_s,
        "decisions": steady,
        "after_settled": len(steady) - (settled - start),
    }
    log(f"steady: {steady}")
    start = len(scale_jobs(url))
    with Load(hosts, clients=6):
        time.sleep(burst_s)
    burst = decisions(url, start)
    figures["burst"] = {"clients": 6, "seconds": burst_s, "decisions": burst}
    log(f"burst: {burst}")
    start, idle_at = len(scale_jobs(url)), time.monotonic()
    poll(lambda: live(hosts[0]) == 1, timeout_s=120, what="back to min")
    figures["idle"] = {
        "decisions": decisions(url, start),
        "to_min_s": round(time.monotonic() - idle_at, 2),
        "scale_down_delay_ms": ranged["scale_down_delay_ms"],
    }
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--cycles", type=int, default=3, help="scale-from-zero cycles")
    parser.add_argument("--reply-delay-s", type=float, default=0.5)
    parser.add_argument("--steady-s", type=float, default=20.0)
    parser.add_argument("--burst-s", type=float, default=10.0)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="sbproxy-autoscale-"))
    pulled = tiny_gguf(root / "src", vocab=50)
    catalog(root / "catalog.yaml", pulled, tiny_gguf(root / "imp", vocab=60))
    figures: dict[str, Any] = {"reply_delay_s": args.reply_delay_s}
    with contextlib.ExitStack() as stack:
        mirror = stack.enter_context(HfMirror())
        mirror.add_file(REPO, REVISION, FILE, pulled)
        url = stack.enter_context(running_server()).create_database()
        hosts = [FleetHost(f"node-{n}", root / f"node-{n}", url, mirror.url) for n in "ab"]
        for host in hosts:
            host.executable = fake_llama_server(
                host.root / "bin-slow", mode=f"reply_delay_s={args.reply_delay_s}"
            )
            host.write({})
        stack.callback(stop_all, hosts)
        start_all(hosts)
        log("two hosts joined")
        figures["scale_from_zero"] = from_zero(url, hosts, args.cycles)
        figures.update(load_phases(url, hosts, steady_s=args.steady_s, burst_s=args.burst_s))
        listed = subprocess.run(  # noqa: S603 - this interpreter, fixed arguments
            [sys.executable, "-m", "sbproxy.cli", "jobs", "list", "--kind", "fleet.scale",
             "--limit", "6", "-f", str(hosts[0].config)],
            env=hosts[0].env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        log("sbproxy jobs list --kind fleet.scale --limit 6:\n" + listed.stdout + listed.stderr)
        figures["fleet_scale_jobs"] = int(
            query(url, "SELECT count(*) FROM jobs WHERE kind = 'fleet.scale'")[0][0]
        )
    print(json.dumps(figures, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
