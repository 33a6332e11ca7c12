"""The ``sbproxy`` command line: the only package that imports click."""

from __future__ import annotations

from sbproxy.cli.main import cli, main

__all__ = ["cli", "main"]
