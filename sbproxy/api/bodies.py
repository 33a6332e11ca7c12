"""What the gateway checks and completes in an OpenAI request body before it is forwarded.

Checked (a body that is not JSON is a 400 ``invalid_body``; a bad request a 400
``invalid_request``; both of OpenAI type ``invalid_request_error``, naming the field, and
never forwarded to the engine):

* ``/v1/chat/completions``: ``messages`` is a non-empty list of objects, each with a
  ``role`` among :data:`ROLES`;
* ``/v1/completions``: ``prompt`` is a string or a non-empty list (of strings or token ids);
* ``/v1/embeddings``: ``input`` is a string or a non-empty list;
* everywhere: ``max_tokens``, ``max_completion_tokens`` and ``n_predict``, when set, are
  positive integers; ``stream`` is a boolean.

Completed: a request that sets none of ``max_tokens``, ``max_completion_tokens`` or
``n_predict`` gets ``max_tokens`` = the deployment's ``max_output_tokens`` (never more than
its context), so an answer that would not end stops in seconds instead of at the context
limit. The body is re-encoded only then (and for a streamed chat's ``include_usage``); the
others are forwarded byte for byte.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from sbproxy.api.errors import ApiError, InvalidBody

__all__ = [
    "ROLES",
    "ChatNotSupported",
    "Head",
    "InvalidRequest",
    "check_body",
    "decode_head",
    "with_fields",
]

ROLES: Final = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
"""Message roles OpenAI-compatible engines accept."""

LIMIT_FIELDS: Final = ("max_tokens", "max_completion_tokens", "n_predict")


class InvalidRequest(ApiError):
    """An OpenAI body that is well-formed JSON but not a valid request (``invalid_request``,
    400, OpenAI type ``invalid_request_error``)."""

    default_code = "invalid_request"


class ChatNotSupported(ApiError):
    """A chat completion for a completion-only (base) model (``chat_not_supported``, 400):
    its catalog variant has no chat template; ``/v1/completions`` serves it."""

    default_code = "chat_not_supported"


class Head(msgspec.Struct):
    """The fields of an OpenAI request body the gateway reads (others are skipped)."""

    model: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    messages: Any = msgspec.UNSET
    prompt: Any = msgspec.UNSET
    input: Any = msgspec.UNSET
    max_tokens: Any = msgspec.UNSET
    max_completion_tokens: Any = msgspec.UNSET
    n_predict: Any = msgspec.UNSET

    @property
    def sets_a_limit(self) -> bool:
        """Whether the request bounds its own answer length."""
        return any(getattr(self, name) not in (msgspec.UNSET, None) for name in LIMIT_FIELDS)


_HEAD: Final = msgspec.json.Decoder(Head)
_DOCUMENT: Final = msgspec.json.Decoder()
_ENCODER: Final = msgspec.json.Encoder()


def decode_head(body: bytes) -> Head:
    """The :class:`Head` of ``body``.

    Raises:
        InvalidBody: ``invalid_body`` (400) -- not a JSON object, a field of the wrong type
            (msgspec names it), or nested too deeply.
    """
    try:
        return _HEAD.decode(body)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise InvalidBody(f"the body is not a valid request: {exc}") from None
    except RecursionError:
        raise InvalidBody("the body is nested too deeply") from None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_body(path: str, head: Head) -> None:
    """Refuse a body the engine would choke on (see the module docstring).

    Raises:
        InvalidRequest: ``invalid_request``, naming the field and what it must be.
    """
    if path == "/v1/chat/completions":
        messages = head.messages
        if messages is msgspec.UNSET or not isinstance(messages, list) or not messages:
            raise InvalidRequest("`messages` must be a non-empty list of {role, content} objects")
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                raise InvalidRequest(f"`messages[{index}]` must be an object with a role")
            role = message.get("role")
            if role not in ROLES:
                raise InvalidRequest(
                    f"`messages[{index}].role` must be one of {', '.join(sorted(ROLES))}"
                    f" (got {role!r})"
                )
    elif path == "/v1/completions":
        prompt = head.prompt
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt)):
            raise InvalidRequest("`prompt` must be a string or a non-empty list")
    elif path == "/v1/embeddings":
        given = head.input
        if not (isinstance(given, str) or (isinstance(given, list) and given)):
            raise InvalidRequest("`input` must be a string or a non-empty list")
    for name in LIMIT_FIELDS:
        value = getattr(head, name)
        if value not in (msgspec.UNSET, None) and not _positive_int(value):
            raise InvalidRequest(f"`{name}` must be a positive integer (got {value!r})")


def with_fields(body: bytes, fields: dict[str, Any]) -> bytes:
    """``body`` (a JSON object) with ``fields`` set, re-encoded."""
    document = _DOCUMENT.decode(body)
    document.update(fields)
    encoded: bytes = _ENCODER.encode(document)
    return encoded
