"""The headers an error answer carries: ``Retry-After`` for a retryable one, and
``X-Sbproxy-Engine-Reached: no`` for an engine failure that sent nothing -- what lets a
calling host send a hop elsewhere without running a generation twice (issue 30, item 25)."""

from __future__ import annotations

from sbproxy.api.errors import ENGINE_REACHED, error_payload
from sbproxy.api.relay import UpstreamUnavailable


def _headers(error: UpstreamUnavailable) -> dict[bytes, bytes]:
    status, _, headers = error_payload(error, surface="gateway")
    assert status == 502
    return dict(headers)


def test_an_engine_failure_that_sent_nothing_says_so() -> None:
    sent_nothing = UpstreamUnavailable("refused", details={ENGINE_REACHED: False})
    headers = _headers(sent_nothing)
    assert headers[b"x-sbproxy-engine-reached"] == b"no"
    assert headers[b"retry-after"] == b"1"


def test_an_engine_failure_that_may_have_run_it_says_nothing_of_the_kind() -> None:
    for details in ({ENGINE_REACHED: True}, {}):
        headers = _headers(UpstreamUnavailable("reset", details=details))
        assert b"x-sbproxy-engine-reached" not in headers
