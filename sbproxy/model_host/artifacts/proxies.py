"""Forward proxies for downloads: ``HTTPS_PROXY``, ``HTTP_PROXY``, ``ALL_PROXY``, ``NO_PROXY``.

Which proxy a URL goes through (the conventions curl, requests and urllib share):

* an ``https://`` URL: ``https_proxy``, else ``HTTPS_PROXY``, else ``all_proxy``, else
  ``ALL_PROXY``; an ``http://`` URL the same with ``http_proxy``/``HTTP_PROXY``. The lowercase
  name wins when both are set; an empty value counts as unset.
* unless the URL's host matches ``no_proxy`` (else ``NO_PROXY``): a comma- or space-separated
  list whose entries are ``*`` (every host), a host name that also matches its subdomains
  (``example.com`` and ``.example.com`` and ``*.example.com`` all match ``example.com`` and
  ``cdn.example.com``, not ``badexample.com``), an IP address (``127.0.0.1``, ``::1``,
  ``[::1]``), a CIDR block (``10.0.0.0/8``, ``fd00::/8``), each optionally with ``:port`` to
  match only that port. Host names compare case-insensitively; an IP entry matches only a URL
  that names the address (no name is resolved to decide).

A proxy URL is ``http://[user:password@]host[:port][/]`` (the port defaults to 80; ``host:port``
without a scheme means ``http://``). ``https://`` URLs go through it as a ``CONNECT`` tunnel
(TLS runs end to end, the proxy sees only the host and port), ``http://`` URLs as absolute-form
requests. The user and password (percent-decoded) become a ``Proxy-Authorization: Basic``
header sent to the proxy only; they are registered with :mod:`sbproxy.redact` when read, and
no error, log line or journal entry shows them: a proxy is always shown as
``http://host:port``.

A proxy URL that cannot be used is :class:`~sbproxy.model_host.artifacts.errors.ProxyError`
(``invalid_proxy``) naming the variable; TLS to the proxy itself (``https://`` proxy URLs) and
SOCKS are not supported and refused the same way.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from sbproxy.errors import JsonScalar, SbproxyError
from sbproxy.model_host.artifacts.errors import HttpStatusError, ProxyError, TransportError
from sbproxy.redact import register_secret

__all__ = ["Proxy", "ProxySettings", "proxy_settings", "refused", "tunnel_status"]

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_DEFAULT_PORT = 80
_HOST_NAME = re.compile(r"[a-z0-9_-]+(?:\.[a-z0-9_-]+)*\.?")
_TUNNEL_FAILED = re.compile(r"Tunnel connection failed: (\d{3})\s*(.*)")
_REMEDIATION = (
    "Set it to http://[user:password@]host:port (percent-encode special characters in the "
    "user and password), or unset it to connect directly."
)


@dataclass(frozen=True)
class Proxy:
    """One forward proxy.

    Attributes:
        host: The proxy's host name or IP address (without brackets).
        port: Its TCP port.
        variable: The environment variable it was read from, e.g. ``HTTPS_PROXY``.
        authorization: The ``Proxy-Authorization`` header value (``Basic ...``), or
            ``None``; a secret (never in ``repr``).
    """

    host: str
    port: int
    variable: str
    authorization: str | None = field(default=None, repr=False)

    @property
    def shown(self) -> str:
        """``http://host:port``: the proxy as messages name it, never with credentials."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def headers(self) -> dict[str, str]:
        """The headers the proxy needs (``Proxy-Authorization`` when it has credentials)."""
        return {"Proxy-Authorization": self.authorization} if self.authorization else {}


@dataclass(frozen=True)
class _Bypass:
    """One ``NO_PROXY`` entry: a name suffix or an IP network, and maybe a port."""

    name: str | None
    network: IpNetwork | None
    port: int | None

    def matches(self, host: str, port: int, address: IpAddress | None) -> bool:
        if self.port is not None and self.port != port:
            return False
        if self.network is not None:
            return (
                address is not None
                and address.version == self.network.version
                and address in self.network
            )
        assert self.name is not None  # noqa: S101 - an entry is a name or a network
        return host == self.name or host.endswith("." + self.name)


