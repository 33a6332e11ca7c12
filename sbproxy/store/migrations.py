"""Versioned schema migrations of the journal.

Each migration is applied once, in order, inside one ``BEGIN IMMEDIATE`` transaction that
also records its version in ``schema_migrations``; concurrent openers serialise on the write
lock and the later one finds nothing to do. Never edit a released migration: append one.

The same migrations build the PostgreSQL schema (``postgres.py``): the texts are SQLite's,
and :func:`ddl` rewrites the two things PostgreSQL spells otherwise -- ``INTEGER`` is 32-bit
there, so every integer column is ``BIGINT`` (SQLite's ``INTEGER`` holds 64 bits), and
SQLite's auto-numbered ``INTEGER PRIMARY KEY`` is an identity column. PostgreSQL runs DDL in
transactions too; concurrent openers serialise on a transaction-scoped advisory lock taken
before the version is read, so two hosts starting at once migrate once.
"""

from __future__ import annotations

import re
import time

from sbproxy.store.database import Database, StoreError, Transaction
from sbproxy.store.postgres import MIGRATION_LOCK_KEY, PgConnection, PgTarget

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "apply_pending", "ddl", "migrate", "migrate_postgres"]

_AUTO_KEY = re.compile(r"\bINTEGER PRIMARY KEY( AUTOINCREMENT)?(?=\s*[,)]|\s*$)")
_INTEGER = re.compile(r"\bINTEGER\b")

