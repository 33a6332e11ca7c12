"""The PostgreSQL connection strategy of the journal (psycopg 3, libpq).

The journal's repositories (``jobs.py``, ``runtime.py``, ``usage.py``) write one SQL dialect,
the one SQLite reads: ``:name`` / ``?`` parameters, ``BEGIN IMMEDIATE``, ``INSERT ... ON
CONFLICT ... RETURNING``. PostgreSQL reads the same statements but for the parameter style,
so this module does not copy the repositories: :class:`PgConnection` gives a psycopg
connection the few methods of ``sqlite3.Connection`` that the connection threads
(``connection.py``) use, translating each statement text once (``:name`` -> ``%(name)s``,
``?`` -> ``%s``). The writer thread, its group commit and the reader threads stay as they are.

Choices (the issue's note):

* **psycopg 3, synchronous, one connection per store thread** -- the same shape as the SQLite
  writer and readers, so group commit, the shielded hand-over and the fault hooks are shared.
  The writer thread *is* the pool (one connection, its own thread), so ``psycopg_pool``
  would add nothing.
* **Client-side parameter binding** (``ClientCursor``): the journal passes ``None`` to
  ``:max IS NULL`` and compares text parameters with integer columns in places, which
  server-side binding cannot type; the texts are small and fixed.
* **Autocommit off at the driver** -- the threads send ``BEGIN`` / ``COMMIT`` themselves, as
  on SQLite. Writers run ``READ COMMITTED`` (every write is a compare-and-set ``UPDATE ...
  WHERE``, which PostgreSQL re-checks on the newest row version after a lock wait); readers
  run ``REPEATABLE READ READ ONLY``, one snapshot per read as on SQLite.
* **Round trips, not fsyncs, are what a step costs here** (``benchmarks/journal.py``: a
  step was once two transactions of four and five round trips each). Statements that
  answer nothing are held and sent with the next one (:class:`PgConnection`); the hot
  writes -- a step's end together with the next step's start, a submit, a claim with its
  lease-clock read, a finish with its pruning -- are one statement each on PostgreSQL
  (data-modifying ``WITH`` clauses, ``jobs.py``). A transaction that is that one statement
  (``Transaction.last`` with nothing sent before) goes alone, without ``BEGIN`` and
  ``COMMIT``: the server runs it as its own transaction and answers after its commit --
  one message, one round trip; one sent after others travels with the ``COMMIT``.
* **Prepared statements for the hot path.** Planning the journal's statements on the server
  cost more than the commit itself here (``EXPLAIN``: 0.1-0.5 ms each, against a 0.2 ms
  one-row commit), so the statements every step and job run (:func:`prepare_on_server`,
  from ``jobs.py``) are bound on the server and prepared once per connection, and sent
  with the held statements (and the ``COMMIT``) in one pipeline: still one round trip,
  without the planning. Everything else keeps the client-side binding. Behind PgBouncer's
  transaction pooling, ``prepare_threshold=none`` in the URL prepares nothing
  (:attr:`PgTarget.prepared_statements`).
* **Every commit waits for the WAL flush** (the server's ``synchronous_commit``, on by
  default), a step's start included: a start committed without it could be lost in a crash
  of the server after a reader had seen its ``step`` event, and its ``seq`` handed out again
  (sequences roll back with unflushed WAL), breaking the promise that ``seq`` only grows.
* **Leases on the server's clock**: :class:`DatabaseLeaseTime` reads ``clock_timestamp()``
  inside the write transaction after taking a transaction-scoped advisory lock, so lease
  stamps are serialised across hosts exactly as SQLite's write lock serialises them on one
  host: no observer sees a renewal later than its own reading.
* **Connection loss**: a broken connection is reopened at the next ``BEGIN`` (tenacity,
  jittered backoff, a few seconds at most); while it cannot be, every write fails at once with
  ``journal_unavailable`` (503, retryable) naming ``host:port`` -- never the password.
* **A server that goes silent** (a blackholed route, a frozen server: the peer's kernel still
  acknowledges, so TCP keepalives never fire) is bounded by a client-side deadline on every
  round trip (:class:`~sbproxy.store.deadline.DeadlineConnection`: psycopg's own wait with a
  timeout -- no extra round trip, no timer thread): :data:`STATEMENT_DEADLINE_S` without an
  answer and the connection is dropped, the call fails ``journal_unavailable``, and the next
  ``BEGIN`` reopens it. A call that finds its connection lost spends at most
  :data:`RECONNECT_WINDOW_S` + :data:`CONNECT_TIMEOUT_S` reconnecting, then at most the
  deadline on its statement: :data:`UNAVAILABLE_WITHIN_S` in all. Requests that queued for
  the connection's thread while it found the server silent or unreachable (a deadline, a
  failed reconnect) fail at once once the first of them has tried the server once more and
  failed (one outage, one more wait), not one wait each; the link may have come back while
  they waited, and then that try succeeds and they all run. A migration
  (the transaction that takes the migration lock) waits up to :data:`MIGRATION_DEADLINE_S`
  per round trip instead: DDL over a large journal, or another host's migration, may take
  long.

Constraint violations leave :meth:`PgConnection.execute` as :class:`ConstraintViolation`, a
``sqlite3.IntegrityError``, so the repositories' "duplicate key is an answer" paths work on
both backends unchanged.
"""

