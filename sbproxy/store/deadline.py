"""Client-side deadlines on PostgreSQL connections (the journal's and the fleet store's).

A server that stops answering without closing anything -- a dropped route, a dead switch, a
relay that swallows bytes, a frozen (``SIGSTOP``) postmaster -- leaves a client blocked in
``recv`` for ever: the peer's kernel (or the relay) still acknowledges what it sends, so
neither TCP keepalives nor ``tcp_user_timeout`` end the wait, and a server-side
``statement_timeout`` needs a server that runs. Only a deadline of the client's own does.

:class:`DeadlineConnection` is a psycopg connection whose every wait on its socket -- each
round trip of a statement, a pipeline, a ``COMMIT`` -- gives up after
:attr:`DeadlineConnection.deadline_s`: psycopg's own wait loop takes the timeout (it already
polls the socket in steps, so the deadline adds no round trip and no thread), and on expiry
the connection is closed at once (it was mid-exchange: nothing else could be sent on it) and
:class:`DeadlineExceeded` is raised, a ``psycopg.OperationalError`` on a broken connection,
which the callers already map to ``journal_unavailable`` and reopen at the next call.
:class:`AsyncDeadlineConnection` is the same for psycopg's asyncio connection (the journal's
statement lane, ``lane.py``).

:func:`transport_params` adds the kernel-level bounds to every connection (keepalives on an
idle connection, ``tcp_user_timeout`` on unacknowledged data): they end the cases the kernel
can see (a peer host gone, a cable pulled), which the deadline would also end, but later.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import errors
from psycopg.abc import RV, PQGen
from psycopg.conninfo import conninfo_to_dict

__all__ = [
    "AsyncDeadlineConnection",
    "DeadlineConnection",
    "DeadlineExceeded",
    "transport_params",
]

# libpq's TCP settings for every connection (the URL's own values win): probe an idle
# connection after 10 s, every 3 s, give up after 3 unanswered probes; drop a connection
# whose sent data stays unacknowledged for 10 s.
_TRANSPORT: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 3,
    "keepalives_count": 3,
    "tcp_user_timeout": 10_000,
}
# psycopg's poll step inside a wait (its own default): how often a wait looks at the clock.
_WAIT_INTERVAL_S = 0.1


class _NotRaised(Exception):
    """Stands in for psycopg's wait timeout should a psycopg lack it (tests would say)."""


# psycopg's exception for an expired wait timeout (private: a psycopg.OperationalError).
_WAIT_TIMEOUT: type[BaseException] = getattr(errors, "_WaitTimeout", _NotRaised)


class DeadlineExceeded(psycopg.OperationalError):
    """The server did not answer one round trip within the connection's deadline; the
    connection is closed (``broken``)."""


def transport_params(conninfo: str) -> dict[str, Any]:
    """The keepalive and ``tcp_user_timeout`` parameters to add to a connection to
    ``conninfo``: :data:`_TRANSPORT` less those the URL sets itself."""
    try:
        given = conninfo_to_dict(conninfo)
    except psycopg.Error:
        given = {}
    return {name: value for name, value in _TRANSPORT.items() if name not in given}


class DeadlineConnection(psycopg.Connection[Any]):
    """A psycopg connection whose every wait on the server ends after :attr:`deadline_s`.

    Attributes:
        deadline_s: Seconds one round trip may wait for the server's answer; ``None``: no
            deadline. Set it after :meth:`connect` (the connection handshake has its own
            bound, ``connect_timeout``), and change it between statements as needed.
    """

    deadline_s: float | None = None

    def wait(
        self, gen: PQGen[RV], interval: float = _WAIT_INTERVAL_S, timeout: float | None = None
    ) -> RV:
        """psycopg's wait on ``gen`` with :attr:`deadline_s` as its timeout when the caller
        gives none.

        Raises:
            DeadlineExceeded: no answer within the deadline; the connection is closed.
        """
        bound = self.deadline_s if timeout is None else timeout
        try:
            return super().wait(gen, interval, bound)
        except _WAIT_TIMEOUT:
            if timeout is not None or bound is None:
                raise  # the caller's own timeout (psycopg's cancel, notifies): its to handle
            # The exchange stopped half-way: the connection cannot be used again.
            raise _expired(self, bound) from None


def _expired(
    connection: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], bound: float
) -> DeadlineExceeded:
    """Drop ``connection`` (its exchange stopped half-way) and say why."""
    # Closing the libpq side leaves it ``broken`` (not closed by the caller), as a lost one.
    connection.pgconn.finish()
    return DeadlineExceeded(
        f"no answer from the server within the client-side deadline of {bound:g} s; "
        "the connection was dropped"
    )


class AsyncDeadlineConnection(psycopg.AsyncConnection[Any]):
    """psycopg's asyncio connection whose every wait on the server ends after
    :attr:`deadline_s` (as :class:`DeadlineConnection`).

    Attributes:
        deadline_s: Seconds one round trip may wait for the server's answer; ``None``: no
            deadline.
    """

    deadline_s: float | None = None

    async def wait(
        self, gen: PQGen[RV], interval: float = _WAIT_INTERVAL_S, timeout: float | None = None
    ) -> RV:
        """psycopg's wait on ``gen`` with :attr:`deadline_s` as its timeout when the caller
        gives none.

        Raises:
            DeadlineExceeded: no answer within the deadline; the connection is closed.
        """
        bound = self.deadline_s if timeout is None else timeout
        try:
            return await super().wait(gen, interval, bound)
        except _WAIT_TIMEOUT:
            if timeout is not None or bound is None:
                raise
            raise _expired(self, bound) from None
