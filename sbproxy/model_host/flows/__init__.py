"""The durable workflows of the model host (pull, import, remove, gc, prune, ...).

``registry`` holds every model-host workflow kind; the server's worker loop and the CLI
processes that run jobs in-process use it. Importing this package registers them all (the
engine acquisitions by module name, imported when such a job is first looked up).
"""

from __future__ import annotations

from sbproxy.model_host.flows.collect import (
    GcInput,
    GcPreview,
    GcReport,
    PruneReport,
    RemoveInput,
    RemoveOutput,
    artifact_subject,
    gc_preview,
    gc_workflow,
    prune_preview,
    prune_workflow,
    remove_workflow,
)
from sbproxy.model_host.flows.pull import (
    PullInput,
    PullIntent,
    PullOutput,
    network_files,
    pull_workflow,
)
from sbproxy.model_host.registry import registry

# Engine acquisitions are model-host jobs too; their modules (subprocess supervision, the
# HTTP clients) are imported only when such a job runs, not by every `sbproxy models pull`.
registry.defer("engine_build", "sbproxy.model_host.engines.llama_build")
registry.defer("engine_fetch", "sbproxy.model_host.engines.llama_release")

__all__ = [
    "GcInput",
    "GcPreview",
    "GcReport",
    "PruneReport",
    "PullInput",
    "PullIntent",
    "PullOutput",
    "RemoveInput",
    "RemoveOutput",
    "artifact_subject",
    "gc_preview",
    "gc_workflow",
    "network_files",
    "prune_preview",
    "prune_workflow",
    "pull_workflow",
    "registry",
    "remove_workflow",
]
