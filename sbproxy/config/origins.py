"""``origins``: host-matched gateway actions, their managed-model providers, and the
compatibility ``serve:`` block that older configurations put on a provider.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from sbproxy.config._rules import ConfigModel, Identifier, NonBlank, RuleViolation
from sbproxy.config.model_host import (
    _MAX_U32,
    _ONE_YEAR_SECS,
    MAX_CACHE_BUDGET_GIB,
    UNSUPPORTED_DEPLOYMENT_FIELDS,
    AbsolutePath,
    EngineChoice,
    KvQuant,
    resolve_relative,
)

__all__ = [
    "AiProxyAction",
    "OriginConfig",
    "ProviderConfig",
    "ServeBlock",
    "ServeEntry",
    "parse_duration_secs",
]

_DURATION_RE = re.compile(r"^(\d+)\s*(s|m|h|d)?$")
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, None: 1}

# Legacy entry fields that do not survive lowering, with what to do instead.
_UNSUPPORTED_SERVE_FIELDS: dict[str, str] = {
    **UNSUPPORTED_DEPLOYMENT_FIELDS,
    "chunked_prefill": "chunked prefill is not carried over from serve:; declare a canonical "
    "vLLM deployment under proxy.model_host.deployments instead",
    "tool_call_parser": "tool-call parsers are not carried over from serve:; declare a canonical "
    "vLLM deployment under proxy.model_host.deployments instead",
    "swap_space_gib": "swap space is not carried over from serve:; declare a canonical vLLM "
    "deployment under proxy.model_host.deployments instead",
    "cpu_offload_gib": "CPU offload is not carried over from serve:; declare a canonical vLLM "
    "deployment under proxy.model_host.deployments instead",
    "modality": "modality comes from the catalog entry; remove the field",
}


def parse_duration_secs(value: int | str) -> int:
    """Parse a keep-alive duration: an integer of seconds or ``<n>s|m|h|d`` (``"30m"`` -> 1800).

    Raises:
        ValueError: for anything else, or a zero duration.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        seconds = value
    else:
        match = _DURATION_RE.match(str(value).strip())
        if not match:
            raise ValueError(
                f"{value!r} is not a duration; write seconds or a number with s, m, h or d "
                "(e.g. 30m)"
            )
        seconds = int(match.group(1)) * _DURATION_UNITS[match.group(2)]
    if seconds <= 0:
        raise ValueError("must be a positive duration")
    # The bound of the lowered keep_alive_secs; it also keeps the entry, which is hashed as
    # RFC 8785 canonical JSON into the deployment id, inside that format's 2**53 - 1.
    if seconds > _ONE_YEAR_SECS:
        raise ValueError(f"is {seconds} seconds; at most {_ONE_YEAR_SECS} (366 days) is allowed")
    return seconds


class ServeEntry(ConfigModel):
    """One model of a compatibility ``serve:`` block."""

    model: NonBlank = Field(description="Catalog v2 logical model id.")
    variant: Identifier | None = Field(default=None, description="Exact catalog variant.")
    name: NonBlank | None = Field(
        default=None, description="Public model name; default: the catalog id."
    )
    engine: EngineChoice = Field(default=EngineChoice.AUTO, description="auto, llama_cpp or vllm.")
    keep_alive: int | str | None = Field(
        default=None, description="Idle time before stop: seconds or e.g. 30m, 2h."
    )
    # Bounded like the lowered max_context, and so inside RFC 8785's 2**53 - 1: the entry is
    # hashed as canonical JSON into the deployment id.
    max_context: int | None = Field(
        default=None, ge=1, le=_MAX_U32, description="Context length in tokens."
    )
    extra_args: list[str] = Field(default_factory=list, description="Allowlisted engine flags.")
    kv_quant: KvQuant = Field(default=KvQuant.AUTO, description="KV-cache element type.")
    enable_prefix_caching: bool = Field(
        default=False, description="vLLM prefix caching (engine: vllm only)."
    )
    pinned: bool = Field(default=False, description="Never evict for another deployment.")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            found = [k for k in data if k in _UNSUPPORTED_SERVE_FIELDS]
            if found:
                raise RuleViolation([((k,), f"{k}: {_UNSUPPORTED_SERVE_FIELDS[k]}") for k in found])
        return data

    @field_validator("model")
    @classmethod
    def _catalog_id(cls, value: str) -> str:
        if value.startswith("hf:") or "/" in value or ":" in value:
            raise ValueError(
                f"{value!r} is a raw repository reference, which bypasses catalog v2 pinning; "
                "add the model to a catalog (catalog_file) and use its id"
            )
        return value

    @field_validator("keep_alive")
    @classmethod
    def _duration(cls, value: int | str | None) -> int | str | None:
        if value is not None:
            parse_duration_secs(value)
        return value

    @model_validator(mode="after")
    def _prefix_caching(self) -> ServeEntry:
        if self.enable_prefix_caching and self.engine != EngineChoice.VLLM:
            raise RuleViolation.at(
                "enable_prefix_caching",
                "enable_prefix_caching applies to vLLM only (llama.cpp reuses prompt cache "
                "by default); remove it or set engine: vllm",
            )
        return self