from __future__ import annotations

import re
import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg
from psycopg import ClientCursor
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import ExecStatus, TransactionStatus
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_random_exponential

from sbproxy.errors import SbproxyError
from sbproxy.store.deadline import DeadlineConnection, DeadlineExceeded, transport_params
from sbproxy.store.leaseclock import LeaseTime

__all__ = [
    "DB_CLOCK",
    "UNAVAILABLE_WITHIN_S",
    "ConstraintViolation",
    "DatabaseLeaseTime",
    "JournalUnavailable",
    "PgConnection",
    "PgTarget",
    "is_postgres_url",
    "is_prepared",
    "prepare_on_server",
    "row_factory",
    "translate",
]

# The name of the server's clock in ``jobs.lease_clock``: one clock for every host.
DB_CLOCK = "postgresql"
# Advisory lock keys (``pg_advisory_xact_lock``): lease stamps, and schema migrations.
LEASE_LOCK_KEY = 0x53425052_4C454153  # "SBPRLEAS"
MIGRATION_LOCK_KEY = 0x53425052_4D494752  # "SBPRMIGR"
# How long one write waits for a lost connection to come back before it is refused (the
# last attempt starts inside the window, and may take its whole connect timeout).
RECONNECT_WINDOW_S = 3.0
# One connection attempt's bound, the handshake included (libpq's minimum is 2 s).
CONNECT_TIMEOUT_S = 3
# How long one round trip waits for the server's answer before the connection is dropped:
# well above any hot statement (milliseconds), under a client's patience.
STATEMENT_DEADLINE_S = 5.0
# The same for a migration's round trips (DDL on a large journal; another host's migration).
MIGRATION_DEADLINE_S = 600.0
# The longest a call waits in a silent outage before it is refused ``journal_unavailable``
# (a reconnect, then a statement that gets no answer): under 15 s, a client's patience.
UNAVAILABLE_WITHIN_S = RECONNECT_WINDOW_S + CONNECT_TIMEOUT_S + STATEMENT_DEADLINE_S

_NAMED = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


def is_postgres_url(location: object) -> bool:
    """Whether ``location`` names a PostgreSQL journal (``postgresql://`` or ``postgres://``)."""
    return isinstance(location, str) and location.split("://", 1)[0] in ("postgresql", "postgres")


class JournalUnavailable(SbproxyError):
    """The journal's database server cannot be reached (``journal_unavailable``, HTTP 503)."""

    default_code = "journal_unavailable"
    default_retryable = True


