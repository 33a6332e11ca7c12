"""``proxy``: listeners, the admin API and the API key records of the gateway."""

from __future__ import annotations

import ipaddress
from enum import StrEnum
from typing import Annotated

from pydantic import (
    AfterValidator,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from sbproxy.config._rules import ConfigModel, Identifier, NonBlank, RuleViolation, is_sha256_hex
from sbproxy.config.model_host import ModelHostConfig, resolve_relative

__all__ = [
    "AdminConfig",
    "AdminTlsConfig",
    "ApiKeyRecord",
    "BudgetPeriod",
    "PriorityClass",
    "ProxyConfig",
    "TokenBudget",
]

# Shortest literal API key accepted: 16 characters keep an online guess out of reach while
# still allowing operator-chosen keys; generated keys are much longer.
_MIN_KEY_CHARS = 16


def _check_ip(value: str) -> str:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ValueError(
            f"{value!r} is not an IP address; use 127.0.0.1 (loopback) or an interface address"
        ) from None
    return value


IpAddress = Annotated[str, AfterValidator(_check_ip)]


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


class AdminTlsConfig(ConfigModel):
    """``proxy.admin.tls``: certificate and key for a non-loopback admin listener."""

    cert_file: NonBlank = Field(
        description="PEM certificate chain; relative to sb.yml's directory."
    )
    key_file: NonBlank = Field(description="PEM private key; relative to sb.yml's directory.")

    @field_validator("cert_file", "key_file")
    @classmethod
    def _resolve(cls, value: str, info: ValidationInfo) -> str:
        resolved = resolve_relative(value, info)
        assert resolved is not None  # noqa: S101 - value is a non-blank str here
        return resolved


class AdminConfig(ConfigModel):
    """``proxy.admin``: the authenticated admin listener (HTTP Basic)."""

    enabled: bool = Field(default=False, description="Serve the admin API.")
    bind: IpAddress = Field(
        default="127.0.0.1",
        description="Listen address. Anything but loopback needs tls and ip_allowlist.",
    )
    port: int = Field(default=9090, ge=1, le=65535, description="Listen port.")
    username: NonBlank = Field(default="admin", description="HTTP Basic user name.")
    password: SecretStr | None = Field(
        default=None,
        description="HTTP Basic password; required when enabled. Use ${SB_ADMIN_PASSWORD}.",
    )
    tls: AdminTlsConfig | None = Field(default=None, description="TLS for the admin listener.")
    ip_allowlist: list[str] = Field(
        default_factory=list,
        description="Client networks (CIDR) allowed to reach the admin listener.",
    )

    @field_validator("ip_allowlist")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for entry in value:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(
                    f"{entry!r} is not a network; write an address or CIDR such as 10.0.0.0/8"
                ) from None
        return value

    @model_validator(mode="after")
    def _exposure_rules(self) -> AdminConfig:
        if not self.enabled:
            return self
        problems: list[tuple[tuple[str | int, ...], str]] = []
        if self.password is None or not self.password.get_secret_value().strip():
            problems.append(
                (("password",), "an enabled admin listener needs a password (${SB_ADMIN_PASSWORD})")
            )
        if not _is_loopback(self.bind):
            if self.tls is None:
                problems.append(
                    (
                        ("tls",),
                        f"admin bind {self.bind} is not loopback: configure tls "
                        "(cert_file, key_file) and ip_allowlist, or bind 127.0.0.1",
                    )
                )
            if not self.ip_allowlist:
                problems.append(
                    (
                        ("ip_allowlist",),
                        f"admin bind {self.bind} is not loopback: list the operator networks "
                        "in ip_allowlist, or bind 127.0.0.1",
                    )
                )
        if problems:
            raise RuleViolation(problems)
        return self


class PriorityClass(StrEnum):
    """Admission priority of a key's requests: interactive ahead of standard ahead of batch."""

    INTERACTIVE = "interactive"
    STANDARD = "standard"
    BATCH = "batch"


class BudgetPeriod(StrEnum):
    """Window over which a token budget is counted (calendar periods, UTC)."""

    HOUR = "hour"
    DAY = "day"
    WEEK = "week"
    MONTH = "month"


class TokenBudget(ConfigModel):
    """A per-key token allowance, enforced before a request reaches the engine."""

    max_tokens: int = Field(ge=1, description="Prompt plus completion tokens per period.")
    period: BudgetPeriod = Field(default=BudgetPeriod.DAY, description="Counting window (UTC).")


class ApiKeyRecord(ConfigModel):
    """One client API key of the gateway (``proxy.api_keys[]``)."""

    name: Identifier = Field(description="Stable key name, used in usage accounting and logs.")
    key: SecretStr | None = Field(
        default=None,
        description="The key itself (use ${VAR}); stored and compared only as a SHA-256 hash.",
    )
    key_sha256: str | None = Field(
        default=None, description="SHA-256 of the key, 64 lowercase hex; instead of key."
    )
    priority: PriorityClass = Field(
        default=PriorityClass.STANDARD, description="Admission class of this key's requests."
    )
    token_budget: TokenBudget | None = Field(default=None, description="Optional token budget.")

    @model_validator(mode="after")
    def _one_secret(self) -> ApiKeyRecord:
        if (self.key is None) == (self.key_sha256 is None):
            raise RuleViolation.at("key", "give exactly one of key or key_sha256")
        if self.key is not None and len(self.key.get_secret_value()) < _MIN_KEY_CHARS:
            raise RuleViolation.at("key", f"must be at least {_MIN_KEY_CHARS} characters long")
        if self.key_sha256 is not None and not is_sha256_hex(self.key_sha256):
            raise RuleViolation.at(
                "key_sha256", "must be 64 lowercase hexadecimal characters (SHA-256 of the key)"
            )
        return self


class ProxyConfig(ConfigModel):
    """``proxy``: the gateway process."""

    http_bind_port: int = Field(default=8080, ge=1, le=65535, description="Gateway port.")
    bind_address: IpAddress = Field(default="127.0.0.1", description="Gateway listen address.")
    admin: AdminConfig = Field(default_factory=AdminConfig, description="Admin API listener.")
    model_host: ModelHostConfig | None = Field(
        default=None, description="The managed model runtime of this node."
    )
    api_keys: list[ApiKeyRecord] = Field(
        default_factory=list,
        description="Client keys; empty means the gateway runs keyless (local use only).",
    )

    @model_validator(mode="after")
    def _listeners_and_keys(self) -> ProxyConfig:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        if self.admin.enabled and self.admin.port == self.http_bind_port:
            problems.append(
                (("admin", "port"), f"admin port {self.admin.port} is also http_bind_port")
            )
        names: set[str] = set()
        for index, record in enumerate(self.api_keys):
            if record.name in names:
                problems.append(
                    (("api_keys", index, "name"), f"duplicate key name {record.name!r}")
                )
            names.add(record.name)
        credential = self.model_host.fleet.credential if self.model_host is not None else None
        password = self.admin.password
        if (
            credential is not None
            and password is not None
            and credential.get_secret_value() == password.get_secret_value()
        ):
            problems.append(
                (
                    ("model_host", "fleet", "credential"),
                    "the fleet credential must not be the admin password (peers would hold "
                    "the admin login); give each its own secret",
                )
            )
        if problems:
            raise RuleViolation(problems)
        return self
