"""Builders for small catalog documents used across the catalog and CLI tests.

Each builder returns plain YAML-ready data; tests mutate it and feed the YAML text through
the real loader (:func:`sbproxy.catalog.parse_catalog`), so every case exercises the same
path an operator's catalog file takes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import yaml

from sbproxy.catalog import Catalog, parse_catalog

SOURCE = "ops-catalog.yaml"
COMMIT = "0123456789abcdef0123456789abcdef01234567"

Doc = dict[str, Any]


def sha(label: str) -> str:
    """A real 64-hex SHA-256, distinct per label."""
    return hashlib.sha256(label.encode()).hexdigest()


def variant(
    variant_id: str = "q4_k_m",
    *,
    fmt: str = "gguf",
    engines: list[str] | None = None,
    accelerators: list[str] | None = None,
    min_memory_bytes: int = 1024,
    files: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> Doc:
    """A valid variant; ``fmt`` picks a matching weights file unless ``files`` is given."""
    weights = {"gguf": "model.gguf", "safetensors": "model.safetensors", "pickle": "model.bin"}
    default_engine = {"gguf": "llama_cpp", "safetensors": "vllm", "pickle": "vllm"}
    default_files = [{"path": weights[fmt], "sha256": sha(variant_id), "size_bytes": 4096}]
    out: Doc = {
        "id": variant_id,
        "format": fmt,
        "quant": variant_id.upper(),
        "engines": [default_engine[fmt]] if engines is None else engines,
        "source": "hf:Acme/Model",
        "revision": COMMIT,
        "files": default_files if files is None else files,
        "requirements": {
            "accelerators": ["cpu", "metal", "cuda"] if accelerators is None else accelerators,
            "min_memory_bytes": min_memory_bytes,
        },
        "stability": "stable",
        "certification": "test-2026-01",
    }
    out.update(extra)
    return out


def entry(*variants: Doc, **extra: Any) -> Doc:
    """A valid v2 entry holding ``variants`` (one default variant if none given)."""
    out: Doc = {
        "params": "1B",
        "license": "apache-2.0",
        "family": "acme",
        "context_length": 4096,
        "variants": list(variants) or [variant()],
    }
    out.update(extra)
    return out


def legacy_entry(**extra: Any) -> Doc:
    """A valid v1 entry without variants (preview-incomplete)."""
    out: Doc = {
        "params": "9B",
        "license": "other",
        "family": "legacy",
        "hf_repo": "Acme/Legacy",
        "quants": ["bf16"],
    }
    out.update(extra)
    return out


def document(models: dict[str, Doc] | None = None, **extra: Any) -> Doc:
    """A valid v2 catalog document."""
    out: Doc = {
        "schema_version": 2,
        "catalog_revision": "ops-2026-01-01",
        "models": models if models is not None else {"acme-1b": entry()},
    }
    out.update(extra)
    return out


def dump(doc: Doc) -> str:
    return yaml.safe_dump(doc, sort_keys=False)


def parse(doc: Doc) -> Catalog:
    """Load ``doc`` through the real YAML loader."""
    return parse_catalog(dump(doc), source=SOURCE)


def write(path: Path, doc: Doc) -> Path:
    path.write_text(dump(doc), encoding="utf-8")
    return path
