"""The root of ``sb.yml``."""

from __future__ import annotations

from pydantic import Field

from sbproxy.config._rules import ConfigModel
from sbproxy.config.origins import OriginConfig
from sbproxy.config.proxy import ProxyConfig

__all__ = ["SbConfig"]


class SbConfig(ConfigModel):
    """A whole ``sb.yml``: the gateway process and its host-matched origins."""

    proxy: ProxyConfig = Field(default_factory=ProxyConfig, description="The gateway process.")
    origins: dict[str, OriginConfig] = Field(
        default_factory=dict,
        description="Origins by Host header value (e.g. localhost, api.example.com).",
    )
