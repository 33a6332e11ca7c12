"""One model split over two RPC workers against one host, and what the gate costs.

The real ``llama-server`` and ``ggml-rpc-server`` (the build the end-to-end tests and
``scripts/main.sh`` make, recipe 3 or later: ``tests/support/engine.py``; ``--bin-dir`` picks
another) serve the real SmolLM2-135M-Instruct Q4_1 GGUF (``tests/support/real_inputs.py``),
three ways, each started fresh in every round, the order rotating from round to round:

* ``one_host``: ``llama-server`` alone on this host's CPU;
* ``split_direct``: the leader ``llama-server --rpc`` straight to two ``ggml-rpc-server``
  workers on loopback (llama.cpp's RPC alone, no gate: what a split costs in itself);
* ``split_gated``: the same through sbproxy's way between hosts (``engines/rpc.py``): each
  worker behind its :class:`RpcGate`, the leader through its :class:`RpcTunnel` s (the
  challenge-response, then two relays in the path of every byte).

Every engine process computes with ``--threads`` threads (default 1, so the workers of a
split and the lone host have the same compute each; the machine is small). Per start:
``ready_s`` (spawn to ``/health`` 200, the weights sent to the workers included); then
``--requests`` chat completions, one after another (a fixed prompt, ``max_tokens``
``--max-tokens``, temperature 0): the engine's own ``timings`` (``predicted_per_second``:
decode tokens/s; ``prompt_per_second``) and the wall time per request. For the gated split,
the bytes the gates relayed each way.

Prints ONE JSON object: per contender the medians over rounds, each split's decode tokens/s
over ``one_host``'s, the gated split's over the direct one's (what the gate costs on
loopback), and the load average before and after (the machine is shared).

Usage: ``python benchmarks/rpc_split.py [--rounds 3] [--requests 4] [--max-tokens 64]
[--threads 1] [--bin-dir DIR] [--gguf PATH]`` from the repository root with the project's
virtual environment.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sbproxy.model_host.engines.llama_build import RPC_SERVER  # noqa: E402
from sbproxy.model_host.engines.process import (  # noqa: E402
    EngineProcess,
    minimal_env,
    spawn_engine,
)
from sbproxy.model_host.engines.rpc import (  # noqa: E402
    RpcGate,
    RpcTunnel,
    plan_rpc_worker,
    rpc_argv,
    wait_listening,
)
from sbproxy.workflows import WorkerIdentity  # noqa: E402
from tests.model_host.engines.support import free_port  # noqa: E402

CONTENDERS = ("one_host", "split_direct", "split_gated")
CREDENTIAL = "benchmark-credential"
PROMPT = "Write two sentences about the sea."


def find_bin_dir(explicit: str | None) -> Path:
    """The directory of a build holding both ``llama-server`` and ``ggml-rpc-server``."""
    if explicit:
        candidates = [Path(explicit)]
    else:
        from tests.support.engine import engine_cache

        candidates = sorted((engine_cache() / "engines" / "llama.cpp").glob("src-cpu-*"))
    for directory in reversed(candidates):
        if (directory / "llama-server").is_file() and (directory / RPC_SERVER).is_file():
            return directory.resolve()
    raise SystemExit(
        "no llama.cpp build with ggml-rpc-server found: run scripts/main.sh or "
        "`.venv/bin/pytest tests/e2e/test_rpc_split_real.py` (both build recipe 3), or pass "
        "--bin-dir DIR"
    )


def find_gguf(explicit: str | None) -> Path:
    """The SmolLM2 chat GGUF: ``explicit``, else the real inputs' cache (fetched if absent)."""
    if explicit:
        return Path(explicit).resolve()
    from tests.support.real_inputs import ensure_real_inputs

    return ensure_real_inputs().smol