class ConstraintViolation(sqlite3.IntegrityError):
    """A PostgreSQL constraint violation (unique key, foreign key), shaped as SQLite's."""


@dataclass(frozen=True)
class PgTarget:
    """Where a PostgreSQL journal is: the libpq connection string and what may be shown.

    Attributes:
        conninfo: The URL as given, less ``prepare_threshold`` (libpq reads ``sslmode``,
            ``service``, ``passfile`` and every other parameter from it). Never logged.
        host: Server host (``localhost`` when libpq's default applies).
        port: Server port.
        dbname: Database name.
        user: Role name, or ``None`` (libpq's default).
        prepared_statements: Whether the hot statements are prepared on the server
            (``False`` with ``prepare_threshold=none`` in the URL: behind PgBouncer's
            transaction pooling, whose server sessions change between transactions).
    """

    conninfo: str
    host: str
    port: int
    dbname: str
    user: str | None
    prepared_statements: bool = True

    @classmethod
    def parse(cls, url: str) -> PgTarget:
        """Read ``url``; raises ``invalid_config`` naming the problem (never the password).

        ``prepare_threshold`` (psycopg's name, not libpq's) is taken out of the URL before
        libpq reads it: ``none`` switches server-side prepared statements off, an integer
        keeps them on (the hot statements are prepared at their first use either way).
        """
        url, prepared = _prepare_threshold(url)
        try:
            params = conninfo_to_dict(url)
        except psycopg.ProgrammingError as exc:
            scheme = urlsplit(url).scheme if "://" in url else "?"
            raise SbproxyError(
                f"the journal URL ({scheme}://...) is not a libpq connection URL: "
                f"{_without_secrets(str(exc), url)}",
                code="invalid_config",
                retryable=False,
                remediation="Use postgresql://user@host:port/dbname (proxy.model_host.journal."
                "url or SBPROXY_JOURNAL_URL); put the password in ${ENV} or a pgpass file.",
            ) from None
        host = str(params.get("host") or "localhost").split(",")[0]
        port = int(str(params.get("port") or "5432").split(",")[0])
        dbname = str(params.get("dbname") or params.get("user") or "postgres")
        user = params.get("user")
        return cls(
            conninfo=url,
            host=host,
            port=port,
            dbname=dbname,
            user=None if user is None else str(user),
            prepared_statements=prepared,
        )

    @property
    def prepare_threshold(self) -> int | None:
        """psycopg's ``prepare_threshold`` for connections to this server: its default (5),
        or ``None`` (prepare nothing) when prepared statements are off."""
        return 5 if self.prepared_statements else None

    @property
    def address(self) -> str:
        """``host:port`` (what errors name)."""
        return f"{self.host}:{self.port}"

    def describe(self) -> str:
        """``postgresql://user@host:port/db`` without the password or other parameters."""
        who = f"{self.user}@" if self.user else ""
        return f"postgresql://{who}{self.address}/{self.dbname}"

    def unavailable(self, exc: BaseException | None = None) -> JournalUnavailable:
        """The ``journal_unavailable`` error for this server (one line, no secrets)."""
        reason = ""
        if exc is not None:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            reason = f": {_without_secrets(first, self.conninfo)}"
        return JournalUnavailable(
            f"the job journal's PostgreSQL server {self.address} is unavailable{reason}",
            remediation="Check that the server runs and is reachable (`sbproxy doctor` shows "
            "the journal); a serving host keeps serving and reconnects by itself. Retry then.",
            details={"host": self.host, "port": self.port, "dbname": self.dbname},
        )


