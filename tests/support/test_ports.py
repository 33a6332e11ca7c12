"""The tests' port picker: below the ephemeral range, one share per xdist worker, and never
the same port twice in a row of picks."""

from __future__ import annotations

import pytest

from tests.support import ports


def test_ports_picked_together_are_distinct_and_below_the_ephemeral_range() -> None:
    picked = [ports.free_port() for _ in range(200)]
    assert len(set(picked)) == len(picked)
    below = ports._ports_below_ephemeral()
    assert all(port in below for port in picked)


def test_each_xdist_worker_picks_from_its_own_share(monkeypatch: pytest.MonkeyPatch) -> None:
    shares: list[set[int]] = []
    for worker in ("gw0", "gw1", "gw2", "gw3"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
        share = set(ports._this_workers_ports())
        assert ports.free_port() in share
        shares.append(share)
    for index, share in enumerate(shares):
        for other in shares[index + 1 :]:
            assert not share & other
