from __future__ import annotations

import textwrap
from collections.abc import Callable

import pytest

from sbproxy.config import CompiledConfig, load_config_text
from sbproxy.errors import ConfigError, ConfigIssue

BASE = """
proxy:
  model_host:
    cache:
      directory: /var/lib/sbproxy/models
    deployments:
      local-qwen:
        model: qwen2.5-0.5b-instruct
        variant: q4_k_m
origins:
  localhost:
    action:
      type: ai_proxy
      providers:
        - name: local
          provider_type: managed_model
          deployment: local-qwen
          models: [qwen]
          default_model: qwen
"""


def load(text: str, env: dict[str, str] | None = None) -> CompiledConfig:
    return load_config_text(textwrap.dedent(text), source="sb.yml", env=env or {})


def issues(text: str, env: dict[str, str] | None = None) -> list[ConfigIssue]:
    with pytest.raises(ConfigError) as info:
        load(text, env)
    assert info.value.code == "invalid_config"
    return info.value.issues


@pytest.fixture
def errors_at() -> Callable[..., dict[str, str]]:
    """Map dotted path -> message for a configuration that must be invalid."""

    def run(text: str, env: dict[str, str] | None = None) -> dict[str, str]:
        return {issue.path: issue.message for issue in issues(text, env)}

    return run
