"""What the gateway checks and completes in an OpenAI request body before it is forwarded.

Checked, and never forwarded to the engine when wrong (both codes are 400s of OpenAI type
``invalid_request_error`` whose message names the field and what it held):

* ``invalid_body``: the body is not a JSON object of valid UTF-8 -- malformed JSON, bytes
  that are not UTF-8 or an escape that is not a whole UTF-16 character (``"\\ud800"``) in
  any key or value, a top level that is not an object, nesting too deep to decode;
* ``invalid_request``, a JSON object that is not a request the engine can answer:

  * everywhere: ``model`` is a string, ``stream`` a boolean, ``stream_options`` an object
    (each may be null or left out); ``max_tokens``, ``max_completion_tokens`` and
    ``n_predict``, when set (not null), are integers from 1 to 2^31 - 1 (not ``true``, not
    ``5.0``); no value anywhere is a number too large for msgspec to hold (an integer of
    more than 4300 digits, a float beyond 1.8e308);
  * ``/v1/chat/completions``: ``messages`` is a non-empty list of objects, each with a
    ``role`` among :data:`ROLES`;
  * ``/v1/completions``: ``prompt``, and ``/v1/embeddings``: ``input``, is a string, or a
    non-empty list of strings, of token ids, or of non-empty lists of token ids (one
    kind per list); a token id is an integer from 0 to 2^31 - 1 (llama.cpp's
    ``llama_token`` is an ``int32_t``).

Of duplicate keys the last counts, as for the engine (nlohmann/json, llama-server's parser,
keeps the last value: nlohmann/json#375).

The checks stay cheap: one decode of the whole body by msgspec into Python objects (no
slower than the typed decode of the read fields alone it replaced: that one decoded
``messages``, ``prompt`` and ``input`` whole as well, but let the skipped fields through
unchecked), and for a list ``prompt`` or ``input`` one :func:`msgspec.convert` of the list,
in C. Only a refusal does more work, to name the field.

Completed: a request that sets none of ``max_tokens``, ``max_completion_tokens`` or
``n_predict`` gets ``max_tokens`` = the deployment's ``max_output_tokens`` (never more than
its context), so an answer that would not end stops in seconds instead of at the context
limit. The body is re-encoded (from the document decoded for the checks) only then and for
a streamed chat's ``include_usage``; the others are forwarded byte for byte.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final

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

# Both a length limit and a token id are an int32 in llama.cpp.
INT32_END: Final = 2**31


class InvalidRequest(ApiError):
    """An OpenAI body that is well-formed JSON but not a valid request (``invalid_request``,
    400, OpenAI type ``invalid_request_error``)."""

    default_code = "invalid_request"


class ChatNotSupported(ApiError):
    """A chat completion for a completion-only (base) model (``chat_not_supported``, 400):
    its catalog variant has no chat template; ``/v1/completions`` serves it."""

    default_code = "chat_not_supported"


class Head(msgspec.Struct):
    """A decoded request body: the whole ``document`` and the fields read before routing,
    already checked (:func:`decode_head`)."""

    document: dict[str, Any]
    model: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None

    @property
    def sets_a_limit(self) -> bool:
        """Whether the request bounds its own answer length."""
        get = self.document.get
        return (
            get("max_tokens") is not None
            or get("max_completion_tokens") is not None
            or get("n_predict") is not None
        )


_DOCUMENT: Final = msgspec.json.Decoder()
# Error path only: the top-level values undecoded, to find the one that does not decode.
_RAW_FIELDS: Final = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ENCODER: Final = msgspec.json.Encoder()

_TokenId = Annotated[int, msgspec.Meta(ge=0, lt=INT32_END)]
# The list shapes of ``prompt`` and ``input``, by the type of their first item. msgspec
# checks a whole list in C (and refuses bools as ints); only a refusal is looked at in Python.
_LIST_SHAPES: Final[dict[type, Any]] = {
    str: list[str],
    int: list[_TokenId],
    list: list[Annotated[list[_TokenId], msgspec.Meta(min_length=1)]],
}
_DIGITS: Final = re.compile(rb"-?[0-9]+")
# A \uXXXX escape of a UTF-16 surrogate, after a run of backslashes (an odd run escapes the
# ``u``; an even one is escaped backslashes, then a plain ``u``).
_SURROGATE: Final = re.compile(rb"(\\+)u([dD][89a-fA-F][0-9a-fA-F]{2})")


def _describe(value: Any) -> str:
    """``value`` as an error message shows it: short, and no more of the client's text than
    a few dozen characters."""
    if isinstance(value, list):
        return f"a list of {len(value)} items" if value else "an empty list"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, str) and len(value) > 40:
        return f"{_ENCODER.encode(value[:40]).decode()}... ({len(value)} characters)"
    text: str = _ENCODER.encode(value).decode()  # null, true, a number, a short string
    digits = len(text.lstrip("-"))
    return f"a {digits}-digit number" if type(value) is int and digits > 20 else text


def _describe_raw(raw: bytes) -> str:
    """A number too large to decode, as an error message shows it."""
    if _DIGITS.fullmatch(raw):
        return f"a {len(raw.lstrip(b'-'))}-digit number"
    return raw[:40].decode(errors="replace")


def _not_decodable(body: bytes, exc: msgspec.DecodeError | RecursionError) -> ApiError:
    """The refusal of a body msgspec does not decode (error path only: ``body`` is split
    into its top-level values, and each decoded again, to name the field): ``invalid_request``
    for a number too large to hold in an object that is valid JSON, ``invalid_body`` for
    anything else."""
    key = None
    try:
        fields = _RAW_FIELDS.decode(body)  # checks the structure and keys, not the values
    except msgspec.ValidationError:  # JSON, but not an object
        if isinstance(exc, msgspec.ValidationError):
            return InvalidBody("the body must be a JSON object (and holds a number too large)")
    except (msgspec.DecodeError, RecursionError) as malformed:  # the decode stopped before
        exc = malformed
    else:
        for name, raw in fields.items():
            try:
                _DOCUMENT.decode(raw)
            except (msgspec.DecodeError, RecursionError):
                key = name  # else the culprit was an earlier value of a duplicate key
                break
    if isinstance(exc, RecursionError):
        return InvalidBody("the body is nested too deeply")
    where = f" in `{key}`" if key is not None else ""
    if isinstance(exc, msgspec.ValidationError):  # for Any, only a number out of range
        if key in LIMIT_FIELDS:
            text = bytes(fields[key]).strip()
            return InvalidRequest(
                f"`{key}` must be a positive integer below 2^31, got {_describe_raw(text)}"
            )
        return InvalidRequest(
            f"the body holds a number too large{where}: integers may have at most 4300"
            " digits and floats must be below 1.8e308"
        )
    return _not_json(body, exc, where)


def _not_json(body: bytes, exc: msgspec.DecodeError, where: str) -> InvalidBody:
    """The refusal of a body that is not JSON, saying why where msgspec's message does not."""
    try:
        body.decode()
    except UnicodeDecodeError as bad:
        return InvalidBody(
            f"the body is not valid UTF-8{where}: byte {bad.object[bad.start]:#04x} at offset"
            f" {bad.start}"
        )
    half = _half_surrogate(body)
    if half is not None:
        offset, escape = half
        return InvalidBody(
            f"the body is not valid JSON: the escape {escape} at offset {offset} is half of a"
            " UTF-16 surrogate pair (send the character itself, or both halves)"
        )
    return InvalidBody(f"the body is not valid JSON{where}: {exc}")


