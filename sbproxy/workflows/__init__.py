"""The generic durable-workflow engine (workflows, steps, replay, leases, recovery)."""

from __future__ import annotations

__all__: list[str] = []
