"""``python -m sbproxy.cli``: the same as the ``sbproxy`` console script."""

from __future__ import annotations

from sbproxy.cli.main import main

main()
