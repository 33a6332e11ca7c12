"""Prefix-aware routing against least outstanding, with real llama-server replicas:
``python benchmarks/prefix_routing.py [--hosts 1|2] [--rounds 3] [--concurrency 2]``.

Real ``sbproxy serve`` hosts of one fleet (``authority: cluster_authority``) on a throw-away
PostgreSQL (:mod:`tests.support.postgres`), each with the real llama-server (built from the
pinned source, :mod:`tests.support.engine`) and the real SmolLM2-135M-Instruct Q4_1 GGUF
imported into its cache. Two deployments of that model, two replicas each, identical but for
``routing``: ``smol-p`` (``prefix``) and ``smol-lo`` (``least_outstanding``) -- so the two
arms never share an engine's prompt cache, and run in the same fleet at the same time.

* ``--hosts 1``: one host with ``cpu_devices: 4``: both replicas of each deployment on it,
  each engine on its own device (one thread each on a 2-core machine);
* ``--hosts 2``: two hosts with ``cpu_devices: 2``; the placement puts one replica of each
  deployment on each; the client sends its requests to the two gateways in turn (as a load
  balancer in front would).

Each replica runs ``--parallel`` = ``max_concurrency`` (:data:`SLOTS`) slots, so it keeps
that many prompts in its slots, and llama-server's host-memory prompt cache (``--cache-ram``,
8 GiB by default) keeps earlier ones; ``cache_prompt`` is on by default in the pinned build.

The workload: :data:`PROMPTS` distinct system prompts of about 1,000 tokens (deterministic
text), each asked ``--rounds`` short user questions (a round asks every prompt once, in a
shuffled order), streamed, ``max_tokens`` :data:`MAX_TOKENS`, greedy. The arms alternate in
batches of ``--concurrency`` requests (a batch of one arm runs alone, then one of the
other), so neither arm's requests slow the other's. Time to first token is measured at the
client, to the first event that carries content.

Prints ONE JSON object: per arm ``ttft_s`` (p50, p95, mean), ``requests_per_s`` and
``completion_tokens_per_s`` (over the arm's own batches), ``cached_prompt_share`` (of the
prompt tokens, those llama-server took from its cache: its ``timings.cache_n``), and
``served_by`` (requests per node); ``ttft_p50_ratio`` and ``ttft_p95_ratio`` (prefix over
least outstanding) and ``throughput_ratio``; the fleet's prefix routing counters.
Progress goes to stderr. Run it from the repository root with the test environment; it
takes a few minutes on 2 cores (the engine build, when not yet cached, adds about 7).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.api.cluster_hosts import FleetHost, placements
from tests.api.pg_hosts import poll
from tests.api.test_fleet_hosts import apply, start_all, stop_all
from tests.support.engine import ensure_llama_server
from tests.support.postgres import running_server
from tests.support.real_inputs import ensure_real_inputs

MODEL = "smollm2-135m-instruct"
VARIANT = "q4_1"
ARMS = {"prefix": "smol-p", "least_outstanding": "smol-lo"}
PROMPTS = 16
SLOTS = 4
MAX_TOKENS = 8
WORDS = (
    "replica",
    "gateway",
    "prefix",
    "cache",
    "token",
    "engine",
    "request",
    "answer",
    "fleet",
    "node",
    "placement",
    "journal",
    "queue",
    "slot",
    "prompt",
    "stream",
    "latency",
    "throughput",
    "model",
    "weight",
    "layer",
    "batch",
    "context",
    "window",
    "system",
    "operator",
    "budget",
    "policy",
    "route",
    "health",
    "signal",
    "metric",
    "counter",
    "label",
    "shard",
    "lease",
    "heartbeat",
    "failure",
    "retry",
    "timeout",
    "deadline",
    "spill",
    "agent",
    "tool",
    "call",
    "schema",
    "field",
    "value",
)
QUESTIONS = (
    "What is the first rule?",
    "Summarise your role.",
    "Name one metric.",
    "Which value matters most?",
    "Give a short example.",
)


def system_prompt(index: int) -> str:
    """Prompt ``index``: about 1,000 tokens of deterministic text, distinct from its first
    words on (so every prompt has its own cached prefix)."""
    rng = random.Random(index)  # noqa: S311 - deterministic text, not secrets
    sentences = [f"You are assistant number {index}, agent {rng.random():.6f}."]
    while sum(len(s.split()) for s in sentences) < 700:
        words = [rng.choice(WORDS) for _ in range(rng.randint(8, 16))]
        sentences.append(" ".join(words).capitalize() + ".")
    return " ".join(sentences)


class BenchHost(FleetHost):
    """A fleet host serving the real model with the real engine, from the built-in catalog."""

    def document(self, deployments: dict[str, dict[str, Any]]) -> dict[str, Any]:
        document = super().document(deployments)
        model_host = document["proxy"]["model_host"]
        model_host.pop("catalog_file", None)
        providers = [
            {"name": arm, "provider_type": "managed_model", "deployment": name, "models": [name]}
            for arm, name in ARMS.items()
        ]
        providers[0]["default_model"] = ARMS["prefix"]
        document["origins"] = {
            "localhost": {"action": {"type": "ai_proxy", "providers": providers}}
        }
        return document


@dataclass
class Arm:
    """One arm's measurements."""

    name: str
    ttft_s: list[float] = field(default_factory=list)
    busy_s: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    served_by: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        ordered = sorted(self.ttft_s)

        def quantile(q: float) -> float | None:
            if not ordered:
                return None
            return round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 4)

        count = len(ordered)
        total = self.prompt_tokens + self.cached_tokens
        return {
            "requests": count,
            "errors": self.errors[:5],
            "ttft_s": {
                "p50": quantile(0.5),
                "p95": quantile(0.95),
                "mean": round(statistics.fmean(ordered), 4) if ordered else None,
            },
            "busy_s": round(self.busy_s, 2),
            "requests_per_s": round(count / self.busy_s, 3) if self.busy_s else None,
            "completion_tokens_per_s": round(self.completion_tokens / self.busy_s, 2)
            if self.busy_s
            else None,
            "cached_prompt_share": round(self.cached_tokens / total, 3) if total else None,
            "served_by": dict(sorted(self.served_by.items())),
        }