def _half_surrogate(body: bytes) -> tuple[int, str] | None:
    """The offset and text of the first surrogate escape of ``body`` that is not one half
    of a high-low pair (error path only: msgspec's message for it can read "truncated")."""
    pending: tuple[int, str, int] | None = None  # a high half: offset, escape, end
    for match in _SURROGATE.finditer(body):
        if len(match[1]) % 2 == 0:
            continue
        offset = match.start(2) - 2
        escape = "\\u" + match[2].decode()
        high = match[2][1:2].lower() in (b"8", b"9", b"a", b"b")
        if pending is not None:
            if not high and offset == pending[2]:
                pending = None
                continue
            return pending[:2]
        if not high:
            return offset, escape
        pending = (offset, escape, match.end())
    return None if pending is None else pending[:2]


def decode_head(body: bytes) -> Head:
    """The :class:`Head` of ``body``, decoded whole and checked where every route reads it.

    Raises:
        InvalidBody: ``invalid_body`` (400) -- not JSON, not UTF-8 (anywhere, keys too), not
            a JSON object, or nested too deeply.
        InvalidRequest: ``invalid_request`` (400) -- ``model``, ``stream`` or
            ``stream_options`` of the wrong type, or a number too large to hold.
    """
    try:
        document = _DOCUMENT.decode(body)
    except (msgspec.DecodeError, RecursionError) as exc:  # ValidationError is a DecodeError
        raise _not_decodable(body, exc) from None
    if not isinstance(document, dict):
        raise InvalidBody(f"the body must be a JSON object, got {_describe(document)}")
    model = document.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest(f"`model` must be a string, got {_describe(model)}")
    stream = document.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest(f"`stream` must be true or false, got {_describe(stream)}")
    options = document.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest(f"`stream_options` must be an object, got {_describe(options)}")
    return Head(document, model=model, stream=stream is True, stream_options=options)


