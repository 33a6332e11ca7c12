"""A reload's transaction state: the candidates in flight, the staged generations, the ones
a ``recreate`` stopped, and whether every current reservation is protected meanwhile.

One :class:`Staging` belongs to the runtime manager; ``runtime/reload.py`` receives it
(``manager.staging``) and works through its methods and the manager's staging verbs --
it writes no manager attribute.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from sbproxy.config import CompiledConfig
from sbproxy.model_host.runtime.deployment import Deployment
from sbproxy.model_host.runtime.residency import ResidencyKey

__all__ = ["Staging"]


class Staging:
    """See the module docstring. Synchronous bookkeeping; nothing here starts an engine."""

    def __init__(self) -> None:
        self._staged: dict[str, Deployment] = {}
        self._recreated: list[tuple[Deployment, bool]] = []
        self._protect_all = False
        self._candidates: dict[str, CompiledConfig] = {}

    # -- candidates ------------------------------------------------------------------------

    @contextmanager
    def offering(self, digest: str, candidate: CompiledConfig) -> Iterator[None]:
        """Make ``candidate`` findable by its content ``digest`` while the body runs (the
        reload job's steps look it up)."""
        self._candidates[digest] = candidate
        try:
            yield
        finally:
            self._candidates.pop(digest, None)

    def candidate(self, digest: str) -> CompiledConfig | None:
        """The candidate offered under ``digest``, if its reload runs here."""
        return self._candidates.get(digest)

    def committed(self, digest: str) -> None:
        """The candidate under ``digest`` is live now: it is no longer a candidate."""
        self._candidates.pop(digest, None)

    # -- staged generations ----------------------------------------------------------------

    @property
    def staged(self) -> Mapping[str, Deployment]:
        """Staged deployments not yet routed, by id (read only)."""
        return self._staged

    @property
    def protect_all(self) -> bool:
        """Whether every current reservation is protected from eviction (a reload stages)."""
        return self._protect_all

    def begin(self) -> None:
        """Start staging: nothing staged yet, every reservation protected."""
        self._staged.clear()
        self._recreated.clear()
        self._protect_all = True

    def end(self) -> None:
        """Stop protecting every reservation (the staged deployments stay staged)."""
        self._protect_all = False

    def stage(self, deployment: Deployment) -> None:
        """Keep ``deployment`` staged until the commit or a rollback."""
        self._staged[deployment.deployment] = deployment

    def recreated(self, deployment: Deployment, *, was_ready: bool) -> None:
        """A ``recreate`` stopped ``deployment`` (a rollback restarts it if it was ready)."""
        self._recreated.append((deployment, was_ready))

    def take(self) -> tuple[dict[str, Deployment], list[tuple[Deployment, bool]]]:
        """Everything staged and recreated; staging is empty after."""
        staged, recreated = dict(self._staged), list(self._recreated)
        self._staged.clear()
        self._recreated.clear()
        return staged, recreated

    def protects(self, key: ResidencyKey) -> bool:
        """Whether staging alone protects ``key`` (all reservations, or a staged one)."""
        if self._protect_all:
            return True
        staged = self._staged.get(key.deployment)
        return staged is not None and staged.generation == key.generation