def one_request(gateway: str, model: str, prompt: int, question: str) -> dict[str, Any]:
    """Stream one chat; its time to first content, node, usage and cache counts."""
    body = {
        "model": model,
        "messages": [
            {"role": "system", "content": system_prompt(prompt)},
            {"role": "user", "content": question},
        ],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first: float | None = None
    found: dict[str, Any] = {"completion_tokens": 0, "prompt_n": 0, "cache_n": 0}
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, timeout=300) as answer:
        if answer.status_code != 200:
            answer.read()
            raise RuntimeError(f"{answer.status_code}: {answer.text[:300]}")
        found["node"] = answer.headers.get("x-sbproxy-peer-node", "local")
        for line in answer.iter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            event = json.loads(line[5:])
            for choice in event.get("choices") or []:
                if first is None and (choice.get("delta") or {}).get("content"):
                    first = time.perf_counter()
            if event.get("usage"):
                found["completion_tokens"] = event["usage"].get("completion_tokens", 0)
            timings = event.get("timings")
            if timings:
                found["prompt_n"] = timings.get("prompt_n", 0)
                found["cache_n"] = timings.get("cache_n", 0)
    found["ttft_s"] = (first or time.perf_counter()) - started
    return found


def run_batch(
    arm: Arm, model: str, batch: list[tuple[int, str]], gateways: list[str], turn: list[int]
) -> None:
    """Send ``batch`` at once, each to the next gateway in turn; record into ``arm``."""

    def send(item: tuple[int, str]) -> dict[str, Any]:
        turn[0] += 1
        gateway = gateways[turn[0] % len(gateways)]
        return one_request(gateway, model, *item) | {"gateway": gateway}

    started = time.perf_counter()
    with ThreadPoolExecutor(len(batch)) as pool:
        futures = [pool.submit(send, item) for item in batch]
        results = []
        for future in futures:
            try:
                results.append(future.result())
            except Exception as exc:  # noqa: BLE001 - reported in the figures
                arm.errors.append(repr(exc)[:300])
    arm.busy_s += time.perf_counter() - started
    for result in results:
        arm.ttft_s.append(result["ttft_s"])
        arm.completion_tokens += result["completion_tokens"]
        arm.prompt_tokens += result["prompt_n"]
        arm.cached_tokens += result["cache_n"]
        node = result["node"]
        if node == "local":
            node = f"local@{result['gateway'].rsplit(':', 1)[-1]}"
        arm.served_by[node] = arm.served_by.get(node, 0) + 1