def _prepare_threshold(url: str) -> tuple[str, bool]:
    """``url`` without its ``prepare_threshold`` query parameter, and whether server-side
    prepared statements stay on; raises ``invalid_config`` for a value that is neither
    ``none`` nor a non-negative integer."""
    if "://" not in url or "prepare_threshold" not in url:
        return url, True
    parts = urlsplit(url)
    kept: list[tuple[str, str]] = []
    prepared = True
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name != "prepare_threshold":
            kept.append((name, value))
            continue
        if value.strip().lower() in ("none", "null", "off"):
            prepared = False
        elif not value.strip().isdigit():
            raise SbproxyError(
                f"the journal URL's prepare_threshold={value!r} is neither 'none' nor a "
                "non-negative integer",
                code="invalid_config",
                retryable=False,
                remediation="Write prepare_threshold=none to switch server-side prepared "
                "statements off (PgBouncer's transaction pooling), or leave it out.",
            )
    return urlunsplit(parts._replace(query=urlencode(kept))), prepared


def _without_secrets(text: str, conninfo: str) -> str:
    """``text`` with any password of ``conninfo`` blanked out."""
    try:
        password = conninfo_to_dict(conninfo).get("password")
    except psycopg.Error:
        password = None
    return text.replace(str(password), "***") if password else text


class PgRow(tuple[Any, ...]):
    """A row read by position or by column name, as ``sqlite3.Row``."""

    _index: Mapping[str, int]

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return tuple.__getitem__(self, self._index[key])
        return tuple.__getitem__(self, key)

    def keys(self) -> list[str]:
        """Column names in order."""
        return list(self._index)


# Column-name indexes of the result shapes met so far, keyed by their raw names: the journal's
# statements are fixed texts, so there are few. Building them from ``cursor.description``
# (one ``Column`` object per column, per result) cost more than the rows themselves.
_indexes: dict[tuple[bytes | None, ...], Mapping[str, int]] = {}


def _row_factory(cursor: Any) -> Any:
    result = cursor.pgresult
    if result is None or not result.nfields:
        return None
    names = tuple(result.fname(position) for position in range(result.nfields))
    index = _indexes.get(names)
    if index is None:
        index = {(name or b"").decode(): position for position, name in enumerate(names)}
        _indexes[names] = index
    found = index

    def make(values: Sequence[Any]) -> PgRow:
        row = PgRow(values)
        row._index = found
        return row

    return make


row_factory = _row_factory
"""psycopg's row factory for the journal's connections: rows as :class:`PgRow`."""

_translated: dict[str, str] = {}
_translate_lock = threading.Lock()
# Translated texts bound and prepared on the server (see the module docstring).
_prepared: set[str] = set()


def is_prepared(text: str) -> bool:
    """Whether ``text`` (a translated statement) is one the server prepares
    (:func:`prepare_on_server`)."""
    return text in _prepared


def prepare_on_server(*statements: str) -> None:
    """Have these journal statements (SQLite's text) bound on the server and prepared once
    per connection; every parameter of theirs must be typed by its context (no ``:x IS
    NULL`` alone, no text compared with an integer column)."""
    texts = [translate(statement) for statement in statements]
    with _translate_lock:
        _prepared.update(texts)


def translate(sql: str) -> str:
    """The PostgreSQL text of one journal statement (parameters, ``BEGIN IMMEDIATE``)."""
    found = _translated.get(sql)
    if found is not None:
        return found
    text = sql.replace("%", "%%")
    text = _NAMED.sub(r"%(\1)s", text).replace("?", "%s")
    if text.strip().upper() == "BEGIN IMMEDIATE":
        text = "BEGIN"
    with _translate_lock:
        _translated[sql] = text
    return text


class _Cursor:
    """What ``sqlite3.Cursor`` offers the journal: ``rowcount``, ``fetchall``, ``fetchone``."""

    __slots__ = ("_rows", "rowcount")

    def __init__(self, rowcount: int, rows: list[Any]) -> None:
        self.rowcount = rowcount
        self._rows = rows

    def fetchall(self) -> list[Any]:
        return self._rows

    def fetchone(self) -> Any:
        return self._rows[0] if self._rows else None


_local = threading.local()


