"""Engines of the model host: driver contract, llama.cpp acquisition and launch, source
builds, supervised processes."""

from __future__ import annotations

from sbproxy.model_host.engines.driver import (
    Availability,
    Detection,
    LaunchPlan,
    LaunchRequest,
    check_snapshot,
    launch,
)
from sbproxy.model_host.engines.errors import EngineError
from sbproxy.model_host.engines.llama_build import (
    BuildInput,
    BuildOutput,
    build_identity,
    engine_build_workflow,
    published_build,
)
from sbproxy.model_host.engines.llama_cpp import detect_llama_cpp, plan_llama_launch, read_version
from sbproxy.model_host.engines.process import (
    EngineProcess,
    kill_owned,
    minimal_env,
    owned_alive,
    reap_orphans,
    spawn_engine,
)
from sbproxy.model_host.engines.provision import provision_llama_cpp

__all__ = [
    "Availability",
    "BuildInput",
    "BuildOutput",
    "Detection",
    "EngineError",
    "EngineProcess",
    "LaunchPlan",
    "LaunchRequest",
    "build_identity",
    "check_snapshot",
    "detect_llama_cpp",
    "engine_build_workflow",
    "kill_owned",
    "launch",
    "minimal_env",
    "owned_alive",
    "plan_llama_launch",
    "provision_llama_cpp",
    "published_build",
    "read_version",
    "reap_orphans",
    "spawn_engine",
]
