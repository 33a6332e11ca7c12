"""Generated bodies against the real gateway (uvicorn on loopback, the stand-in engine behind
it): whatever the body, the answer is never a 5xx -- a 4xx is the gateway's own
``invalid_body`` / ``invalid_request`` (or ``model_not_found``) envelope -- and every body
the engine receives fits the documented contract.

The bodies are written as JSON *text* so that they can hold what a JSON library would not
write: bytes that are not UTF-8 in keys and values, raw NULs and control characters, half
surrogate pairs, integers of thousands of digits, 1e999, duplicate keys, deep nesting, and
top levels that are not objects. A body is a request of valid fields (``stream`` true,
false or null: streamed and not) with one kind of fault: none (it reaches the engine), a
read field of the wrong type or shape (the near misses too: ``[null]`` prompts, ``true`` and
``5.0`` limits, a list as a role), a dirty leaf (mostly in a field the gateway does not
read, which it used to let through), or not an object at all. Hypothesis runs derandomized
(the same 300 bodies every run, no deadline, no example database).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.api.support import served

pytestmark = pytest.mark.anyio

EXAMPLES = 300
CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
LIMITS = ("max_tokens", "max_completion_tokens", "n_predict")
INT32_END = 2**31
# The gateway's own 4xx codes a body can earn (an unknown `model` is model_not_found).
OWN_CODES = {"invalid_body", "invalid_request", "model_not_found"}

# Inside a JSON string: what breaks UTF-8 or the string, and what is odd but valid.
POISON = [
    b"\xbe",  # a continuation byte alone
    b"\xff",  # never in UTF-8
    b"\xc0\xaf",  # an overlong "/"
    b"\xed\xa0\x80",  # a surrogate encoded as UTF-8
    b"\xe2\x82",  # a truncated sequence
    b"\x00",  # a raw NUL (a control character: not allowed unescaped)
    b"\x1f",
    b"\\u0000",  # an escaped NUL: valid
    b"\\ud800",  # half a surrogate pair
    b"\\udc00",
    b"\\ud800\\u0041",
    b"\\ud83d\\ude00",  # a whole pair: valid
    b"\\x",  # not an escape
]


def _quote(text: str) -> bytes:
    return json.dumps(text, ensure_ascii=False).encode()


def _array(items: list[bytes]) -> bytes:
    return b"[" + b",".join(items) + b"]"


def _object(pairs: list[tuple[bytes, bytes]]) -> bytes:
    return b"{" + b",".join(key + b":" + value for key, value in pairs) + b"}"


# Leaves of JSON text: clean ones decode (odd only in type or size), dirty ones do not.
clean_strings = st.text(max_size=12).map(_quote)
dirty_strings = st.tuples(st.text(max_size=6), st.sampled_from(POISON), st.text(max_size=6)).map(
    lambda parts: b'"' + _quote(parts[0])[1:-1] + parts[1] + _quote(parts[2])[1:-1] + b'"'
)
clean_numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(lambda n: str(n).encode()),
    st.integers(min_value=-3, max_value=INT32_END + 3).map(lambda n: str(n).encode()),
    st.floats(allow_nan=False, allow_infinity=False).map(lambda x: json.dumps(x).encode()),
    st.sampled_from([b"5.0", b"1E2", b"-0", b"0.5e-400", b"7" * 4300]),
)
dirty_numbers = st.one_of(
    # 4300 digits is as long an integer as decodes; past it, out of range
    st.tuples(st.sampled_from([b"", b"-"]), st.integers(min_value=4301, max_value=5100)).map(
        lambda parts: parts[0] + b"7" * parts[1]
    ),
    st.sampled_from([b"1e999", b"-1e999", b"NaN", b"Infinity", b"01", b"1.", b"+1"]),
)
literals = st.sampled_from([b"true", b"false", b"null"])
shallow = st.sampled_from([1, 50, 500]).map(lambda n: b"[" * n + b"]" * n)
deep = st.sampled_from([3000, 100_000]).map(lambda n: b"[" * n + b"]" * n)

_read = ["model", "stream", "stream_options", "messages", "prompt", "input", *LIMITS]
clean_keys = st.one_of(
    st.sampled_from([*_read, "role", "content", "deployment", "user"]).map(_quote),
    clean_strings,
)
keys = st.one_of(*[clean_keys] * 7, dirty_strings)


def _json(leaves: st.SearchStrategy[bytes], keys: st.SearchStrategy[bytes]) -> Any:
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=4).map(_array),
            st.lists(st.tuples(keys, children), max_size=4).map(_object),
        ),
        max_leaves=10,
    )


_clean_leaves = st.one_of(literals, clean_numbers, clean_strings, shallow)
dirty_leaves = st.one_of(dirty_strings, dirty_numbers, deep)
# Odd in type or shape only: these reach the checks of the read fields, past the decode.
clean_values: st.SearchStrategy[bytes] = _json(_clean_leaves, clean_keys)
# One leaf in eight dirty (one dirty leaf spoils a whole body).
values: st.SearchStrategy[bytes] = _json(st.one_of(*[_clean_leaves] * 7, dirty_leaves), keys)
strings = st.one_of(clean_strings, dirty_strings)
numbers = st.one_of(clean_numbers, dirty_numbers)
odd = st.one_of(clean_values, clean_values, values)

# Near misses of each field the gateway reads, beside any odd value.
_ints_alike = st.one_of(literals, numbers, strings, st.sampled_from([b"[1]", b"{}", b'"5"']))
_messages_alike = st.one_of(
    odd,
    st.tuples(odd, odd).map(lambda rc: b'[{"role":' + rc[0] + b',"content":' + rc[1] + b"}]"),
    st.tuples(st.sampled_from(sorted(ROLES)), odd).map(
        lambda rc: b'[{"role":' + _quote(rc[0]) + b',"content":' + rc[1] + b"}]"
    ),
    odd.map(lambda item: b'[{"role":"user","content":"hi"},' + item + b"]"),
)
_prompts_alike = st.one_of(
    odd,
    odd.map(lambda item: b"[" + item + b"]"),
    odd.map(lambda item: b"[[" + item + b"]]"),
    odd.map(lambda item: b"[1," + item + b"]"),
    odd.map(lambda item: b'["a",' + item + b"]"),
    odd.map(lambda item: b"[[1],[" + item + b"]]"),
    st.sampled_from([b"[]", b"[[]]", b"[null]", b'[{"a":1}]', b'[[1,"a"]]', b"[true]", b"[-1]"]),
)
_valid_prompts = st.sampled_from(
    [b'"hi"', b'["hi","there"]', b"[1,2,3]", b"[[1,2],[3]]", b'""', b"[0]"]
)

VALID: dict[str, st.SearchStrategy[bytes]] = {
    "model": st.sampled_from([b'"tiny-chat"', b"null"]),
    "stream": st.sampled_from([b"true", b"false", b"null"]),
    "stream_options": st.sampled_from([b'{"include_usage":true}', b'{"include_usage":false}']),
    "messages": st.just(b'[{"role":"user","content":"hi"}]'),
    "prompt": _valid_prompts,
    "input": _valid_prompts,
    **{
        name: st.integers(min_value=1, max_value=5).map(lambda n: str(n).encode())
        for name in LIMITS
    },
}
ODD: dict[str, st.SearchStrategy[bytes]] = {
    "model": st.one_of(odd, strings),
    "stream": odd,
    "stream_options": odd,
    "messages": _messages_alike,
    "prompt": _prompts_alike,
    "input": _prompts_alike,
    **dict.fromkeys(LIMITS, _ints_alike),
}
# The field each route needs, and the fields it may carry.
FIELDS = {
    CHAT: ("messages", "model", "stream", "stream_options", *LIMITS),
    COMPLETIONS: ("prompt", "model", "stream", *LIMITS),
    EMBEDDINGS: ("input", "model", "stream"),
}


# A value with a dirty leaf in it, at the top or one level down.
dirty_values = st.one_of(
    dirty_leaves,
    dirty_leaves.map(lambda leaf: b"[1," + leaf + b"]"),
    st.tuples(clean_keys, dirty_leaves).map(lambda kv: b"{" + kv[0] + b":" + kv[1] + b"}"),
)
# What is wrong with a body: nothing (it reaches the engine), the type or shape of a read
# field, a dirty leaf (in a read field, another field, or a key), or the whole text.
FAULTS = ["none", "none", "type", "type", "type", "dirty", "dirty", "text"]


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes]:
    """A route and a body for it: a request object of valid fields (the route's own, some
    others, a few it does not read) with one kind of fault, keys maybe repeated (the last
    counts); or any JSON text, or bytes."""
    path = draw(st.sampled_from([CHAT, COMPLETIONS, EMBEDDINGS]))
    fault = draw(st.sampled_from(FAULTS))
    if fault == "text":
        return path, draw(values | st.binary(max_size=40))
    fields = FIELDS[path]
    # the route's own field, and each other one time in three
    pairs = [
        (_quote(name), draw(VALID[name]))
        for name in fields
        if name == fields[0] or draw(st.integers(0, 2)) == 0
    ]
    pairs += draw(st.lists(st.tuples(clean_keys, clean_values), max_size=3))
    if fault == "type":  # the route's own field as often as all the others
        for name in draw(
            st.lists(
                st.sampled_from([fields[0]] * len(fields) + list(fields)), min_size=1, max_size=2
            )
        ):
            pairs = [pair for pair in pairs if pair[0] != _quote(name)]
            pairs.append((_quote(name), draw(ODD[name])))
    elif fault == "dirty":  # most often in a field the gateway does not read
        where = draw(st.sampled_from(["unread", "unread", "read", "key"]))
        if where == "key":
            pairs.append((draw(dirty_strings), draw(clean_values)))
        else:
            names = fields if where == "read" else ("user", "temperature", "deployment")
            key = _quote(draw(st.sampled_from(names)))
            pairs = [pair for pair in pairs if pair[0] != key]
            pairs.append((key, draw(dirty_values)))
    duplicate = draw(st.booleans())
    if duplicate:
        key, _ = draw(st.sampled_from(pairs))
        pairs.append((key, draw(clean_values)))
    return path, _object(draw(st.permutations(pairs)))


def _token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(type(item) is int and 0 <= item < INT32_END for item in value)
    )


def _prompt_fits(value: Any) -> bool:
    if isinstance(value, str):
        return True
    if not isinstance(value, list) or not value:
        return False
    return (
        all(isinstance(item, str) for item in value)
        or _token_ids(value)
        or all(_token_ids(item) for item in value)
    )


def fits_the_contract(path: str, body: dict[str, Any]) -> bool:
    """Whether a body the engine received is one the gateway's contract allows (written
    here independently of ``sbproxy/api/bodies.py``)."""
    if path == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return False
        if not all(isinstance(m, dict) and m.get("role") in ROLES for m in messages):
            return False
    if path == COMPLETIONS and not _prompt_fits(body.get("prompt")):
        return False
    if path == EMBEDDINGS and not _prompt_fits(body.get("input")):
        return False
    limits_fit = all(
        body.get(name) is None or (type(body[name]) is int and 0 < body[name] < INT32_END)
        for name in LIMITS
    )
    return (
        limits_fit
        and isinstance(body.get("model"), str | None)
        and isinstance(body.get("stream"), bool | None)
    )


async def test_no_generated_body_gets_a_5xx_and_the_engine_gets_only_valid_ones(
    tmp_path: Path,
) -> None:
    log = tmp_path / "requests.jsonl"
    answered: list[int] = []
    async with served(tmp_path, mode=f"requests_log={log},token_delay_s=0") as host:
        http = httpx.Client(base_url=host.gateway_url, timeout=30)

        @settings(
            max_examples=EXAMPLES,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(requests())
        def property_(request: tuple[str, bytes]) -> None:
            path, body = request
            answer = http.post(path, content=body, headers={"Content-Type": "application/json"})
            assert answer.status_code < 500, (answer.status_code, answer.text, body[:200])
            answered.append(answer.status_code)
            if answer.status_code >= 400:
                error = answer.json()["error"]  # the gateway's envelope, not the engine's
                assert error["code"] in OWN_CODES, (error, body[:200])
                assert error["message"], body[:200]
                if error["code"] == "invalid_request":
                    assert "`" in error["message"] or "number too large" in error["message"]
            else:
                assert b'"error"' not in answer.content, (answer.content[:300], body[:200])

        # The server runs on this event loop; the synchronous property runs in a thread.
        with http:
            await anyio.to_thread.run_sync(property_)
    received = [json.loads(line) for line in log.read_text().splitlines() if '"body"' in line]
    misfits = [r for r in received if not fits_the_contract(r["path"], r["body"])]
    assert misfits == []
    # the run reached the engine as well as the checks, on every route, streamed and not
    reached = {(r["path"], r["body"].get("stream") is True) for r in received}
    assert reached == {(path, streamed) for path in FIELDS for streamed in (True, False)}
    assert sum(status == 200 for status in answered) >= EXAMPLES // 10
    assert sum(400 <= status < 500 for status in answered) >= EXAMPLES // 10