class ServeBlock(ConfigModel):
    """A provider-level compatibility ``serve:`` block, lowered to canonical deployments."""

    models: list[ServeEntry] = Field(min_length=1, description="Models to serve.")
    cache_dir: AbsolutePath | None = Field(
        default=None, description="Legacy cache root (absolute)."
    )
    catalog_file: str | None = Field(default=None, description="Legacy operator catalog file.")
    cache_budget_gib: float | None = Field(
        default=None, gt=0, le=MAX_CACHE_BUDGET_GIB, description="Legacy cache budget."
    )
    eviction: Literal["lru", "never"] = Field(default="lru", description="Legacy eviction policy.")
    max_concurrent_requests: int | None = Field(
        default=None, ge=1, description="Becomes each lowered deployment's max_concurrency."
    )
    queue_timeout_ms: int | None = Field(
        default=None, ge=1, description="Becomes each lowered deployment's queue_timeout_ms."
    )
    allow_unpinned_refs: bool = Field(
        default=False, description="Must stay false: unpinned references are refused."
    )

    _resolve_catalog = field_validator("catalog_file")(resolve_relative)

    @model_validator(mode="before")
    @classmethod
    def _refuse_engines(cls, data: Any) -> Any:
        if isinstance(data, dict) and "engines" in data:
            raise RuleViolation.at(
                "engines",
                "legacy engine knobs are not carried over; move engine policy to "
                "proxy.model_host.engines",
            )
        return data

    @field_validator("allow_unpinned_refs")
    @classmethod
    def _pinned_only(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "unpinned repository references are not supported; pin catalog v2 artifacts"
            )
        return value


class ProviderConfig(ConfigModel):
    """One provider of an ``ai_proxy`` action."""

    name: NonBlank = Field(description="Provider name, unique within its origin.")
    provider_type: Literal["managed_model"] = Field(
        description="managed_model: a deployment of this node's model host."
    )
    deployment: Identifier | None = Field(
        default=None, description="Id of a proxy.model_host.deployments entry."
    )
    models: list[NonBlank] = Field(
        default_factory=list,
        description="Public model names; empty exposes the deployment id.",
    )
    default_model: NonBlank | None = Field(
        default=None, description="Model used when a request names none; must be in models."
    )
    serve: ServeBlock | None = Field(
        default=None, description="Compatibility form; prefer deployment."
    )

    @model_validator(mode="after")
    def _shape(self) -> ProviderConfig:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        if self.deployment is None and self.serve is None:
            problems.append((("deployment",), "a managed_model provider needs deployment: <id>"))
        if self.deployment is not None and self.serve is not None:
            problems.append(
                (("serve",), "give deployment or the compatibility serve: block, not both")
            )
        seen: set[str] = set()
        for index, name in enumerate(self.models):
            if name in seen:
                problems.append((("models", index), f"duplicate public model name {name!r}"))
            seen.add(name)
        public = self.public_models()
        if self.default_model is not None and self.default_model not in public:
            problems.append(
                (
                    ("default_model",),
                    f"default_model {self.default_model!r} is not one of this provider's "
                    f"models ({', '.join(public) or 'none'})",
                )
            )
        if problems:
            raise RuleViolation(problems)
        return self

    def public_models(self) -> list[str]:
        """Public names this provider exposes (models, else serve entry names, else the id)."""
        if self.models:
            return list(self.models)
        if self.serve is not None:
            return [entry.name or entry.model for entry in self.serve.models]
        return [self.deployment] if self.deployment else []


class AiProxyAction(ConfigModel):
    """``origins.<host>.action`` of type ``ai_proxy``."""

    type: Literal["ai_proxy"] = Field(description="ai_proxy: an OpenAI-compatible route.")
    providers: list[ProviderConfig] = Field(min_length=1, description="Providers of this origin.")

    @model_validator(mode="after")
    def _unique_names(self) -> AiProxyAction:
        seen: set[str] = set()
        for index, provider in enumerate(self.providers):
            if provider.name in seen:
                raise RuleViolation.at(
                    ("providers", index, "name"), f"duplicate provider name {provider.name!r}"
                )
            seen.add(provider.name)
        return self


class OriginConfig(ConfigModel):
    """``origins.<host>``: what the gateway does for requests whose Host matches."""

    action: AiProxyAction = Field(description="The origin's action.")
