"""The admin_managed revision store in a shared PostgreSQL journal: hosts read one desired
state, and of two writing at once one wins and the other gets ``revision_conflict``."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pytest

from sbproxy.errors import SbproxyError
from sbproxy.model_host.runtime.desired_store import (
    DeploymentRevision,
    RevisionConflict,
    RevisionStore,
)
from sbproxy.store import Database
from tests.support.postgres import PostgresServer


@pytest.fixture
def journal_url(postgres_server: PostgresServer) -> str:
    url = postgres_server.create_database()

    async def migrate() -> None:
        await (await Database.open(url)).close()

    anyio.run(migrate)
    return url


def test_two_hosts_share_one_desired_state(journal_url: str, tmp_path: Path) -> None:
    first = RevisionStore(tmp_path / "a" / "desired.json", journal_url=journal_url)
    second = RevisionStore(tmp_path / "b" / "desired.json", journal_url=journal_url)
    assert first.load() is None
    written = first.compare_and_set(
        expected_revision=None, catalog_revision="c1", deployments={"chat": {"model": "m"}}
    )
    assert written.revision == 1
    seen = second.load()
    assert seen == written  # the same document, digest checked on read
    assert not (tmp_path / "a" / "desired.json").exists()  # nothing beside sb.yml
    with pytest.raises(RevisionConflict) as stale:
        second.compare_and_set(expected_revision=None, catalog_revision="c1", deployments={})
    assert stale.value.details == {"expected_revision": None, "actual_revision": 1}


def test_concurrent_writers_get_one_winner_and_one_conflict(
    journal_url: str, tmp_path: Path
) -> None:
    stores = [RevisionStore(tmp_path / f"{i}.json", journal_url=journal_url) for i in range(2)]
    stores[0].compare_and_set(expected_revision=None, catalog_revision="c", deployments={})
    start = threading.Barrier(2)
    outcomes: list[DeploymentRevision | SbproxyError] = []

    def write(store: RevisionStore, name: str) -> None:
        start.wait()
        try:
            outcomes.append(
                store.compare_and_set(
                    expected_revision=1, catalog_revision="c", deployments={name: {"model": name}}
                )
            )
        except SbproxyError as exc:
            outcomes.append(exc)

    threads = [
        threading.Thread(target=write, args=(store, f"d{i}")) for i, store in enumerate(stores)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    won = [o for o in outcomes if isinstance(o, DeploymentRevision)]
    lost = [o for o in outcomes if isinstance(o, SbproxyError)]
    assert len(won) == 1 and len(lost) == 1
    assert won[0].revision == 2
    assert lost[0].code == "revision_conflict"
    assert lost[0].details == {"expected_revision": 1, "actual_revision": 2}
    assert stores[1].load() == won[0]
