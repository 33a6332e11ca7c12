"""Property-based runs of schemathesis against the admin OpenAPI of a real ``sbproxy serve``.

With HTTP Basic credentials, generated requests (valid and malformed) to every documented
operation must never get a 5xx (``not_a_server_error``); without credentials every
operation answers 401, never a 5xx."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Err

from tests.api.test_serve import PASSWORD, write_config
from tests.model_host.engines.support import free_port

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 25
AUTH = ("admin", PASSWORD)


@pytest.fixture(scope="module")
def admin_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("schemathesis")
    gateway_port, admin_port = free_port(), free_port()
    config = write_config(root, gateway_port, admin_port)
    log = (root / "serve.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "sbproxy.cli", "serve", "-f", str(config)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    url = f"http://127.0.0.1:{admin_port}"
    try:
        for _ in range(300):
            assert process.poll() is None, (root / "serve.log").read_text()
            try:
                if httpx.get(f"{url}/admin/model-host/status", auth=AUTH).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            subprocess.run(["sleep", "0.05"], check=True)
        else:
            pytest.fail("sbproxy serve did not answer on the admin listener")
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _operations(url: str) -> list[Any]:
    schema = schemathesis.openapi.from_url(f"{url}/schema/openapi.json")
    operations = []
    for result in schema.get_all_operations():
        if isinstance(result, Err):  # the document itself is broken: that is a failure too
            raise result.err()
        operations.append(result.ok())
    assert operations, "the admin OpenAPI document lists no operations"
    return operations


def _strategy(operation: Any) -> st.SearchStrategy[Any]:
    return st.one_of(
        operation.as_strategy(GenerationMode.POSITIVE),
        operation.as_strategy(GenerationMode.NEGATIVE),
    )


def _describe(case: Any, response: Any) -> str:
    return (
        f"{case.method} {case.formatted_path} query={case.query} body={case.body!r} -> "
        f"{response.status_code}: {response.text[:500]}"
    )


def test_authenticated_requests_never_get_a_server_error(admin_url: str) -> None:
    failures: list[str] = []
    for operation in _operations(admin_url):

        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=_strategy(operation))
        def run(case: Any) -> None:
            response = case.call(base_url=admin_url, auth=AUTH, timeout=10)
            try:
                case.validate_response(response, checks=[not_a_server_error])
            except Exception:
                failures.append(_describe(case, response))
                raise

        before = len(failures)
        try:
            run()
        except Exception as error:  # noqa: BLE001 - collected: one report for all operations
            if len(failures) == before:  # not a 5xx: a transport or generation error
                failures.append(f"{operation.method.upper()} {operation.path}: {error!r}")
    assert not failures, "\n".join(dict.fromkeys(failures))


def test_every_operation_answers_401_without_credentials(admin_url: str) -> None:
    answers: dict[str, int] = {}
    for operation in _operations(admin_url):
        seen: list[int] = []

        @settings(
            max_examples=3,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(GenerationMode.POSITIVE))
        def run(case: Any) -> None:
            # run() is called within this iteration: the closure sees this operation's list.
            seen.append(case.call(base_url=admin_url, timeout=10).status_code)  # noqa: B023
            wrong = case.call(base_url=admin_url, auth=("admin", "wrong"), timeout=10)
            seen.append(wrong.status_code)  # noqa: B023

        run()
        answers[f"{operation.method.upper()} {operation.path}"] = max(seen)
        assert set(seen) == {401}, (operation.path, seen)
    assert answers


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=8,
)
_BODIES = st.one_of(
    _JSON.map(lambda value: json.dumps(value).encode()),
    st.fixed_dictionaries({"deployment": _JSON}).map(lambda value: json.dumps(value).encode()),
    st.fixed_dictionaries({"model": _JSON}).map(lambda value: json.dumps(value).encode()),
    st.binary(max_size=64),
)


def test_bodies_the_schema_does_not_describe_never_get_a_server_error(admin_url: str) -> None:
    """The load/stop/drain/reset handlers read the raw body, so the document has no request
    body for schemathesis to fuzz: send arbitrary JSON and bytes to every write operation
    without path parameters."""
    paths = [
        (operation.method.upper(), operation.path)
        for operation in _operations(admin_url)
        if operation.method.upper() in {"POST", "PUT", "PATCH"} and "{" not in operation.path
    ]
    assert paths
    failures: list[str] = []
    with httpx.Client(base_url=admin_url, auth=AUTH, timeout=10) as client:
        for method, path in paths:

            @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True)
            @given(body=_BODIES)
            def run(body: bytes) -> None:
                response = client.request(
                    method,  # noqa: B023 - run() is called within this iteration
                    path,  # noqa: B023
                    content=body,
                    headers={"Content-Type": "application/json"},
                )
                if response.status_code >= 500:
                    failures.append(
                        f"{method} {path} body={body!r} -> "  # noqa: B023
                        f"{response.status_code}: {response.text[:500]}"
                    )

            run()
    assert not failures, "\n".join(failures)