def _check_prompt(name: str, value: Any) -> None:
    """Refuse a ``prompt`` or ``input`` that is not a string or a list of one documented
    kind (see the module docstring), naming the first item that does not fit."""
    if isinstance(value, str):
        return
    what = "a string, or a non-empty list of strings, of token ids or of lists of token ids"
    if not isinstance(value, list) or not value:
        raise InvalidRequest(f"`{name}` must be {what}, got {_describe(value)}")
    first = value[0]
    shape = _LIST_SHAPES.get(type(first))
    if shape is None:
        raise InvalidRequest(
            f"`{name}[0]` must be a string, a token id or a list of token ids, got"
            f" {_describe(first)}"
        )
    try:
        msgspec.convert(value, shape)
    except msgspec.ValidationError:
        raise _misfit(name, value) from None


def _token_id(value: Any) -> bool:
    return type(value) is int and 0 <= value < INT32_END


def _misfit(name: str, value: list[Any]) -> InvalidRequest:
    """The refusal naming the first item of ``value`` unlike its first (error path only)."""
    wanted = "a token id (an integer from 0 to 2^31 - 1)"
    if isinstance(value[0], str):
        index = next(i for i, item in enumerate(value) if not isinstance(item, str))
        return InvalidRequest(
            f"`{name}[{index}]` must be a string like `{name}[0]`, got {_describe(value[index])}"
        )
    if type(value[0]) is int:
        index = next(i for i, item in enumerate(value) if not _token_id(item))
        return InvalidRequest(f"`{name}[{index}]` must be {wanted}, got {_describe(value[index])}")
    for index, item in enumerate(value):
        if not isinstance(item, list) or not item:
            return InvalidRequest(
                f"`{name}[{index}]` must be a non-empty list of token ids, got {_describe(item)}"
            )
        for inner, token_id in enumerate(item):
            if not _token_id(token_id):
                return InvalidRequest(
                    f"`{name}[{index}][{inner}]` must be {wanted}, got {_describe(token_id)}"
                )
    raise AssertionError("msgspec refused a list every item of which fits")  # pragma: no cover


def check_body(path: str, head: Head) -> bool:
    """Refuse a body the engine would choke on (see the module docstring).

    Returns:
        Whether the body bounds its own answer length (:attr:`Head.sets_a_limit`, found by
        the same look at the limit fields).

    Raises:
        InvalidRequest: ``invalid_request``, naming the field and what it must be.
    """
    document = head.document
    if path == "/v1/chat/completions":
        messages = document.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest(
                "`messages` must be a non-empty list of {role, content} objects, got"
                f" {_describe(messages)}"
            )
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                raise InvalidRequest(
                    f"`messages[{index}]` must be an object with a role, got {_describe(message)}"
                )
            role = message.get("role")
            if not isinstance(role, str) or role not in ROLES:
                raise InvalidRequest(
                    f"`messages[{index}].role` must be one of {', '.join(sorted(ROLES))}"
                    f" (got {_describe(role)})"
                )
    elif path == "/v1/completions":
        _check_prompt("prompt", document.get("prompt"))
    elif path == "/v1/embeddings":
        _check_prompt("input", document.get("input"))
    limited = False
    for name in LIMIT_FIELDS:
        value = document.get(name)
        if value is None:
            continue
        if not (type(value) is int and 0 < value < INT32_END):
            raise InvalidRequest(
                f"`{name}` must be a positive integer below 2^31, got {_describe(value)}"
            )
        limited = True
    return limited


def with_fields(head: Head, fields: dict[str, Any]) -> bytes:
    """The body of ``head`` with ``fields`` set, re-encoded from its decoded document (which
    is left as it is)."""
    encoded: bytes = _ENCODER.encode({**head.document, **fields})
    return encoded
