"""A real forward proxy on loopback for tests: ``proxy.py`` (PyPI) in its own process.

``proxy.py`` forwards ``http://`` requests sent in absolute form and tunnels ``CONNECT``;
with ``basic_auth="user:password"`` it answers 407 to a request without those credentials.
It writes one access-log line per request it handled (``GET 127.0.0.1:41234/path - 200 OK``,
``CONNECT 127.0.0.1:41234 - ...``) to a log file, which :meth:`ForwardProxy.seen` reads.

Usage::

    with ForwardProxy(tmp_path) as proxy:
        env = {"HTTPS_PROXY": proxy.url}
        ...
        proxy.wait_seen("CONNECT 127.0.0.1:")
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

__all__ = ["ForwardProxy"]

_START_S = 30.0
_ACCESS = re.compile(r"access_log:\d+ - \S+ - (?P<request>\S+ \S+)")


class ForwardProxy:
    """``python -m proxy`` bound to an ephemeral loopback port.

    Args:
        directory: Where its port file, log and data directory go.
        basic_auth: ``user:password`` the proxy requires (``None``: none).
    """

    def __init__(self, directory: Path, *, basic_auth: str | None = None) -> None:
        self.directory = directory
        self.basic_auth = basic_auth
        self.log = directory / "proxy.log"
        self._port_file = directory / "proxy.port"
        self._process: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self) -> ForwardProxy:
        """Start it and wait (with a deadline) until it listens."""
        self.directory.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable,
            "-m",
            "proxy",
            "--hostname",
            "127.0.0.1",
            "--port",
            "0",
            "--port-file",
            str(self._port_file),
            "--num-acceptors",
            "1",
            "--num-workers",
            "1",
            "--log-file",
            str(self.log),
            "--data-dir",
            str(self.directory / "data"),
        ]
        if self.basic_auth is not None:
            argv += ["--basic-auth", self.basic_auth]
        with (self.directory / "proxy.stderr").open("wb") as stderr:
            self._process = subprocess.Popen(
                argv,
                cwd=self.directory,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,  # its workers share its process group, stopped with it
            )
        deadline = time.monotonic() + _START_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"proxy.py exited with {self._process.returncode}: "
                    + (self.directory / "proxy.stderr").read_text(errors="replace")[-2000:]
                )
            text = self._port_file.read_text() if self._port_file.exists() else ""
            if text.strip().isdigit() and self._listening(int(text.strip())):
                self.port = int(text.strip())
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"proxy.py did not listen within {_START_S} s")

    @staticmethod
    def _listening(port: int) -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return True
        return False

    def stop(self) -> None:
        """SIGTERM its process group, then SIGKILL what is left after 10 s."""
        process, self._process = self._process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # workers left behind by the parent

    def __enter__(self) -> ForwardProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (no credentials)."""
        return f"http://127.0.0.1:{self.port}"

    def url_with(self, userinfo: str) -> str:
        """``http://USERINFO@127.0.0.1:PORT``."""
        return f"http://{userinfo}@127.0.0.1:{self.port}"

    def seen(self) -> list[str]:
        """The requests the proxy logged so far, e.g. ``GET 127.0.0.1:41234/a/b`` or
        ``CONNECT 127.0.0.1:41234``."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return [found.group("request") for found in _ACCESS.finditer(text)]

    def wait_seen(self, prefix: str, *, count: int = 1, timeout_s: float = 10.0) -> list[str]:
        """The logged requests starting with ``prefix``, once there are ``count`` of them.

        The proxy logs a request when its connection closes, so this polls (deadline
        ``timeout_s``).

        Raises:
            AssertionError: fewer than ``count`` within the deadline.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            matching = [line for line in self.seen() if line.startswith(prefix)]
            if len(matching) >= count or time.monotonic() > deadline:
                assert len(matching) >= count, (prefix, self.seen())
                return matching
            time.sleep(0.05)