MIGRATIONS: tuple[tuple[int, str, tuple[str, ...]], ...] = (
    (
        1,
        "jobs, steps and job events",
        (
            """
            CREATE TABLE jobs (
                id TEXT NOT NULL PRIMARY KEY,
                kind TEXT NOT NULL,
                workflow_version INTEGER NOT NULL,
                subject TEXT,
                input_json TEXT NOT NULL,
                idempotency_key TEXT,
                status TEXT NOT NULL,
                attempt INTEGER NOT NULL DEFAULT 0,
                lease_owner TEXT,
                lease_expires_at_ms INTEGER,
                cancel_requested INTEGER NOT NULL DEFAULT 0,
                progress_json TEXT,
                output_json TEXT,
                error_code TEXT,
                error_message TEXT,
                trace_context TEXT,
                created_at_ms INTEGER NOT NULL,
                updated_at_ms INTEGER NOT NULL,
                started_at_ms INTEGER,
                ended_at_ms INTEGER
            )
            """,
            # One unfinished job per idempotency key; finished jobs release their key.
            """
            CREATE UNIQUE INDEX jobs_active_idempotency_key ON jobs (idempotency_key)
            WHERE idempotency_key IS NOT NULL AND status IN ('queued', 'running', 'parked')
            """,
            "CREATE INDEX jobs_status_created ON jobs (status, created_at_ms, id)",
            "CREATE INDEX jobs_subject ON jobs (subject) WHERE subject IS NOT NULL",
            """
            CREATE TABLE steps (
                job_id TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
                seq INTEGER NOT NULL,
                name TEXT NOT NULL,
                status TEXT NOT NULL,
                attempts INTEGER NOT NULL DEFAULT 0,
                output_json TEXT,
                error_code TEXT,
                error_message TEXT,
                started_at_ms INTEGER NOT NULL,
                ended_at_ms INTEGER,
                PRIMARY KEY (job_id, seq)
            )
            """,
            """
            CREATE TABLE job_events (
                seq INTEGER PRIMARY KEY AUTOINCREMENT,
                job_id TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
                at_ms INTEGER NOT NULL,
                type TEXT NOT NULL,
                data_json TEXT NOT NULL
            )
            """,
            "CREATE INDEX job_events_job_seq ON job_events (job_id, seq)",
        ),
    ),
    (
        2,
        "deployment generations and committed runtime revisions",
        (
            """
            CREATE TABLE deployment_generations (
                deployment TEXT NOT NULL PRIMARY KEY,
                generation INTEGER NOT NULL,
                updated_at_ms INTEGER NOT NULL
            )
            """,
            """
            CREATE TABLE runtime_revisions (
                revision INTEGER PRIMARY KEY,
                content_digest TEXT NOT NULL,
                desired_json TEXT NOT NULL,
                committed_at_ms INTEGER NOT NULL
            )
            """,
        ),
    ),
    (
        3,
        "token usage per API key and UTC hour",
        (
            # One row per key name and UTC hour: every budget period (hour, day, week, month)
            # is a whole number of UTC hours, so any period's total is a sum over its hours.
            """
            CREATE TABLE token_usage (
                key_name TEXT NOT NULL,
                hour_start_ms INTEGER NOT NULL,
                prompt_tokens INTEGER NOT NULL DEFAULT 0,
                completion_tokens INTEGER NOT NULL DEFAULT 0,
                requests INTEGER NOT NULL DEFAULT 0,
                updated_at_ms INTEGER NOT NULL,
                PRIMARY KEY (key_name, hour_start_ms)
            )
            """,
        ),
    ),
    (
        4,
        "leases on the boot's monotonic clock",
        (
            # Leases move off the wall clock (``leaseclock.py``): the boot id of the clock,
            # the deadline in ms on it, and the lease length. ``lease_expires_at_ms`` stays, always
            # NULL from now on, so that an older sbproxy still attached can run its SQL and never
            # expires these leases by its wall clock.
            "ALTER TABLE jobs ADD COLUMN lease_clock TEXT",
            "ALTER TABLE jobs ADD COLUMN lease_deadline_ms INTEGER",
            "ALTER TABLE jobs ADD COLUMN lease_ms INTEGER",
            # A wall-clock lease cannot be carried over to a monotonic clock. Running jobs keep
            # their owner and are left without a lease: recovery takes one at once (lease
            # lapsed); a live owner loses it at its next heartbeat and stops, and the job
            # resumes from its last completed step.
            "UPDATE jobs SET lease_expires_at_ms = NULL",
        ),
    ),
    (
        5,
        "recoveries since the last completed step",
        (
            # How many times recovery took the job from a dead or lapsed runner since a step
            # last completed; recovery fails a job that reached the engine's limit
            # (``recovery_exhausted``) instead of re-queueing it once more. Existing jobs
            # start at 0: whatever crashed them before was not counted.
            "ALTER TABLE jobs ADD COLUMN recoveries INTEGER NOT NULL DEFAULT 0",
        ),
    ),
    (
        6,
        "the node each job belongs to",
        (
            # The node (``node.py``) that submitted the job: only it claims the job, and only
            # it recovers the job from a dead runner. NULL (jobs from before): any node.
            "ALTER TABLE jobs ADD COLUMN node TEXT",
        ),
    ),
    (
        7,
        "admin_managed revision documents of hosts sharing the journal",
        (
            # One row per revision; the primary key is the compare-and-set (``revisions.py``).
            # Used on PostgreSQL; on SQLite the revision store stays a file beside sb.yml.
            """
            CREATE TABLE desired_revisions (
                revision INTEGER NOT NULL PRIMARY KEY,
                document TEXT NOT NULL,
                committed_at_ms INTEGER NOT NULL
            )
            """,
        ),
    ),
    (
        8,
        "idempotency keys are per node",
        (
            # Hosts sharing a journal each run their own node-local jobs: node B's pull or load
            # of an artifact must not join node A's unfinished job with the same key (it would
            # wait on work into another node's cache that B can never claim).
            "DROP INDEX jobs_active_idempotency_key",
            """
            CREATE UNIQUE INDEX jobs_active_idempotency_key
            ON jobs (COALESCE(node, ''), idempotency_key)
            WHERE idempotency_key IS NOT NULL AND status IN ('queued', 'running', 'parked')
            """,
        ),
    ),
    (
        9,
        "fleet membership, the controller lease and placements",
        (
            # One row per member (``fleet.py``). ``renewed_at_ms`` is database time; ``state``
            # is the state the controller last recorded (moves checked against the table of
            # ``fleet/membership.py``); the operator flags are separate, so a renewal never
            # overwrites a cordon.
            """
            CREATE TABLE fleet_nodes (
                id TEXT NOT NULL PRIMARY KEY,
                advertise_url TEXT,
                labels_json TEXT NOT NULL,
                engines_json TEXT NOT NULL,
                devices_json TEXT NOT NULL,
                artifacts_json TEXT NOT NULL,
                replicas_json TEXT NOT NULL,
                state TEXT NOT NULL,
                cordoned INTEGER NOT NULL DEFAULT 0,
                draining INTEGER NOT NULL DEFAULT 0,
                left_fleet INTEGER NOT NULL DEFAULT 0,
                joined_at_ms INTEGER NOT NULL,
                renewed_at_ms INTEGER NOT NULL
            )
            """,
            # The single controller lease; ``epoch`` grows with every new holder and fences
            # a deposed holder's writes.
            """
            CREATE TABLE fleet_controller (
                id INTEGER NOT NULL PRIMARY KEY CHECK (id = 1),
                holder TEXT NOT NULL,
                epoch INTEGER NOT NULL,
                acquired_at_ms INTEGER NOT NULL,
                expires_at_ms INTEGER NOT NULL
            )
            """,
            # One row per placed replica; written by the controller under its epoch, its
            # state moved by the node it names (starting -> ready) or the controller (stop).
            """
            CREATE TABLE fleet_placements (
                id TEXT NOT NULL PRIMARY KEY,
                deployment TEXT NOT NULL,
                replica INTEGER NOT NULL,
                revision INTEGER NOT NULL,
                node TEXT NOT NULL,
                devices_json TEXT NOT NULL,
                engine TEXT NOT NULL,
                reserved_bytes INTEGER NOT NULL,
                state TEXT NOT NULL,
                replaces TEXT,
                definition_json TEXT NOT NULL,
                epoch INTEGER NOT NULL,
                job_id TEXT NOT NULL,
                created_at_ms INTEGER NOT NULL,
                updated_at_ms INTEGER NOT NULL
            )
            """,
            "CREATE INDEX fleet_placements_node ON fleet_placements (node)",
            """
            CREATE TABLE fleet_events (
                seq INTEGER PRIMARY KEY AUTOINCREMENT,
                at_ms INTEGER NOT NULL,
                type TEXT NOT NULL,
                subject TEXT NOT NULL,
                data_json TEXT NOT NULL
            )
            """,
        ),
    ),
    (
        10,
        "fleet: reported GGUF facts, per-placement variant and estimate basis, avoided nodes",
        (
            # ``{artifact digest: GGUF header facts}`` a node read from its own verified
            # artifacts, so the controller sizes a replica from the model's shape even when
            # it does not hold the file itself.
            "ALTER TABLE fleet_nodes ADD COLUMN artifact_facts_json TEXT NOT NULL DEFAULT '{}'",
            # The catalog variant a replica runs (per-node resolution under
            # heterogeneous_variants; NULL: the node resolves it) and what its reservation
            # was sized from (``gguf_header`` or ``file_size``).
            "ALTER TABLE fleet_placements ADD COLUMN variant TEXT",
            "ALTER TABLE fleet_placements ADD COLUMN estimate_basis TEXT",
            # A node a deployment's stuck or failed placement was moved off: no replica of
            # that deployment is placed there again before ``until_ms`` (database time).
            """
            CREATE TABLE fleet_avoid (
                deployment TEXT NOT NULL,
                node TEXT NOT NULL,
                until_ms INTEGER NOT NULL,
                reason TEXT NOT NULL,
                placement TEXT NOT NULL,
                PRIMARY KEY (deployment, node)
            )
            """,
        ),
    ),
    (
        11,
        "fleet: a member's process instance and graceful leave, the controller's instance",
        (
            # The process that holds a node id now (a token made at each start): a second
            # live process claiming the id -- a copied cache, a cloned VM -- is refused
            # (``node_id_in_use``), and renewals and the controller lease are held by node
            # and instance, so twins can never share one epoch. '' -- released by a
            # graceful stop, free to take.
            "ALTER TABLE fleet_nodes ADD COLUMN instance TEXT NOT NULL DEFAULT ''",
            # Database time a gracefully stopping host marked itself leaving (out of
            # rotation at once; its replicas re-placed after ``rejoin_grace_ms`` unless it
            # is back). NULL while it runs.
            "ALTER TABLE fleet_nodes ADD COLUMN leaving_at_ms INTEGER",
            "ALTER TABLE fleet_controller ADD COLUMN holder_instance TEXT NOT NULL DEFAULT ''",
        ),
    ),
    (
        12,
        "fleet: autoscaled replica counts and demand for a deployment at zero",
        (
            # The replica count the controller's last ``fleet.scale`` decision set for an
            # autoscaled deployment (``replicas: {min, max}``), with when, why and the job
            # that records its figures. No row: the range's initial count.
            """
            CREATE TABLE fleet_scale (
                deployment TEXT PRIMARY KEY,
                replicas INTEGER NOT NULL,
                decided_at_ms INTEGER NOT NULL,
                reason TEXT NOT NULL,
                epoch INTEGER NOT NULL,
                job_id TEXT NOT NULL
            )
            """,
            # A gateway's request for a deployment scaled to zero: one row per deployment
            # however many requests wait; the controller's scale-from-zero decision deletes
            # it in its own transaction.
            """
            CREATE TABLE fleet_demand (
                deployment TEXT PRIMARY KEY,
                at_ms INTEGER NOT NULL,
                node TEXT NOT NULL
            )
            """,
        ),
    ),
    (
        13,
        "fleet admission: join tokens, each member's node credential, revocation",
        (
            # A join token (``store/admission.py``): its public id, the SHA-256 of its secret
            # (never the secret), its expiry on database time (NULL: none) and the joins it
            # has left (NULL: unlimited); revoked by an operator.
            """
            CREATE TABLE fleet_join_tokens (
                id TEXT NOT NULL PRIMARY KEY,
                secret_sha256 TEXT NOT NULL,
                created_at_ms INTEGER NOT NULL,
                created_by TEXT NOT NULL,
                expires_at_ms INTEGER,
                uses_left INTEGER,
                used INTEGER NOT NULL DEFAULT 0,
                revoked_at_ms INTEGER,
                description TEXT NOT NULL DEFAULT ''
            )
            """,
            # The SHA-256 of the member's own node credential (issued at its join; peers
            # check it on every hop), and when and why an operator revoked the member:
            # a revoked row is never renewed (the renewal's WHERE), and joins again only
            # with a fresh join token after ``sbproxy nodes admit``.
            "ALTER TABLE fleet_nodes ADD COLUMN credential_sha256 TEXT",
            "ALTER TABLE fleet_nodes ADD COLUMN revoked_at_ms INTEGER",
            "ALTER TABLE fleet_nodes ADD COLUMN revoked_reason TEXT",
        ),
    ),
    (
        14,
        "fleet: each member's artifact inventory (digest, size, verified) for locality and peers",
        (
            # ``{artifact digest: {"bytes": N, "verified": true}}`` of the artifacts a node's
            # cache holds, bounded (the agent sends at most a few hundred entries), written
            # with a renewal only when it changed: the controller scores locality from it and
            # a pulling node asks the members that hold a digest for its files first.
            "ALTER TABLE fleet_nodes ADD COLUMN artifact_inventory_json TEXT NOT NULL DEFAULT '{}'",
        ),
    ),
    (
        15,
        "fleet: a replica split over several nodes' llama.cpp RPC workers",
        (
            # ``[{"node", "devices", "reserved_bytes"}, ...]`` of a split replica's workers,
            # the leader's node first; NULL for a replica on one node.
            "ALTER TABLE fleet_placements ADD COLUMN workers_json TEXT",
        ),
    ),
)

