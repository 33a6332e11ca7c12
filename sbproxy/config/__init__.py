"""``sb.yml``: frozen pydantic models, the loader (``${VAR}`` interpolation, dotted-path
errors), ``serve:`` compatibility lowering and the JSON Schema export.
"""

from __future__ import annotations

from sbproxy.config._rules import dotted
from sbproxy.config.autoscale import ReplicaRange
from sbproxy.config.compile import CompiledConfig, Route, compile_config, legacy_deployment_id
from sbproxy.config.document import SbConfig
from sbproxy.config.engine_args import check_engine_args
from sbproxy.config.loader import load_config, load_config_text
from sbproxy.config.model_host import (
    FENCE_ASKS,
    MAX_CACHE_BUDGET_GIB,
    Authority,
    CacheConfig,
    ColdStart,
    DeploymentConfig,
    EngineChoice,
    EngineConfig,
    EnginesConfig,
    FleetConfig,
    KvQuant,
    ModelHostConfig,
    NodeConfig,
    PlacementStrategy,
    PullPolicy,
    Rollout,
    RoutingPolicy,
    SourceArchiveConfig,
    SplitMode,
    fence_bound_ms,
    peer_ask_timeout_ms,
)
from sbproxy.config.origins import (
    AiProxyAction,
    OriginConfig,
    ProviderConfig,
    ServeBlock,
    ServeEntry,
)
from sbproxy.config.proxy import (
    AdminConfig,
    AdminTlsConfig,
    ApiKeyRecord,
    BudgetPeriod,
    PriorityClass,
    ProxyConfig,
    TokenBudget,
)
from sbproxy.config.reference import config_reference_markdown
from sbproxy.config.schema import config_json_schema, config_json_schema_text

__all__ = [
    "FENCE_ASKS",
    "MAX_CACHE_BUDGET_GIB",
    "AdminConfig",
    "AdminTlsConfig",
    "AiProxyAction",
    "ApiKeyRecord",
    "Authority",
    "BudgetPeriod",
    "CacheConfig",
    "ColdStart",
    "CompiledConfig",
    "DeploymentConfig",
    "EngineChoice",
    "EngineConfig",
    "EnginesConfig",
    "FleetConfig",
    "KvQuant",
    "ModelHostConfig",
    "NodeConfig",
    "OriginConfig",
    "PlacementStrategy",
    "PriorityClass",
    "ProviderConfig",
    "ProxyConfig",
    "PullPolicy",
    "ReplicaRange",
    "Rollout",
    "Route",
    "RoutingPolicy",
    "SbConfig",
    "ServeBlock",
    "ServeEntry",
    "SourceArchiveConfig",
    "SplitMode",
    "TokenBudget",
    "check_engine_args",
    "compile_config",
    "config_json_schema",
    "config_json_schema_text",
    "config_reference_markdown",
    "dotted",
    "fence_bound_ms",
    "legacy_deployment_id",
    "load_config",
    "load_config_text",
    "peer_ask_timeout_ms",
]