@dataclass(frozen=True)
class ProxySettings:
    """The proxies of the environment, read once (:func:`proxy_settings`).

    Attributes:
        http: The proxy for ``http://`` URLs, or ``None``.
        https: The proxy for ``https://`` URLs, or ``None``.
        bypass_all: ``NO_PROXY`` is ``*``.
        bypass: The other ``NO_PROXY`` entries.
    """

    http: Proxy | None = None
    https: Proxy | None = None
    bypass_all: bool = False
    bypass: tuple[_Bypass, ...] = ()

    def for_url(self, url: str) -> Proxy | None:
        """The proxy a GET of ``url`` goes through, or ``None`` to connect directly."""
        parts = urlsplit(url)
        proxy = {"https": self.https, "http": self.http}.get(parts.scheme)
        if proxy is None or self.bypass_all:
            return None
        host = (parts.hostname or "").lower()
        port = parts.port or (443 if parts.scheme == "https" else 80)
        address = _ip(host)
        if any(entry.matches(host, port, address) for entry in self.bypass):
            return None
        return proxy


def proxy_settings(environ: Mapping[str, str] | None = None) -> ProxySettings:
    """Read the proxy variables (see the module docstring) from ``environ`` (default
    ``os.environ``).

    Raises:
        ProxyError: ``invalid_proxy`` for a proxy URL that cannot be used (not a URL, no
            host, a bad port, a path or query, a scheme other than ``http``, a line break in
            its credentials) or a ``NO_PROXY`` entry that is not a host, address or CIDR
            block; the message and ``details`` name the variable and show the URL with its
            credentials replaced by ``***``.
    """
    env = os.environ if environ is None else environ
    fallback = _first(env, "all_proxy", "ALL_PROXY")
    http = _first(env, "http_proxy", "HTTP_PROXY") or fallback
    https = _first(env, "https_proxy", "HTTPS_PROXY") or fallback
    no_proxy = _first(env, "no_proxy", "NO_PROXY")
    variable, listed = no_proxy or ("NO_PROXY", "")
    entries = listed.replace(",", " ").split()
    return ProxySettings(
        http=_parse_proxy(*http) if http else None,
        https=_parse_proxy(*https) if https else None,
        bypass_all="*" in entries,
        bypass=tuple(_parse_bypass(entry, variable=variable) for entry in entries if entry != "*"),
    )