class Run:
    """One start of one contender: its processes, gates and tunnels, stopped at the end."""

    def __init__(self, contender: str, *, bin_dir: Path, gguf: Path, threads: int, work: Path):
        self.contender = contender
        self.bin_dir = bin_dir
        self.gguf = gguf
        self.threads = threads
        self.work = work
        self.processes: list[EngineProcess] = []
        self.gates: list[RpcGate] = []
        self.identity = WorkerIdentity.current()

    async def _spawn(self, argv: tuple[str, ...], env: dict[str, str], label: str) -> EngineProcess:
        process = await spawn_engine(
            argv, env=env, log_path=self.work / f"{label}.log", owned_dir=self.work / "owned",
            label=label, identity=self.identity,
        )  # fmt: skip
        self.processes.append(process)
        return process

    async def _workers(self, group: anyio.abc.TaskGroup) -> list[tuple[str, int]]:
        endpoints: list[tuple[str, int]] = []
        for index in range(2):
            port = free_port()
            plan = plan_rpc_worker(self.bin_dir / RPC_SERVER, port=port, threads=self.threads)
            worker = await self._spawn(plan.argv, plan.env, f"worker-{index}")
            await wait_listening(worker, port, timeout_s=60)
            if self.contender == "split_direct":
                endpoints.append(("127.0.0.1", port))
                continue
            gate = RpcGate(target_port=port, credentials=lambda node: CREDENTIAL)
            await group.start(gate.serve)
            self.gates.append(gate)
            tunnel = RpcTunnel(gate=("127.0.0.1", gate.port), node="leader", credential=CREDENTIAL)
            await group.start(tunnel.serve)
            endpoints.append(tunnel.endpoint)
        return endpoints

    @contextlib.asynccontextmanager
    async def started(self) -> AsyncIterator[tuple[int, float]]:
        """The leader's port and its ready time (s), everything stopped on exit."""
        async with anyio.create_task_group() as group:
            try:
                endpoints = [] if self.contender == "one_host" else await self._workers(group)
                port = free_port()
                server = self.bin_dir / "llama-server"
                argv = (
                    str(server), "--model", str(self.gguf), "--host", "127.0.0.1",
                    "--port", str(port), "--ctx-size", "1024", "--parallel", "1",
                    "--threads", str(self.threads),
                    "--n-gpu-layers", "999" if endpoints else "0", *rpc_argv(endpoints),
                )  # fmt: skip
                env = minimal_env({"LD_LIBRARY_PATH": str(self.bin_dir)})
                began = time.perf_counter()
                leader = await self._spawn(argv, env, "leader")
                await leader.wait_ready(f"http://127.0.0.1:{port}/health", timeout_s=300, port=port)
                yield port, time.perf_counter() - began
            finally:
                for process in self.processes:
                    await process.shutdown(grace_s=2.0)
                group.cancel_scope.cancel()


async def measure(run: Run, *, requests: int, max_tokens: int) -> dict[str, Any]:
    async with run.started() as (port, ready_s):
        decode: list[float] = []
        prompt: list[float] = []
        walls: list[float] = []
        async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
            for _ in range(requests):
                began = time.perf_counter()
                response = await client.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json={
                        "messages": [{"role": "user", "content": PROMPT}],
                        "max_tokens": max_tokens, "temperature": 0, "seed": 42,
                    },
                )  # fmt: skip
                walls.append(time.perf_counter() - began)
                response.raise_for_status()
                timings = response.json().get("timings", {})
                decode.append(float(timings["predicted_per_second"]))
                prompt.append(float(timings["prompt_per_second"]))
        result: dict[str, Any] = {
            "ready_s": round(ready_s, 3),
            "decode_tokens_per_s": round(statistics.median(decode), 2),
            "prompt_tokens_per_s": round(statistics.median(prompt), 2),
            "request_s": round(statistics.median(walls), 3),
        }
        if run.gates:
            result["gate_bytes_to_workers"] = sum(gate.bytes_in[0] for gate in run.gates)
            result["gate_bytes_from_workers"] = sum(gate.bytes_out[0] for gate in run.gates)
        return result


def _median(rounds: list[dict[str, Any]], key: str) -> float:
    return round(statistics.median(r[key] for r in rounds), 3)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    bin_dir = find_bin_dir(args.bin_dir)
    gguf = find_gguf(args.gguf)
    load_before = os.getloadavg()
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in CONTENDERS}
    with tempfile.TemporaryDirectory(prefix="sbproxy-rpc-bench-") as scratch:
        for index in range(args.rounds):
            order = CONTENDERS[index % 3 :] + CONTENDERS[: index % 3]
            for name in order:
                work = Path(scratch) / f"{name}-{index}"
                work.mkdir()
                run = Run(name, bin_dir=bin_dir, gguf=gguf, threads=args.threads, work=work)
                rounds[name].append(
                    await measure(run, requests=args.requests, max_tokens=args.max_tokens)
                )
    medians = {
        name: {key: _median(found, key) for key in found[0]} for name, found in rounds.items()
    }
    one = medians["one_host"]["decode_tokens_per_s"]
    return {
        "benchmark": "rpc_split",
        "shape": {
            "rounds": args.rounds,
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "threads_per_process": args.threads,
            "workers": 2,
            "model": gguf.name,
        },
        "medians": medians,
        "ratios": {
            "split_direct_over_one_host_decode": round(
                medians["split_direct"]["decode_tokens_per_s"] / one, 3
            ),
            "split_gated_over_one_host_decode": round(
                medians["split_gated"]["decode_tokens_per_s"] / one, 3
            ),
            "split_gated_over_split_direct_decode": round(
                medians["split_gated"]["decode_tokens_per_s"]
                / medians["split_direct"]["decode_tokens_per_s"],
                3,
            ),
            "split_gated_over_split_direct_ready": round(
                medians["split_gated"]["ready_s"] / medians["split_direct"]["ready_s"], 3
            ),
        },
        "rounds": rounds,
        "environment": {
            "bin_dir": str(bin_dir),
            "cpus": os.cpu_count(),
            "load_before": load_before,
            "load_after": os.getloadavg(),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bin-dir")
    parser.add_argument("--gguf")
    args = parser.parse_args()
    print(json.dumps(anyio.run(main_async, args), indent=2))


if __name__ == "__main__":
    main()
