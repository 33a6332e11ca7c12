"""Secrets are removed from anything that is persisted or logged."""

from __future__ import annotations

import pytest

from sbproxy.redact import REDACTED, redact, register_secret


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("GET failed: Authorization: Bearer abc.def-123", "abc.def-123"),
        ("header authorization=Basic dXNlcjpwYXNz", "dXNlcjpwYXNz"),
        ("401 for Bearer hf_AbCdEfGhIjKlMnOpQrStUvWx", "hf_AbCdEfGhIjKlMnOpQrStUvWx"),
        ("token hf_AbCdEfGhIjKlMnOpQrStUvWx leaked", "hf_AbCdEfGhIjKlMnOpQrStUvWx"),
        ('{"password": "hunter2!", "user": "admin"}', "hunter2!"),
        ("login with password=s3cr3t&user=a", "s3cr3t"),
        ("fetch https://alice:pa55word@mirror.example/x failed", "pa55word"),
        ("Proxy-Authorization: Digest username=x, response=abcdef", "response=abcdef"),
    ],
)
def test_recognised_secrets_are_redacted(text: str, secret: str) -> None:
    cleaned = redact(text)
    assert secret not in cleaned
    assert REDACTED in cleaned


def test_registered_secret_is_redacted_anywhere() -> None:
    register_secret("correct-horse-battery")
    assert redact("the value correct-horse-battery appeared") == f"the value {REDACTED} appeared"


def test_ordinary_text_is_unchanged() -> None:
    text = "download of model.gguf failed after 4096 bytes: connection reset (retrying)"
    assert redact(text) == text
