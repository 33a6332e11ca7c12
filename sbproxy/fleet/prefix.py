"""Prefix-cache-aware routing: the replica a request's prompt prefix belongs to, chosen the
same way by every gateway without any of them talking to another (issue 34, item 1).

llama-server keeps each slot's last prompt and, in host memory, earlier prompts
(``cache_prompt``, on by default in the pinned build; ``--cache-ram``): a request whose
prompt starts like one a replica processed before skips the prefill of that part. Sending
the requests that share a prefix to the same replica is what makes the cache pay.

The key (:func:`prefix_key`): a 16-byte BLAKE2b digest of the request's *head*, cut at
:data:`PREFIX_BLOCK_BYTES`:

* ``/v1/chat/completions``: the leading ``system``/``developer`` messages (the system
  prompt), or the first message when the conversation starts with another role, in a
  canonical JSON encoding (keys sorted, no whitespace), cut to its first block. Every turn of
  a conversation extends the previous one, so the replica that served turn *n* holds the
  longest cached prefix of turn *n + 1*; a key that grew with the conversation would move it
  to another replica at each turn. Keying on the head keeps a conversation, and every caller
  of one system prompt, on one replica; two heads that differ only after the first block
  share that block in the cache anyway.
* ``/v1/completions``: the first block of the prompt (its UTF-8 bytes; a list prompt in its
  canonical JSON encoding).
* anything else (embeddings), or a body with no head: no key -- the request is routed by
  least outstanding, as without prefix routing.

The choice (:func:`choose`): rendezvous hashing (highest random weight) of the key over the
routable replicas' ids -- each replica gets the weight ``BLAKE2b(key || id)``, the heaviest
wins -- so gateways that see the same replicas pick the same one, and a replica that leaves
moves only its own keys (each to its next in order). Bounded by load, as in consistent
hashing with bounded loads: with ``total`` requests in flight and queued over ``n``
replicas, a replica takes the request only while its own count is below
``ceil(LOAD_FACTOR * (total + 1) / n)``; the request goes to the next replica in rendezvous
order otherwise -- one hot prefix spreads over more replicas instead of queueing on one. Some
replica is always below the bound (the least loaded holds at most ``total / n``, and the
bound is at least ``(total + 1) / n``), so no request is refused for it.

Pure functions and values: no I/O, no clock, no state.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

import msgspec

__all__ = [
    "LOAD_FACTOR",
    "PREFIX_BLOCK_BYTES",
    "Choice",
    "PrefixOutcome",
    "choose",
    "load_bound",
    "prefix_key",
    "rendezvous_order",
]

PREFIX_BLOCK_BYTES: Final = 4096
"""How much of a request's head the key covers, in bytes of its encoding (about 1,000 tokens
of English text)."""

LOAD_FACTOR: Final = 1.25
"""How far above its fair share of the requests in flight a replica may go before the next
one in rendezvous order takes its prefixes' requests."""

_HEAD_ROLES: Final = frozenset({"system", "developer"})
_CANONICAL: Final = msgspec.json.Encoder(order="sorted")


class PrefixOutcome(StrEnum):
    """How a prefix-routed request found its replica (the metric's ``outcome`` label)."""

    FIRST_CHOICE = "first_choice"
    """The rendezvous first choice: the replica that most likely holds the prefix."""
    LOAD_BOUND = "load_bound"
    """The first choice was at its load bound; a later one in rendezvous order took it."""
    NO_PREFIX = "no_prefix"
    """The request has no head to key on: routed by least outstanding."""


@dataclass(frozen=True, slots=True)
class Choice:
    """Where a keyed request goes: the replica id and how it was found."""

    replica: str
    outcome: PrefixOutcome


def _digest(material: bytes) -> bytes:
    return hashlib.blake2b(material[:PREFIX_BLOCK_BYTES], digest_size=16).digest()


def prefix_key(path: str, document: Mapping[str, Any]) -> bytes | None:
    """The prefix key of a checked request body (``document``, decoded) sent to ``path``;
    ``None`` when it has none (see the module docstring)."""
    if path == "/v1/chat/completions":
        messages = document.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        end = 0
        for message in messages:
            if not (isinstance(message, dict) and message.get("role") in _HEAD_ROLES):
                break
            end += 1
        return _digest(_CANONICAL.encode(messages[: end or 1]))
    if path == "/v1/completions":
        prompt = document.get("prompt")
        if isinstance(prompt, str):
            return _digest(prompt.encode()) if prompt else None
        if isinstance(prompt, list) and prompt:
            return _digest(_CANONICAL.encode(prompt))
    return None


def rendezvous_order(key: bytes, replicas: Iterable[str]) -> list[str]:
    """``replicas`` (ids) from the heaviest to the lightest for ``key``: the weight of each
    is the BLAKE2b digest of the key and its id (ties, which need equal digests, by id)."""

    def weight(replica: str) -> tuple[bytes, str]:
        return hashlib.blake2b(key + replica.encode(), digest_size=8).digest(), replica

    return sorted(replicas, key=weight, reverse=True)


def load_bound(total: int, replicas: int, factor: float = LOAD_FACTOR) -> int:
    """The most requests a replica may hold, this one counted, when ``total`` are in flight
    and queued over ``replicas`` replicas: ``ceil(factor * (total + 1) / replicas)``, at
    least 1.

    Raises:
        ValueError: ``replicas`` < 1, ``total`` < 0 or ``factor`` < 1 (a caller bug).
    """
    if replicas < 1 or total < 0 or factor < 1:
        raise ValueError(
            f"need replicas >= 1, total >= 0 and factor >= 1, got {replicas}, {total}, {factor}"
        )
    return max(1, math.ceil(factor * (total + 1) / replicas))


def choose(key: bytes, loads: Mapping[str, int], factor: float = LOAD_FACTOR) -> Choice | None:
    """The replica for a request with prefix ``key`` among ``loads`` (each routable replica's
    id and its requests in flight plus queued, as this gateway knows them): the first in
    rendezvous order below its load bound (:func:`load_bound`; one always is); ``None`` when
    ``loads`` is empty.

    Raises:
        ValueError: a negative load, or ``factor`` < 1 (a caller bug).
    """
    if not loads:
        return None
    if min(loads.values()) < 0:
        raise ValueError(f"loads must be >= 0, got {dict(loads)}")
    order = rendezvous_order(key, loads)
    bound = load_bound(sum(loads.values()), len(order), factor)
    rank, replica = next((i, r) for i, r in enumerate(order) if loads[r] < bound)
    return Choice(replica, PrefixOutcome.FIRST_CHOICE if rank == 0 else PrefixOutcome.LOAD_BOUND)
