"""The durable workflows of the model host (pull, import, remove, gc, prune, ...).

``registry`` holds every model-host workflow kind; the server's worker loop and the CLI
processes that run jobs in-process use it. Importing this package registers them all.
"""

from __future__ import annotations

# Engine builds are model-host jobs too: importing registers the engine_build workflow.
import sbproxy.model_host.engines.llama_build
from sbproxy.model_host.flows.collect import (
    GcInput,
    GcReport,
    PruneReport,
    RemoveInput,
    RemoveOutput,
    artifact_subject,
    gc_workflow,
    prune_preview,
    prune_workflow,
    remove_workflow,
)
from sbproxy.model_host.flows.pull import PullInput, PullIntent, PullOutput, pull_workflow
from sbproxy.model_host.registry import registry

import sbproxy.model_host.engines.llama_release  # noqa: F401  isort: skip

__all__ = [
    "GcInput",
    "GcReport",
    "PruneReport",
    "PullInput",
    "PullIntent",
    "PullOutput",
    "RemoveInput",
    "RemoveOutput",
    "artifact_subject",
    "gc_workflow",
    "prune_preview",
    "prune_workflow",
    "pull_workflow",
    "registry",
    "remove_workflow",
]