def _first(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return None


def _ip(host: str) -> IpAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _hidden(value: str) -> str:
    """``value`` with everything before its last ``@`` (the user information, even with an
    unencoded ``/`` in it) replaced by ``***``."""
    scheme, sep, rest = value.partition("://") if "://" in value else ("", "", value)
    if "@" in rest:
        rest = "***@" + rest.rpartition("@")[2]
    return f"{scheme}{sep}{rest}"


def _invalid(variable: str, value: str, problem: str) -> ProxyError:
    shown = _hidden(value)
    return ProxyError(
        f"{variable}={shown} cannot be used as a proxy: {problem}.",
        remediation=_REMEDIATION,
        details={"variable": variable, "proxy": shown},
    )


def _parse_proxy(variable: str, value: str) -> Proxy:
    """The :class:`Proxy` of one variable's value (see :func:`proxy_settings`)."""
    text = value if "://" in value else f"http://{value}"
    # A proxy URL has no path, so everything before the last "@" is user information.
    userinfo = text.partition("://")[2].rpartition("@")[0]
    # Registered before anything can fail, so that no message can carry them.
    register_secret(userinfo)
    register_secret(unquote(userinfo.partition(":")[2]))
    if any(c in userinfo for c in "/?#"):
        raise _invalid(variable, value, "its user or password has an unencoded '/', '?' or '#'")
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise _invalid(variable, value, f"it is not a valid URL ({exc})") from None
    if parts.scheme != "http":
        raise _invalid(
            variable,
            value,
            f"the scheme {parts.scheme!r} is not supported (only http:// proxies are; "
            "https:// sites still get end-to-end TLS through them)",
        )
    if not parts.hostname:
        raise _invalid(variable, value, "it names no host")
    if port == 0:
        raise _invalid(variable, value, "the port must be 1-65535")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise _invalid(variable, value, "a proxy URL has no path, query or fragment")
    authorization = None
    if userinfo:
        user, password = unquote(parts.username or ""), unquote(parts.password or "")
        if any(c in user + password for c in "\r\n"):
            raise _invalid(variable, value, "its user or password contains a line break")
        token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
        register_secret(token)
        authorization = f"Basic {token}"
    return Proxy(
        host=parts.hostname,
        port=port or _DEFAULT_PORT,
        variable=variable,
        authorization=authorization,
    )


def _parse_bypass(entry: str, *, variable: str) -> _Bypass:
    """One ``NO_PROXY`` entry (see the module docstring)."""
    text, port = entry.lower(), None
    if text.startswith("["):  # [v6] or [v6]:port
        address, _, rest = text[1:].partition("]")
        if rest.startswith(":") and rest[1:].isdigit():
            port = int(rest[1:])
        elif rest:
            raise _bad_entry(variable, entry)
        text = address
    elif text.count(":") == 1:  # name:port or v4:port (a bare v6 address has more colons)
        text, _, digits = text.partition(":")
        if not digits.isdigit():
            raise _bad_entry(variable, entry)
        port = int(digits)
    if port is not None and not 0 < port < 65536:
        raise _bad_entry(variable, entry)
    try:
        network = ipaddress.ip_network(text, strict=False)
    except ValueError:
        network = None
    if network is not None:
        return _Bypass(name=None, network=network, port=port)
    name = text.removeprefix("*").lstrip(".")
    if not _HOST_NAME.fullmatch(name):
        raise _bad_entry(variable, entry)
    return _Bypass(name=name, network=None, port=port)


def _bad_entry(variable: str, entry: str) -> ProxyError:
    return ProxyError(
        f"{variable} entry {entry!r} is not a host name, IP address or CIDR block "
        "(optionally with :port).",
        remediation="List hosts to reach directly separated by commas, e.g. "
        "NO_PROXY=localhost,127.0.0.1,.internal.example,10.0.0.0/8",
        details={"variable": variable, "entry": entry},
    )


def refused(proxy: Proxy, url: str, status: int, reason: str) -> SbproxyError:
    """The error for a proxy that answered ``status`` instead of forwarding a GET of ``url``
    (to its ``CONNECT`` or to the request itself).

    Returns:
        ``http_status`` (not retryable) for 407 (the proxy wants other credentials) and the
        other 4xx (its policy refuses the host); ``transport`` (retryable) for 5xx (the
        proxy could not reach the host, or is overloaded).
    """
    host = urlsplit(url).hostname or url
    where = f"the proxy {proxy.shown} from {proxy.variable}"
    details: dict[str, JsonScalar] = {
        "status": status,
        "proxy": proxy.shown,
        "variable": proxy.variable,
    }
    said = f"{status} {reason}".strip()
    if status >= 500:
        return TransportError(
            f"{where} could not forward GET {url} ({said})",
            remediation=f"Check that the proxy can reach {host}, or add {host} to NO_PROXY to "
            "connect directly.",
            details=details,
        )
    if status == 407:
        hint = (
            f"Put the user and password the proxy expects in {proxy.variable} "
            "(http://user:password@host:port)."
            if proxy.authorization is None
            else f"Check the user and password in {proxy.variable}."
        )
    else:
        hint = f"Ask for {host} to be allowed through the proxy, or add it to NO_PROXY."
    return HttpStatusError(f"{where} refused GET {url} ({said})", remediation=hint, details=details)


def tunnel_status(exc: BaseException) -> tuple[int, str] | None:
    """The status and reason of a refused ``CONNECT`` from the error ``http.client`` raises
    for it (``Tunnel connection failed: 407 Proxy Authentication Required``), else ``None``."""
    found = _TUNNEL_FAILED.match(str(exc))
    return (int(found.group(1)), found.group(2)) if found else None