SCHEMA_VERSION = MIGRATIONS[-1][0]


def ddl(statement: str, dialect: str) -> str:
    """``statement`` as ``dialect`` (``sqlite`` or ``postgresql``) reads it (module docstring)."""
    if dialect != "postgresql":
        return statement
    text = _AUTO_KEY.sub("BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY", statement)
    return _INTEGER.sub("BIGINT", text)


def _create_versions(transaction: Transaction) -> None:
    transaction.execute(
        ddl(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            " version INTEGER NOT NULL PRIMARY KEY,"
            " description TEXT NOT NULL,"
            " applied_at_ms INTEGER NOT NULL)",
            transaction.dialect,
        )
    )


def _apply(transaction: Transaction) -> None:
    postgres = transaction.dialect == "postgresql"
    if postgres:
        transaction.execute("SELECT pg_advisory_xact_lock(:key)", {"key": MIGRATION_LOCK_KEY})
    # A host connecting as a role without CREATE on the schema (per-node roles,
    # docs/cluster.md "Admitting nodes") must not issue DDL at all once the schema exists.
    exists = postgres and bool(
        transaction.scalar(
            "SELECT CASE WHEN to_regclass('schema_migrations') IS NULL THEN 0 ELSE 1 END"
        )
    )
    if not exists:
        _create_versions(transaction)
    current = transaction.scalar("SELECT COALESCE(MAX(version), 0) FROM schema_migrations")
    if current > SCHEMA_VERSION:
        raise StoreError(
            f"the journal has schema version {current}, newer than this sbproxy knows "
            f"({SCHEMA_VERSION})",
            # SQLite keeps the code it always had; the shared journal names what happened.
            code="journal_schema_newer" if postgres else "store_version_mismatch",
            retryable=False,
            remediation="Run the newer sbproxy, or point this one at another cache directory."
            if not postgres
            else "Upgrade this host to the sbproxy the others run (a journal is never "
            "migrated backwards).",
            details={"schema_version": int(current), "supported": SCHEMA_VERSION},
        )
    for version, description, statements in MIGRATIONS:
        if version <= current:
            continue
        for statement in statements:
            transaction.execute(ddl(statement, transaction.dialect))
        transaction.execute(
            "INSERT INTO schema_migrations (version, description, applied_at_ms)"
            " VALUES (:v, :d, :t)",
            {"v": version, "d": description, "t": int(time.time() * 1000)},
        )


def apply_pending(transaction: Transaction) -> None:
    """Apply the pending migrations in ``transaction`` (the caller begins and commits it):
    for a process that needs the schema before it opens the journal (the shared revision
    store read at start). Raises as :func:`migrate`."""
    _apply(transaction)


def migrate_postgres(target: PgTarget) -> None:
    """Apply the pending migrations to the PostgreSQL database ``target`` on a connection of
    its own, in one transaction (for the stores that reach the shared database before, or
    beside, the journal: the revision store and the fleet store).

    Raises:
        StoreError: ``journal_schema_newer``; JournalUnavailable.
    """
    connection = PgConnection(target, read_only=False)
    try:
        connection.execute("BEGIN")
        apply_pending(Transaction(connection, ()))
        connection.execute("COMMIT")
    finally:
        if connection.in_transaction:
            connection.execute("ROLLBACK")
        connection.close()


async def migrate(database: Database) -> None:
    """Bring ``database`` to :data:`SCHEMA_VERSION`, in one ``BEGIN IMMEDIATE`` transaction.

    Raises:
        StoreError: ``store_version_mismatch`` when the file is newer than this code.
    """
    await database.write(_apply)