class PgConnection:
    """A psycopg connection with the ``sqlite3.Connection`` methods the store threads use.

    Owned by one thread. Reconnects (tenacity, :data:`RECONNECT_WINDOW_S`) when a
    transaction begins on a broken connection; a statement on a lost connection, or one the
    server does not answer within ``deadline_s``, raises :class:`JournalUnavailable` (the
    connection is dropped and reopened at the next ``BEGIN``).

    **Round trips.** Statements that answer nothing -- ``BEGIN``, ``SAVEPOINT``, ``RELEASE``,
    ``SET LOCAL`` -- are not sent on their own: they are held and sent in one query string
    with the next statement that answers something (the simple query protocol runs them in
    order, and stops at the first that fails), or with the ``COMMIT``. A transaction of one
    statement therefore costs two round trips (``BEGIN; stmt`` and ``COMMIT``), not four, and
    a transaction in which nothing reached the server ends without any.

    Args:
        target: The server.
        read_only: Reader connection: ``BEGIN`` opens a ``REPEATABLE READ READ ONLY``
            snapshot.
        deadline_s: Seconds one round trip waits for the server's answer
            (:data:`STATEMENT_DEADLINE_S`).
    """

    dialect = "postgresql"

    def __init__(
        self, target: PgTarget, *, read_only: bool, deadline_s: float = STATEMENT_DEADLINE_S
    ) -> None:
        self.target = target
        self.read_only = read_only
        self.deadline_s = deadline_s
        # The deadline of the open transaction's round trips (longer for a migration).
        self._round_trip_s = deadline_s
        self._connection: DeadlineConnection | None = None
        # Statements held back for the next one sent (see the class docstring), and whether
        # anything of the open transaction reached the server yet.
        self._held: list[str] = []
        self._sent = False
        # When (``time.perf_counter()``) this connection last gave up on the server, and
        # why; and when the request now running was queued (:meth:`note_request`).
        self._lost_at: float | None = None
        self._lost: BaseException | None = None
        self._queued_at: float | None = None
        # Whether this connection last gave up on the one try of a request that waited.
        self._probed = False
        self._connect_error: BaseException | None = None
        self._distrusted = False
        self._connect_now()

    def note_request(self, queued_at: float) -> None:
        """The connection thread starts a request queued at ``queued_at``
        (``time.perf_counter()``): one queued before this connection last gave up on the
        server fails at once rather than wait out a reconnect of its own (module docstring).
        """
        self._queued_at = queued_at

    def _connect_now(self) -> None:
        try:
            connection = DeadlineConnection.connect(
                self.target.conninfo,
                autocommit=True,
                connect_timeout=CONNECT_TIMEOUT_S,
                cursor_factory=ClientCursor,
                application_name="sbproxy-journal",
                # None: psycopg prepares nothing, not even what asks (PgBouncer).
                prepare_threshold=self.target.prepare_threshold,
                **transport_params(self.target.conninfo),
            )
        except psycopg.OperationalError as exc:
            self._connect_error = exc
            raise self.target.unavailable(exc) from None
        connection.row_factory = _row_factory
        connection.deadline_s = self._round_trip_s
        self._connection = connection
        # The hot statements this connection's server session has prepared (none yet).
        self._prepared_here: set[str] = set()

    def distrust(self) -> None:
        """Another connection of this process found the server gone: reopen this one at the
        next transaction rather than find it lost (it sat idle meanwhile) by a write that
        then fails. Called from any thread."""
        self._distrusted = True

    def _live(self) -> DeadlineConnection:
        connection = self._connection
        distrusted, self._distrusted = self._distrusted, False
        if connection is not None and not (connection.closed or connection.broken or distrusted):
            return connection
        if connection is not None:
            connection.close()
        self._connection = None
        lost_at, queued_at = self._lost_at, self._queued_at
        if lost_at is not None and queued_at is not None and queued_at < lost_at:
            # This request waited in the queue while the server was found gone (a
            # statement's silence, a failed reconnect). The link may be back by now: the
            # first such request tries the server once, and runs or fails; once that try
            # failed, the rest that waited through it are refused at once (one outage, not
            # one reconnect each).
            if self._probed:
                raise self.target.unavailable(self._lost)
            try:
                try:
                    self._connect_now()
                except JournalUnavailable:
                    if isinstance(self._connect_error, psycopg.errors.ConnectionTimeout):
                        raise
                    # Refused or closed, not silent: at once again (a handshake the link
                    # dropped while it came back is closed then, not answered).
                    self._connect_now()
            except JournalUnavailable:
                self._gave_up(self._connect_error, probed=True)
                raise
            return self._opened()
        try:
            Retrying(
                retry=retry_if_exception_type(JournalUnavailable),
                stop=stop_after_delay(RECONNECT_WINDOW_S),
                wait=wait_random_exponential(multiplier=0.05, max=1),
                sleep=time.sleep,
                reraise=True,
            )(self._connect_now)
        except JournalUnavailable:
            self._gave_up(self._connect_error, probed=False)
            raise
        return self._opened()

    def _gave_up(self, exc: BaseException | None, *, probed: bool) -> None:
        """Remember that the server was found unreachable now -- a reconnect failed, or a
        round trip got no answer (see :meth:`note_request`); ``probed``: by the one try of
        a request that waited through an earlier such finding."""
        self._lost_at = time.perf_counter()
        self._lost = exc
        self._probed = probed

    def _opened(self) -> DeadlineConnection:
        connection = self._connection
        assert connection is not None  # noqa: S101 - _connect_now set it
        return connection

    @property
    def in_transaction(self) -> bool:
        """Whether a transaction is open (begun here, or failed and not yet rolled back)."""
        if self._held:
            return True
        connection = self._connection
        if connection is None or connection.closed or connection.broken:
            return False
        return connection.info.transaction_status != TransactionStatus.IDLE

    def execute(self, sql: str, params: Any = ()) -> _Cursor:
        """Run one statement (SQLite's text); its rows, fetched at once."""
        text = translate(sql)
        if text == "BEGIN":
            self._round_trip_s = self.deadline_s
            self._live().deadline_s = self._round_trip_s
            self._held = [
                "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY" if self.read_only else "BEGIN"
            ]
            self._sent = False
            _local.connection = self
            return _NOTHING
        if text.startswith(_HELD_BACK):
            self._held.append(text)
            return _NOTHING
        if text.startswith(_ADVISORY_LOCK) and _is_migration_lock(params):
            # A migration: its DDL (and the wait for another host's) may take long.
            self._round_trip_s = max(self.deadline_s, MIGRATION_DEADLINE_S)
            self._opened().deadline_s = self._round_trip_s
        if text in ("COMMIT", "ROLLBACK"):
            try:
                if not self._sent:
                    # Nothing of this transaction reached the server: nothing to end.
                    self._held.clear()
                    return _NOTHING
                if text == "ROLLBACK":
                    self._held.clear()
                return self._send(text, ())
            finally:
                self._held.clear()
                self._sent = False
                _local.connection = None
        return self._send(text, params)

    def execute_and_commit(self, sql: str, params: Any = ()) -> _Cursor:
        """Run one statement and ``COMMIT`` in one query (one round trip with the held
        ``BEGIN``); its rows. The transaction is over when this returns: the ``COMMIT`` that
        follows has nothing to do.

        Raises:
            ConstraintViolation | psycopg.Error: as :meth:`execute`; the transaction is then
                left failed (the ``COMMIT`` did not run) for the caller's ``ROLLBACK``.
        """
        result = self._send(translate(sql), params, commit=True)
        self._sent = False
        _local.connection = None
        return result

    def _send(self, text: str, params: Any, *, commit: bool = False) -> _Cursor:
        """Send ``text`` with the statements held back before it (and ``COMMIT`` after it
        when ``commit``); ``text``'s rows."""
        held, self._held = self._held, []
        # Run again on a fresh connection only what cannot have committed (or only reads).
        first = (
            (not commit or self.read_only)
            and not self._sent
            and bool(held)
            and held[0].startswith("BEGIN")
        )
        prepared = text in _prepared and self.target.prepared_statements
        if commit and self._alone(held, text):
            # The whole transaction is this one statement: sent alone, without BEGIN and
            # COMMIT, the server runs it as its own transaction and commits it (waiting for
            # the WAL flush as any commit) before it answers -- one message, one round trip.
            # A reader's one SELECT sees one snapshot either way.
            def send(connection: psycopg.Connection[Any]) -> _Cursor:
                if prepared and text not in self._prepared_here:
                    # Its first use on this connection: psycopg alone would wait for the
                    # preparation before it executes (two round trips); in a pipeline of
                    # its own the preparation travels with the execution and the Sync
                    # ends the statement's own transaction, as sent alone.
                    answer = _run_prepared(connection, (), text, params, ())
                    self._prepared_here.add(text)
                    return answer
                return _run_alone(connection, text, params, prepared=prepared)

        elif prepared:
            tail = ["COMMIT"] if commit else []

            def send(connection: psycopg.Connection[Any]) -> _Cursor:
                return _run_prepared(connection, held, text, params, tail)

        else:
            parts = [*held, text, "COMMIT"] if commit else [*held, text]
            query = "; ".join(parts)
            skip = 1 if commit else 0

            def send(connection: psycopg.Connection[Any]) -> _Cursor:
                return _run(connection, query, params, skip=skip)

        connection = self._connection or self._live()
        self._sent = True
        try:
            try:
                result = send(connection)
            except psycopg.OperationalError as exc:
                # A connection the server dropped while idle says so only when used. When
                # this query opens the transaction, nothing of it took effect (no COMMIT in
                # it, and a lost connection rolls back) or it only read, so it runs again
                # on a fresh one -- unless the server did not answer at all (a deadline):
                # a fresh connection would only wait again.
                if not first or not connection.broken or isinstance(exc, DeadlineExceeded):
                    raise
                connection = self._live()
                result = send(connection)
        except psycopg.IntegrityError as exc:
            raise ConstraintViolation(str(exc)) from exc
        except psycopg.OperationalError as exc:
            if connection.broken or connection.closed:
                if isinstance(exc, DeadlineExceeded):
                    # Silent, not gone (a server that closed the connection may well be
                    # back at the next attempt): what queued meanwhile is refused at once.
                    self._gave_up(exc, probed=False)
                raise self.target.unavailable(exc) from exc
            raise
        return result

    def _alone(self, held: Sequence[str], text: str) -> bool:
        """Whether ``text``, with ``held`` before it, is a whole transaction that may run
        alone: nothing but the ``BEGIN`` came before, and on a reader it only reads."""
        if len(held) != 1 or not held[0].startswith("BEGIN"):
            return False
        return not self.read_only or text.lstrip()[:7].upper() in ("SELECT ", "SELECT\n")

    def executemany(self, sql: str, rows: Iterable[Any]) -> _Cursor:
        """Run one statement once per parameter set."""
        count = 0
        for params in rows:
            count += self.execute(sql, params).rowcount
        return _Cursor(count, [])

    def database_ms(self) -> int:
        """The server's ``clock_timestamp()`` in epoch ms, after taking the lease lock."""
        row = self._send(
            "SELECT pg_advisory_xact_lock(%s),"
            " (extract(epoch FROM clock_timestamp()) * 1000)::bigint",
            (LEASE_LOCK_KEY,),
        ).fetchone()
        assert row is not None  # noqa: S101 - a SELECT without FROM returns its row
        return int(row[1])

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


