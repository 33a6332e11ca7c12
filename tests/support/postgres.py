"""A real PostgreSQL server for the tests: Debian's binaries, a throw-away cluster.

:class:`PostgresServer` runs ``initdb`` into a temporary directory and ``pg_ctl start`` on a
free loopback port (TCP only, no Unix socket in a shared place), ``fsync`` and
``synchronous_commit`` left at their defaults (on). Run as root, the cluster belongs to the
unprivileged ``postgres`` user (``initdb`` refuses root), started through ``runuser``. The
system's own clusters are never touched: the data directory, socket directory and port are
this server's own, and :meth:`stop` (``pg_ctl stop -m immediate``) removes all of it.

Each test gets a fresh database: :meth:`create_database` clones ``template_sbproxy`` (an empty
database made once), which takes a few milliseconds. :func:`running_server` starts a server of
the caller's own (the ``own_postgres_server`` fixture): a test that stops and restarts it
under a journal (an outage) never disturbs the session's shared server.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from tests.support.ports import free_port

__all__ = ["MISSING", "PostgresServer", "postgres_bin_dir", "running_server"]

_DEBIAN_BIN = Path("/usr/lib/postgresql")
SERVICE_USER = "postgres"
TEMPLATE = "template_sbproxy"
START_TIMEOUT_S = 60.0


def postgres_bin_dir() -> Path | None:
    """The newest Debian PostgreSQL ``bin`` directory holding ``initdb``, or ``None``."""
    if not _DEBIAN_BIN.is_dir():
        found = shutil.which("initdb")
        return Path(found).resolve().parent if found else None
    versions = sorted(
        (p for p in _DEBIAN_BIN.iterdir() if (p / "bin" / "initdb").exists()),
        key=lambda p: int(p.name) if p.name.isdigit() else 0,
    )
    return versions[-1] / "bin" if versions else None


MISSING = (
    "PostgreSQL's initdb is not installed: `bash scripts/test.sh` installs Debian's "
    "postgresql package (apt-get install postgresql)"
)


@contextlib.contextmanager
def running_server() -> Iterator[PostgresServer]:
    """A started server of the caller's own, stopped and removed on exit (see the module
    docstring; :class:`RuntimeError` when PostgreSQL is missing or does not start)."""
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        raise RuntimeError(MISSING)
    server = PostgresServer(bin_dir)
    try:
        server.start()
        yield server
    finally:
        server.stop()


class PostgresServer:
    """One throw-away PostgreSQL cluster on ``127.0.0.1:port`` (see the module docstring).

    Attributes:
        port: The TCP port it listens on.
        user: The database superuser (the OS user that owns the cluster).
        data_dir: The cluster's data directory.
    """

    def __init__(self, bin_dir: Path) -> None:
        self.bin_dir = bin_dir
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="sbproxy-pg-"))
        self.data_dir = self.root / "data"
        self.socket_dir = self.root / "socket"
        self.log_path = self.root / "server.log"
        self._as_root = os.geteuid() == 0
        self.user = SERVICE_USER if self._as_root else pwd.getpwuid(os.geteuid()).pw_name
        self._databases = 0

    def _run(self, argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = list(argv)
        if self._as_root:
            command = ["runuser", "-u", SERVICE_USER, "--", *command]
        return subprocess.run(command, check=check, capture_output=True, text=True, timeout=120)

    def _pg(self, tool: str) -> str:
        return str(self.bin_dir / tool)

    def start(self) -> None:
        """``initdb`` (first time) and ``pg_ctl start``; returns once it accepts connections.

        Raises:
            RuntimeError: the server did not start (its log is in the message).
        """
        self.socket_dir.mkdir(parents=True, exist_ok=True)
        if self._as_root:
            entry = pwd.getpwnam(SERVICE_USER)
            for path in (self.root, self.socket_dir):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        if not self.data_dir.exists():
            self._run(
                [
                    self._pg("initdb"),
                    "-D",
                    str(self.data_dir),
                    "-U",
                    self.user,
                    "--auth=trust",
                    "--encoding=UTF8",
                    "--no-instructions",
                ]
            )
        self.start_server()
        self.psql(f"CREATE DATABASE {TEMPLATE}")

    def start_server(self) -> None:
        """``pg_ctl start`` on the existing cluster (after :meth:`stop_server`)."""
        options = (
            f"-c listen_addresses=127.0.0.1 -c port={self.port}"
            f" -c unix_socket_directories={self.socket_dir} -c max_connections=200"
        )
        done = self._run(
            [
                self._pg("pg_ctl"),
                "start",
                "-w",
                "-t",
                str(int(START_TIMEOUT_S)),
                "-D",
                str(self.data_dir),
                "-l",
                str(self.log_path),
                "-o",
                options,
            ],
            check=False,
        )
        if done.returncode != 0:
            log = self.log_path.read_text() if self.log_path.exists() else ""
            raise RuntimeError(f"pg_ctl start failed: {done.stderr}\n{log}")
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
                return
            time.sleep(0.05)
        raise RuntimeError(f"PostgreSQL did not listen on port {self.port}")

    def stop_server(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m <mode>`` (the cluster stays; :meth:`start_server` restarts it)."""
        self._run([self._pg("pg_ctl"), "stop", "-w", "-m", mode, "-D", str(self.data_dir)])

    def stop(self) -> None:
        """Stop the server and remove the cluster."""
        if (self.data_dir / "postmaster.pid").exists():
            self._run(
                [self._pg("pg_ctl"), "stop", "-w", "-m", "immediate", "-D", str(self.data_dir)],
                check=False,
            )
        shutil.rmtree(self.root, ignore_errors=True)

    def psql(self, sql: str, database: str = "postgres") -> str:
        """Run ``sql`` through ``psql`` as the superuser; its output (unaligned, no header)."""
        done = self._run(
            [
                self._pg("psql"),
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                self.user,
                "-d",
                database,
                "-v",
                "ON_ERROR_STOP=1",
                "-Atc",
                sql,
            ]
        )
        return done.stdout.strip()

    def url(self, database: str) -> str:
        """The ``postgresql://`` URL of ``database`` on this server."""
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A new, empty database (a copy of the template); its URL."""
        self._databases += 1
        name = f"sbproxy_{os.getpid()}_{self._databases}"
        self.psql(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE}")
        return self.url(name)
