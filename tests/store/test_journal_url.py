"""Which journal URLs are usable, and where an unusable one is refused (``invalid_journal_url``):
at config load (the field's validator, naming ``proxy.model_host.journal.url``), where a
process chooses its journal (``journal_location``: the config, ``$SBPROXY_JOURNAL_URL``) and
where a URL is opened (``open_journal``). No message carries the URL's password."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbproxy.config import load_config_text
from sbproxy.config.journal_url import journal_url_problem
from sbproxy.errors import ConfigError, SbproxyError
from sbproxy.store import check_journal_url, journal_location, open_journal

SECRET = "pw-xyz"

USABLE = [
    "postgresql://sb@db.internal:5432/jobs",
    f"postgresql://sb:{SECRET}@db/jobs?sslmode=verify-full",
    "postgres://db/jobs",
    "postgresql://10.0.0.5/jobs",
    "postgresql://[::1]:5433/jobs",
    "postgresql://db-a:5432,db-b:5433/jobs?target_session_attrs=read-write",
    "postgresql:///jobs?host=/var/run/postgresql",
    "postgresql:///?service=sbproxy",
    "postgresql://sb@pgbouncer:6432/jobs?prepare_threshold=none",
]

UNUSABLE = [
    ("postgresql://@:5432", "names no server host"),
    (f"postgres://user:{SECRET}@/db", "names no server host"),
    ("postgresql:///jobs", "names no server host"),
    ("garbage", "is not a URL"),
    ("", "is empty"),
    (f"mysql://sb:{SECRET}@db/jobs", "has the scheme mysql://"),
    (f"sqlite:///{SECRET}/journal.db", "has the scheme sqlite://"),
    (f"postgresql://sb:{SECRET}@db:99999/jobs", "port that is not a number"),
    (f"postgresql://sb:{SECRET}@db:port/jobs", "port that is not a number"),
    ("postgresql://[::1/jobs", "not a well-formed URL"),
    (f"postgresql://sb:{SECRET}@db/jobs name", "spaces or control characters"),
    ("postgresql://db-a,/jobs", "lists a server without a host"),
]


@pytest.mark.parametrize("url", USABLE)
def test_a_url_naming_a_server_is_usable(url: str) -> None:
    assert journal_url_problem(url) is None
    assert check_journal_url(url, source="$X") == url


@pytest.mark.parametrize(("url", "problem"), UNUSABLE)
def test_a_url_that_names_no_server_is_refused_with_its_problem(url: str, problem: str) -> None:
    found = journal_url_problem(url)
    assert found is not None and problem in found
    assert SECRET not in found


def test_what_only_libpq_refuses_is_invalid_too() -> None:
    with pytest.raises(SbproxyError) as info:
        check_journal_url(f"postgresql://sb:{SECRET}@db/jobs?no_such_option=1", source="--to")
    assert info.value.code == "invalid_journal_url"
    assert "--to" in info.value.message and "no_such_option" in info.value.message
    assert SECRET not in str(info.value)


def test_the_config_refuses_a_malformed_url_naming_its_field() -> None:
    text = f"proxy:\n  model_host:\n    journal:\n      url: postgres://user:{SECRET}@/db\n"
    with pytest.raises(ConfigError) as info:
        load_config_text(text, source="sb.yml")
    assert info.value.code == "invalid_journal_url"
    (issue,) = info.value.issues
    assert issue.path == "proxy.model_host.journal.url"
    assert "names no server host" in issue.message and "invalid_journal_url" in issue.message
    assert SECRET not in str(info.value)


def test_other_problems_beside_the_url_keep_invalid_config() -> None:
    text = (
        "proxy:\n  http_bind_port: -1\n  model_host:\n    journal:\n"
        "      url: postgresql://@:5432\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config_text(text, source="sb.yml")
    assert info.value.code == "invalid_config"
    assert "proxy.model_host.journal.url" in {issue.path for issue in info.value.issues}


def test_the_environment_s_url_is_refused_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SBPROXY_JOURNAL_URL", f"postgresql://sb:{SECRET}@:5432/jobs")
    with pytest.raises(SbproxyError) as info:
        journal_location(tmp_path / "journal.db")
    assert info.value.code == "invalid_journal_url"
    assert info.value.retryable is False
    assert info.value.message.startswith("$SBPROXY_JOURNAL_URL is not a usable journal URL")
    assert SECRET not in str(info.value)


def test_the_config_s_url_wins_over_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SBPROXY_JOURNAL_URL", "postgresql://from-env/jobs")
    compiled = load_config_text(
        "proxy:\n  model_host:\n    journal:\n      url: postgresql://from-config/jobs\n"
    )
    assert journal_location(tmp_path / "j.db", compiled.model_host) == (
        "postgresql://from-config/jobs"
    )
    assert journal_location(tmp_path / "j.db") == "postgresql://from-env/jobs"
    monkeypatch.delenv("SBPROXY_JOURNAL_URL")
    assert journal_location(tmp_path / "j.db") == tmp_path / "j.db"


@pytest.mark.anyio
async def test_open_journal_refuses_a_malformed_url_before_any_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for url in ("postgresql://@:5432", f"mysql://sb:{SECRET}@db/jobs"):
        with pytest.raises(SbproxyError) as info:
            await open_journal(url)
        assert info.value.code == "invalid_journal_url"
        assert SECRET not in str(info.value)
    assert list(tmp_path.iterdir()) == []  # nothing taken for a SQLite file name either