# Statements that answer nothing and may wait for the next one (``PgConnection``).
_HELD_BACK = ("SAVEPOINT ", "RELEASE ", "SET LOCAL ")
_ADVISORY_LOCK = "SELECT pg_advisory_xact_lock("


def _is_migration_lock(params: Any) -> bool:
    """Whether the advisory lock statement's ``params`` name the migration lock."""
    values = params.values() if isinstance(params, Mapping) else params
    return MIGRATION_LOCK_KEY in tuple(values)


_NOTHING = _Cursor(-1, [])
_TUPLES_OK = ExecStatus.TUPLES_OK


def _run(connection: psycopg.Connection[Any], text: str, params: Any, *, skip: int = 0) -> _Cursor:
    """Run ``text`` (one statement or several); the answer of the last but ``skip``."""
    with connection.cursor() as cursor:
        cursor.execute(text, _params(params))
        answers = [_answer(cursor)]
        while cursor.nextset():
            answers.append(_answer(cursor))
        return answers[-1 - skip]


def _run_alone(
    connection: psycopg.Connection[Any], text: str, params: Any, *, prepared: bool
) -> _Cursor:
    """Run ``text`` as a transaction of its own (the connection is in autocommit); its rows.
    ``prepared``: bound on the server and prepared once per connection."""
    cursor = (
        psycopg.Cursor(connection, row_factory=_row_factory) if prepared else connection.cursor()
    )
    with cursor:
        cursor.execute(text, _params(params), prepare=prepared)
        return _answer(cursor)


