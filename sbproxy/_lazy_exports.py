"""Package exports that import their module when first used (PEP 562 ``__getattr__``).

A package's ``__init__`` names its public surface in ``__all__``; importing every module
behind it up front makes each user pay for all of them. ``sbproxy jobs list`` needs the job
records of :mod:`sbproxy.store`, not the write path behind the repositories (the writer
thread, migrations, tenacity's retry machinery), and ``sbproxy models list`` needs the cache
layout, not the download stack. Such
a package imports its light modules as usual and declares the heavy ones here::

    _LAZY = {"sbproxy.store.database": ("Database", "StoreError")}
    if TYPE_CHECKING:  # what type checkers and import-linter read
        from sbproxy.store.database import Database, StoreError
    else:
        __getattr__ = lazy_exports(__name__, _LAZY)

``from sbproxy.store import Database`` then imports ``sbproxy.store.database`` on first use,
and the name is cached on the package so later lookups are plain attribute reads.
``tests/test_lazy_exports.py`` holds each ``_LAZY`` table equal to the package's
``TYPE_CHECKING`` imports and, with its eager imports, to its ``__all__``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, tuple[str, ...]]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package`` that imports each name from its module.

    Args:
        package: The package's ``__name__``.
        exports: Module -> the names the package re-exports from it.

    Returns:
        The function to bind as the package's ``__getattr__``; it raises
        :class:`AttributeError` for any other name, as a module does.
    """
    owners = {name: module for module, names in exports.items() for name in names}

    def lazy_attribute(name: str) -> object:
        module = owners.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    return lazy_attribute
