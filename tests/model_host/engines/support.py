"""Helpers for engine tests: a fake llama-server executable and verified snapshots."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from sbproxy.model_host.artifacts import CachedFile, CachedMetadata
from tests.support.ports import free_port

__all__ = ["FAKE_SERVER", "fake_llama_server", "free_port", "verified_snapshot"]

FAKE_SERVER = Path(__file__).resolve().parents[2] / "support" / "fake_llama_server.py"


def fake_llama_server(directory: Path, *, mode: str | None = None) -> Path:
    """An executable ``llama-server`` in ``directory`` that runs the stand-in.

    ``mode`` is baked into the script (``FAKE_LLAMA_MODE``): engines get a minimal
    environment, so a variable of the test process would not reach them.
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "llama-server"
    preset = f"export FAKE_LLAMA_MODE='{mode}'\n" if mode is not None else ""
    path.write_text(f'#!/bin/sh\n{preset}exec "{sys.executable}" "{FAKE_SERVER}" "$@"\n')
    path.chmod(0o755)
    return path


def verified_snapshot(
    root: Path, files: dict[str, bytes], *, fmt: str = "gguf"
) -> tuple[CachedMetadata, Path]:
    """A snapshot directory named by its digest, with matching metadata."""
    digest = hashlib.sha256(repr(sorted(files)).encode()).hexdigest()
    snapshot = root / "snapshots" / digest
    snapshot.mkdir(parents=True)
    listed = []
    for path, data in files.items():
        (snapshot / path).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / path).write_bytes(data)
        listed.append(
            CachedFile(
                path=path,
                sha256=hashlib.sha256(data).hexdigest(),
                size_bytes=len(data),
                blake3="0" * 64,
            )
        )
    metadata = CachedMetadata(
        artifact_digest=digest,
        catalog_revision="test",
        logical_model="tiny",
        variant_id="q4_k_m",
        format=fmt,
        quant="Q4_K_M",
        source="hf:acme/tiny",
        revision="main",
        files=tuple(listed),
        total_size_bytes=sum(len(d) for d in files.values()),
        context_length=2048,
        stability="preview",
        pickle_allowed=False,
        created_at_ms=0,
        last_accessed_ms=0,
    )
    return metadata, snapshot