def import_model(host: FleetHost, gguf: Path) -> None:
    done = subprocess.run(  # noqa: S603 - this interpreter, our arguments
        [sys.executable, "-m", "sbproxy.cli", "models", "import", str(gguf), "--model", MODEL,
         "--variant", VARIANT, "--cache-dir", str(host.cache), "--format", "json"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"models import failed: {done.stderr[-2000:]}")


def workload(rounds: int) -> list[tuple[int, str]]:
    """Every prompt once per round, in a shuffled order, each round its own question."""
    rng = random.Random(34)  # noqa: S311 - a fixed order, not secrets
    work: list[tuple[int, str]] = []
    for round_ in range(rounds):
        order = list(range(PROMPTS))
        rng.shuffle(order)
        work += [(p, QUESTIONS[(p + round_) % len(QUESTIONS)]) for p in order]
    return work


def start_fleet(hosts: list[FleetHost], log: Callable[[str], None]) -> list[Any]:
    """Start ``hosts``, apply both deployments, wait until every replica is ready; the
    placements as ``(deployment, node, local id, devices)``."""
    replica = {
        "model": MODEL,
        "variant": VARIANT,
        "replicas": 2,
        "max_concurrency": SLOTS,
        "max_output_tokens": 64,
        "max_context": 8192,
        # A shared 2-core machine can take far longer than the defaults to prefill.
        "first_token_timeout_ms": 600_000,
        "stall_timeout_ms": 600_000,
        "request_timeout_ms": 900_000,
        "queue_timeout_ms": 600_000,
    }
    start_all(hosts)
    apply(hosts[0], {name: {**replica, "routing": arm} for arm, name in ARMS.items()})

    def ready() -> bool:
        rows = placements(hosts[0])
        return len(rows) == 4 and all(
            r["state"] == "ready" and (r["runtime"] or {}).get("state") == "ready" for r in rows
        )

    poll(ready, timeout_s=300, what="every replica ready")
    layout = sorted(
        (r["deployment"], r["node"], r["local_id"], r["devices"]) for r in placements(hosts[0])
    )
    log(f"placements: {layout}")
    # Every gateway's routing table lists the replicas ready (a heartbeat later).
    time.sleep(3)
    return layout


def run_arms(
    work: list[tuple[int, str]], gateways: list[str], size: int, log: Callable[[str], None]
) -> dict[str, Arm]:
    """Both arms' batches of ``size``, alternating (which arm goes first alternates too)."""
    arms = {arm: Arm(arm) for arm in ARMS}
    turns = {arm: [0] for arm in ARMS}
    for index in range(0, len(work), size):
        batch = work[index : index + size]
        names = list(ARMS) if (index // size) % 2 == 0 else list(reversed(ARMS))
        for arm in names:
            run_batch(arms[arm], ARMS[arm], batch, gateways, turns[arm])
        log(f"{index + len(batch)}/{len(work)} requests per arm")
    return arms


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--hosts", type=int, choices=(1, 2), default=1)
    parser.add_argument("--rounds", type=int, default=3, help="questions per system prompt")
    parser.add_argument("--concurrency", type=int, default=2, help="requests per batch")
    args = parser.parse_args(argv)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    inputs = ensure_real_inputs()
    engine = ensure_llama_server(inputs)
    root = Path(tempfile.mkdtemp(prefix="sbproxy-prefix-bench-"))
    devices = 4 // args.hosts
    work = workload(args.rounds)
    with running_server() as postgres:
        url = postgres.create_database()
        hosts: list[FleetHost] = [
            BenchHost(
                f"node-{n}",
                root / f"node-{n}",
                url,
                "http://127.0.0.1:9",  # no mirror: the model is imported
                settings={"cpu_devices": devices},
                timing={},  # the product's fleet timing: a busy machine must not fence
            )
            for n in "ab"[: args.hosts]
        ]
        for host in hosts:
            host.executable = engine
            import_model(host, inputs.smol)
            host.write({})
        try:
            layout = start_fleet(hosts, log)
            gateways = [f"http://localhost:{h.gateway}" for h in hosts]
            started = time.perf_counter()
            arms = run_arms(work, gateways, args.concurrency, log)
            wall_s = time.perf_counter() - started
            metrics = [
                line
                for host in hosts
                for line in host.admin_call("GET", "/metrics").text.splitlines()
                if line.startswith("sbproxy_gateway_prefix_routes_total")
            ]
        finally:
            stop_all(hosts)
    figures = {arm: arms[arm].figures() for arm in ARMS}
    prefix, lo = figures["prefix"], figures["least_outstanding"]
    report = {
        "hosts": args.hosts,
        "cpu_devices_per_host": devices,
        "slots_per_replica": SLOTS,
        "system_prompts": PROMPTS,
        "rounds": args.rounds,
        "requests_per_arm": len(work),
        "concurrency": args.concurrency,
        "max_tokens": MAX_TOKENS,
        "wall_s": round(wall_s, 1),
        "placements": layout,
        "arms": figures,
        "ttft_p50_ratio": ratio(prefix["ttft_s"]["p50"], lo["ttft_s"]["p50"]),
        "ttft_p95_ratio": ratio(prefix["ttft_s"]["p95"], lo["ttft_s"]["p95"]),
        "throughput_ratio": ratio(prefix["requests_per_s"], lo["requests_per_s"]),
        "prefix_route_counters": metrics,
    }
    print(json.dumps(report, indent=2, sort_keys=True))
    return 0 if not (prefix["errors"] or lo["errors"]) else 1


if __name__ == "__main__":
    sys.exit(main())
