from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from sbproxy.catalog import (
    Accelerator,
    ArtifactRequest,
    WorkerProfile,
    canonical_artifact_json,
    load_builtin_catalog,
    resolve_artifact,
    variant_digest,
)
from tests.catalog.builders import document, dump, entry, parse, sha, variant

CPU = WorkerProfile(accelerator=Accelerator.CPU, memory_bytes=64 * 2**30)

# The reference implementation's certification ledger records this digest for
# qwen2.5-0.5b-instruct/q4_k_m in catalog builtin-2026-07-10.
QWEN_05B_Q4_DIGEST = "830f2915ca0008994cbddaeba38634f6e999d34fea89c048ebb73753be0a0591"


def test_builtin_qwen_0_5b_q4_k_m_digest_matches_the_reference_ledger() -> None:
    catalog = load_builtin_catalog()
    request = ArtifactRequest(model="qwen2.5-0.5b-instruct", variant="q4_k_m")
    artifact = resolve_artifact(catalog, request, CPU).artifact
    assert catalog.catalog_revision == "builtin-2026-07-10"
    assert artifact.digest == QWEN_05B_Q4_DIGEST


def test_digest_is_sha256_of_the_rfc8785_canonical_object() -> None:
    catalog = load_builtin_catalog()
    chosen = catalog.models["qwen2.5-0.5b-instruct"].variants[0]
    canonical = canonical_artifact_json(
        catalog_revision=catalog.catalog_revision,
        logical_model="qwen2.5-0.5b-instruct",
        variant_id=chosen.id,
        format=chosen.format,
        quant=chosen.quant,
        source=chosen.source,
        revision=chosen.revision,
        files=chosen.files,
    )
    # Canonical JSON: sorted keys, no insignificant whitespace, and exactly these fields.
    decoded = json.loads(canonical)
    assert list(decoded) == sorted(decoded)
    assert set(decoded) == {
        "catalog_revision",
        "logical_model",
        "variant_id",
        "format",
        "quant",
        "source",
        "revision",
        "files",
    }
    assert decoded["files"] == [
        {"path": f.path, "sha256": f.sha256, "size_bytes": f.size_bytes} for f in chosen.files
    ]
    assert b" " not in canonical and b"\n" not in canonical
    assert hashlib.sha256(canonical).hexdigest() == variant_digest(
        catalog_revision=catalog.catalog_revision,
        logical_model="qwen2.5-0.5b-instruct",
        variant=chosen,
    )


def test_same_yaml_resolved_twice_gives_identical_artifact_and_digest() -> None:
    doc = document()
    request = ArtifactRequest(model="acme-1b", variant="q4_k_m")
    first = resolve_artifact(parse(doc), request, CPU).artifact
    second = resolve_artifact(parse(doc), request, CPU).artifact
    assert first == second
    assert len(first.digest) == 64
    assert int(first.digest, 16) >= 0
    assert first.digest == first.digest.lower()


def test_digest_does_not_depend_on_yaml_key_order() -> None:
    doc = document()
    shuffled = document()
    v = shuffled["models"]["acme-1b"]["variants"][0]
    shuffled["models"]["acme-1b"]["variants"][0] = dict(reversed(list(v.items())))
    assert dump(doc) != dump(shuffled)
    request = ArtifactRequest(model="acme-1b")
    assert (
        resolve_artifact(parse(doc), request, CPU).artifact.digest
        == resolve_artifact(parse(shuffled), request, CPU).artifact.digest
    )


def test_digest_ignores_engine_but_not_pinned_fields() -> None:
    base = resolve_artifact(parse(document()), ArtifactRequest(model="acme-1b"), CPU)
    other_engine = document(
        models={"acme-1b": entry(variant(engines=["llama_cpp", "vllm", "mistralrs"]))}
    )
    assert (
        resolve_artifact(parse(other_engine), ArtifactRequest(model="acme-1b"), CPU).artifact.digest
        == base.artifact.digest
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("revision", "fedcba9876543210fedcba9876543210fedcba98"),
        ("source", "hf:Acme/Other"),
        ("quant", "Q8_0"),
        ("files", [{"path": "model.gguf", "sha256": sha("other"), "size_bytes": 4096}]),
        ("files", [{"path": "model.gguf", "sha256": sha("q4_k_m"), "size_bytes": 4097}]),
        ("files", [{"path": "renamed.gguf", "sha256": sha("q4_k_m"), "size_bytes": 4096}]),
    ],
)
def test_digest_changes_when_a_pinned_field_changes(field: str, value: Any) -> None:
    request = ArtifactRequest(model="acme-1b")
    base = resolve_artifact(parse(document()), request, CPU).artifact.digest
    changed = document(models={"acme-1b": entry(variant(**{field: value}))})
    assert resolve_artifact(parse(changed), request, CPU).artifact.digest != base


def test_digest_covers_catalog_revision_and_logical_model() -> None:
    request = ArtifactRequest(model="acme-1b")
    base = resolve_artifact(parse(document()), request, CPU).artifact.digest
    new_revision = document(catalog_revision="ops-2026-02-01")
    assert resolve_artifact(parse(new_revision), request, CPU).artifact.digest != base
    renamed = document(models={"acme-1b-copy": entry()})
    copy = resolve_artifact(parse(renamed), ArtifactRequest(model="acme-1b-copy"), CPU)
    assert copy.artifact.digest != base
