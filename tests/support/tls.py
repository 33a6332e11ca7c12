"""A throwaway certificate authority for HTTPS test servers (``trustme``).

:func:`loopback_ca` makes a CA and a certificate for ``127.0.0.1`` signed by it, and writes
the CA to a PEM file: a client trusts it through ``SSL_CERT_FILE`` (OpenSSL's default verify
paths, which :func:`ssl.create_default_context` loads), as an operator behind a
TLS-inspecting proxy would point it at the proxy's CA.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import trustme

__all__ = ["LoopbackCa", "loopback_ca"]


@dataclass(frozen=True)
class LoopbackCa:
    """A server context for ``127.0.0.1`` and the PEM file of the CA that signed it."""

    server: ssl.SSLContext
    ca_pem: Path


def loopback_ca(directory: Path) -> LoopbackCa:
    """A fresh CA (its PEM written under ``directory``) and a server context for 127.0.0.1."""
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(server)
    directory.mkdir(parents=True, exist_ok=True)
    pem = directory / "loopback-ca.pem"
    ca.cert_pem.write_to_path(str(pem))
    return LoopbackCa(server=server, ca_pem=pem)
