"""Artifact sources: ``hf:Org/Repo`` (Hugging Face ``resolve`` URLs) and ``file:/abs/path``.

URLs: ``{HF_ENDPOINT or https://huggingface.co}/{repo}/resolve/{revision}/{path}``, each path
component percent-encoded. Credentials: ``HF_TOKEN``, else ``HUGGING_FACE_HUB_TOKEN``, read
from the environment when a download starts and sent only as an ``Authorization: Bearer``
header to the endpoint's own origin. They are never part of a URL, a job input, a resume
state file or metadata, and they are registered with :mod:`sbproxy.redact` so no error
message can carry them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import quote, urlsplit, urlunsplit

from sbproxy.model_host.artifacts.errors import SourceError
from sbproxy.redact import register_secret

__all__ = [
    "DEFAULT_HF_ENDPOINT",
    "FileSource",
    "HfSource",
    "Source",
    "hf_endpoint",
    "hf_token",
    "parse_source",
    "same_origin",
]

DEFAULT_HF_ENDPOINT = "https://huggingface.co"
_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class HfSource:
    """A Hugging Face repository."""

    repo: str

    def url(self, *, revision: str, path: str, endpoint: str) -> str:
        """The ``resolve`` URL of one file at one revision."""
        parts = "/".join(quote(part, safe="") for part in PurePosixPath(path).parts)
        return f"{endpoint.rstrip('/')}/{self.repo}/resolve/{quote(revision, safe='')}/{parts}"


@dataclass(frozen=True)
class FileSource:
    """A local directory (several files) or a file (a one-file variant)."""

    path: Path

    def file(self, relpath: str, *, single: bool) -> Path:
        """Where ``relpath`` lives under this source.

        Raises:
            SourceError: ``invalid_source`` for a symlink anywhere on the way, a path that
                leaves the source root, or a missing file.
        """
        target = self.path if single and not self.path.is_dir() else self.path / relpath
        for candidate in (target, *target.parents):
            if candidate == candidate.parent:
                break
            if candidate.is_symlink():
                raise SourceError(
                    f"{candidate} is a symbolic link; file: sources must be real files",
                    remediation="Copy the file into place instead of linking it.",
                )
            if candidate == self.path:
                break
        if not single and not target.resolve().is_relative_to(self.path.resolve()):
            raise SourceError(f"{relpath!r} leaves the source directory {self.path}")
        if not target.is_file():
            raise SourceError(f"{target} does not exist or is not a regular file")
        return target


Source = HfSource | FileSource


def parse_source(text: str) -> Source:
    """Parse a catalog ``source``.

    Raises:
        SourceError: ``invalid_source`` for anything but ``hf:Org/Repo`` or ``file:/abs``.
    """
    if text.startswith("hf:"):
        repo = text[3:]
        if not _REPO_RE.match(repo):
            raise SourceError(f"{text!r} is not hf:<org>/<repo>")
        return HfSource(repo=repo)
    if text.startswith("file:"):
        path = Path(text[5:])
        if not path.is_absolute() or ".." in path.parts:
            raise SourceError(f"{text!r} must be file: followed by an absolute path")
        return FileSource(path=path)
    raise SourceError(f"{text!r} is not a supported source (hf:<org>/<repo> or file:/abs/path)")


def hf_endpoint(environ: Mapping[str, str] | None = None) -> str:
    """``HF_ENDPOINT`` or the public hub.

    Raises:
        SourceError: ``invalid_endpoint`` when the endpoint carries credentials
            (``http://user:secret@host``): the URL of every file is journaled and kept in
            resume state, so they would be stored in plain text. The message shows the URL
            with its user information replaced by ``***``.
    """
    env = os.environ if environ is None else environ
    endpoint = (env.get("HF_ENDPOINT") or DEFAULT_HF_ENDPOINT).rstrip("/")
    try:
        parts = urlsplit(endpoint)
        no_port = parts.port == 0  # reading the port parses it, and range-checks it
    except ValueError as exc:
        raise _bad_endpoint(f"HF_ENDPOINT is not a valid URL ({exc})") from None
    if "@" in parts.netloc:
        userinfo, _, hostport = parts.netloc.rpartition("@")
        # Belt and braces: whatever else prints an error, the secret is redacted there too.
        register_secret(userinfo)
        if parts.password:
            register_secret(parts.password)
        shown = urlunsplit(parts._replace(netloc=f"***@{hostport}"))
        raise SourceError(
            f"HF_ENDPOINT {shown} carries credentials; credentials in HF_ENDPOINT are not "
            "supported (file URLs are journaled).",
            code="invalid_endpoint",
            remediation="Remove the user:password@ part from HF_ENDPOINT and put the token in "
            "HF_TOKEN, which is sent only as an Authorization: Bearer header.",
            details={"endpoint": shown},
        )
    if parts.scheme not in ("http", "https") or not parts.hostname or no_port:
        raise _bad_endpoint("HF_ENDPOINT must be an http(s) URL with a host (and a port 1-65535)")
    if parts.query or parts.fragment:
        # Anything after ? or # would be journaled inside every file URL (and could be a
        # token); an endpoint is a base URL only.
        shown = urlunsplit(parts._replace(query="***" if parts.query else "", fragment=""))
        raise _bad_endpoint(f"HF_ENDPOINT {shown} has a query or fragment; it must be a base URL")
    return endpoint


def _bad_endpoint(problem: str) -> SourceError:
    return SourceError(
        f"{problem}.",
        code="invalid_endpoint",
        remediation="Set HF_ENDPOINT to the mirror's base URL, e.g. https://hf-mirror.example "
        "(credentials go in HF_TOKEN).",
    )


def hf_token(environ: Mapping[str, str] | None = None) -> str | None:
    """The Hugging Face token from the environment, registered for redaction.

    Raises:
        SourceError: ``invalid_source`` for a token with CR or LF (it would split headers).
    """
    env = os.environ if environ is None else environ
    token = env.get("HF_TOKEN") or env.get("HUGGING_FACE_HUB_TOKEN") or None
    if token is None:
        return None
    if "\r" in token or "\n" in token:
        raise SourceError("HF_TOKEN contains a line break; set it to the bare token")
    register_secret(token)
    return token


def same_origin(left: str, right: str) -> bool:
    """Whether two URLs share scheme, host and port (credentials may follow a redirect)."""
    a, b = urlsplit(left), urlsplit(right)
    return (a.scheme, a.hostname, a.port) == (b.scheme, b.hostname, b.port)