def _run_prepared(
    connection: psycopg.Connection[Any],
    held: Sequence[str],
    text: str,
    params: Any,
    tail: Sequence[str],
) -> _Cursor:
    """Run ``text`` bound on the server (prepared once per connection), with the statements
    ``held`` before it and ``tail`` after it, in one pipeline (one round trip); its rows.

    Raises:
        psycopg.Error: the first error met, once (a lost connection fails the pipeline's
            end too; psycopg, handed the first, would log the second as
            ``error ignored terminating <psycopg.Pipeline [BAD]>`` -- nothing is logged).
    """
    cursor = psycopg.Cursor(connection, row_factory=_row_factory)
    failed: psycopg.Error | None = None
    try:
        with connection.pipeline():
            try:
                for statement in held:
                    connection.execute(statement)
                cursor.execute(text, _params(params), prepare=True)
                for statement in tail:
                    connection.execute(statement)
            except psycopg.Error as exc:
                # Kept from the pipeline's end, which syncs, meets the same failure (or the
                # statement's own error) and raises it without a word.
                failed = exc
    except psycopg.Error:
        if failed is None:
            raise
    if failed is not None:
        raise failed
    with cursor:
        return _answer(cursor)


def _answer(cursor: Any) -> _Cursor:
    result = cursor.pgresult
    answered = result is not None and result.status == _TUPLES_OK
    return _Cursor(cursor.rowcount, cursor.fetchall() if answered else [])


