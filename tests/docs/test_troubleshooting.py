"""docs/troubleshooting.md has an entry for every reason code the code base can produce."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from tests.docs.reason_codes import PACKAGE, reason_codes

PAGE = PACKAGE.parent / "docs" / "troubleshooting.md"
ENTRY = re.compile(r"^### `([a-z][a-z0-9_]*)`$", re.MULTILINE)


def _entries() -> dict[str, str]:
    """Each entry's code and its text (up to the next heading)."""
    text = PAGE.read_text()
    found: dict[str, str] = {}
    matches = list(ENTRY.finditer(text))
    for match, following in zip(matches, [*matches[1:], None], strict=True):
        end = following.start() if following else len(text)
        body = text[match.end() : end].split("\n## ", 1)[0]
        assert match[1] not in found, f"{match[1]} has two entries"
        found[match[1]] = body.strip()
    return found


def test_every_reason_code_has_an_entry() -> None:
    codes = reason_codes()
    missing = sorted(set(codes) - set(_entries()))
    assert not missing, "docs/troubleshooting.md has no `### `<code>`` entry for: " + "; ".join(
        f"{code} ({', '.join(sorted(codes[code])[:2])})" for code in missing
    )


def test_every_entry_names_a_code_that_exists() -> None:
    stale = sorted(set(_entries()) - set(reason_codes()))
    assert not stale, f"entries for codes nothing produces any more: {stale}"


def test_every_entry_says_something() -> None:
    short = [code for code, body in _entries().items() if len(body.split()) < 15]
    assert short == []


def test_the_scan_finds_codes_in_each_form(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text(
        textwrap.dedent(
            """
            GONE = "const_code"
            TABLE = {1: "table_code"}

            class E(Exception):
                default_code = "default_code_code"

            def _code(status):
                return TABLE.get(status, "fallback_code")

            def f(exc, job, note, manager):
                raise E("x", code="keyword_code")
                E("x", code=job.code if job else "conditional_code")
                E("x", code=str(job or "or_code"))
                E("x", code=_code(1))
                E("x", reason_code=GONE)
                Info("positional_code", "message")
                if exc.code in ("compared_code",):
                    pass
                note.outcome = "outcome_code"
                code = "assigned_code"
                manager.stop("d", reason="stop_code")
                return {"code": "dict_code"}

            class Info:
                code: str
                message: str
            """
        )
    )
    found = set(reason_codes(package))
    expected = {
        "const_code",
        "table_code",
        "default_code_code",
        "fallback_code",
        "keyword_code",
        "conditional_code",
        "or_code",
        "positional_code",
        "compared_code",
        "outcome_code",
        "assigned_code",
        "stop_code",
        "dict_code",
    }
    assert expected <= found
    # Admission reasons come from the enum, whatever the package scanned.
    assert {"queue_full", "queue_timeout", "insufficient_capacity"} <= found
