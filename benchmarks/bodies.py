"""What the gateway's body checks cost, against the typed decode they replaced.

Per request body, two contenders do what the gateway does before it forwards:

* ``typed`` (the gateway before issue 22): one msgspec decode into a Struct of the fields it
  reads (``messages``, ``prompt``, ``input`` and the limits as ``Any``, the rest skipped
  unchecked), its checks of then (the roles; a ``prompt`` or ``input`` only by its type),
  and, for a body it completes, a second decode of the whole body and an encode;
* ``sbproxy``: :func:`sbproxy.api.bodies.decode_head` (the whole body decoded once, the
  read fields checked) and :func:`~sbproxy.api.bodies.check_body` (the route's field and
  the limits; a list ``prompt`` or ``input`` converted item by item in C), and, for a body
  it completes, :func:`~sbproxy.api.bodies.with_fields` (an encode of the decoded document).

Bodies: a short chat, a 40-message conversation with tools (~40 KB), a completion prompt
of 100,000 token ids (~690 KB) and an embeddings batch of 500 strings (~190 KB); each plain
(forwarded as it is) and completed (``max_tokens`` added).

Rounds interleave the contenders, in a rotating order, so that a noisy neighbour on a shared
machine hits both alike; the ratio in one run is the figure to trust. Prints ONE JSON
object: per body and contender the median and p90 of one call in microseconds, and
``sbproxy_over_typed`` (median over median: below 1, the checked path is faster).

Usage: ``python benchmarks/bodies.py [--rounds 7]`` from the repository root with the
project's virtual environment.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import msgspec

from sbproxy.api.bodies import check_body, decode_head, with_fields


class TypedHead(msgspec.Struct):
    """The fields the gateway decoded before issue 22 (the rest skipped)."""

    model: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    messages: Any = msgspec.UNSET
    prompt: Any = msgspec.UNSET
    input: Any = msgspec.UNSET
    max_tokens: Any = msgspec.UNSET
    max_completion_tokens: Any = msgspec.UNSET
    n_predict: Any = msgspec.UNSET


TYPED = msgspec.json.Decoder(TypedHead)
DOCUMENT = msgspec.json.Decoder()
ENCODER = msgspec.json.Encoder()
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def bodies() -> dict[str, tuple[str, bytes]]:
    """Each body by name, with its route."""
    conversation = [
        {"role": "user" if i % 2 else "assistant", "content": "word " * 200} for i in range(40)
    ]
    documents: dict[str, tuple[str, dict[str, Any]]] = {
        "short_chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        "conversation": (
            "/v1/chat/completions",
            {"messages": conversation, "temperature": 0.7, "tools": [TOOL] * 5},
        ),
        "prompt_100k_ids": ("/v1/completions", {"prompt": list(range(100_000))}),
        "embeddings_500": ("/v1/embeddings", {"input": ["some text to embed " * 20] * 500}),
    }
    return {
        name: (path, json.dumps({"model": "m", **document}).encode())
        for name, (path, document) in documents.items()
    }


ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def typed(path: str, body: bytes, *, complete: bool) -> bytes:
    head = TYPED.decode(body)
    # the checks of then: the route's field by its type, the roles, the limits
    if path == "/v1/chat/completions":
        assert isinstance(head.messages, list) and head.messages
        assert all(isinstance(m, dict) and m.get("role") in ROLES for m in head.messages)
    else:
        given = head.prompt if path == "/v1/completions" else head.input
        assert isinstance(given, str) or (isinstance(given, list) and given)
    for name in ("max_tokens", "max_completion_tokens", "n_predict"):
        value = getattr(head, name)
        assert value in (msgspec.UNSET, None) or (isinstance(value, int) and value > 0)
    if complete:
        document = DOCUMENT.decode(body)
        document["max_tokens"] = 512
        return ENCODER.encode(document)
    return body


def checked(path: str, body: bytes, *, complete: bool) -> bytes:
    head = decode_head(body)
    check_body(path, head)
    return with_fields(head, {"max_tokens": 512}) if complete else body


def time_calls(call: Callable[[], bytes], calls: int) -> list[float]:
    """Microseconds per call, ``calls`` times."""
    runs = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        runs.append((time.perf_counter() - start) * 1e6)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    contenders = {"typed": typed, "sbproxy": checked}
    runs: dict[str, dict[str, list[float]]] = {}
    for name, (path, body) in bodies().items():
        calls = 200 if len(body) < 100_000 else 5
        for complete in (False, True):
            case = f"{name}_{'completed' if complete else 'plain'}"
            runs[case] = {contender: [] for contender in contenders}
            order = list(contenders)
            for _ in range(args.rounds):
                for contender in order:
                    call = partial(contenders[contender], path, body, complete=complete)
                    runs[case][contender] += time_calls(call, calls)
                order.append(order.pop(0))
    report: dict[str, Any] = {"bodies": {}}
    for case, by_contender in runs.items():
        figures = {
            contender: {
                "median_us": round(statistics.median(values), 2),
                "p90_us": round(statistics.quantiles(values, n=10)[-1], 2),
            }
            for contender, values in by_contender.items()
        }
        ratio = figures["sbproxy"]["median_us"] / figures["typed"]["median_us"]
        report["bodies"][case] = {**figures, "sbproxy_over_typed": round(ratio, 3)}
    report["environment"] = {
        "python": sys.version.split()[0],
        "msgspec": msgspec.__version__,
        "platform": platform.platform(),
        "load_average": list(os.getloadavg()),
    }
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