def _params(params: Any) -> Any:
    return params if isinstance(params, Mapping) else list(params)


class DatabaseLeaseTime:
    """The lease clock of a PostgreSQL journal: the server's ``clock_timestamp()``.

    Read inside a write transaction (the store reads its lease clock there), it asks the
    server, under a transaction-scoped advisory lock that serialises lease stamps across
    hosts, and remembers the offset from this host's monotonic clock; read elsewhere (the
    engine showing how stale a job is) it answers from that offset without a round trip.
    """

    def __init__(self, offset_ms: int) -> None:
        self._offset_ms = offset_ms

    @staticmethod
    def _local_ms() -> int:
        return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1_000_000

    def observe(self, now_ms: int) -> None:
        """Remember ``now_ms``, the server's clock just read by a statement of the journal's
        own (a claim reads it in the statement that stamps the lease)."""
        self._offset_ms = now_ms - self._local_ms()

    def __call__(self) -> LeaseTime:
        connection: PgConnection | None = getattr(_local, "connection", None)
        if connection is not None and connection.in_transaction:
            now = connection.database_ms()
            self.observe(now)
            return LeaseTime(clock=DB_CLOCK, ms=now)
        return LeaseTime(clock=DB_CLOCK, ms=self._local_ms() + self._offset_ms)
