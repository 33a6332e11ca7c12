"""Catalog bounds: exactly the limit is accepted, one more is rejected with its path."""

from __future__ import annotations

import pytest

from sbproxy.catalog import (
    MAX_DIGESTED_INT,
    MAX_ENGINES_PER_VARIANT,
    MAX_ID_BYTES,
    MAX_MODELS,
    MAX_REVISION_BYTES,
    MAX_VARIANTS_PER_MODEL,
    Catalog,
    variant_digest,
)
from sbproxy.errors import CatalogError
from tests.catalog.builders import document, entry, legacy_entry, parse, sha, variant


def test_limits_are_the_reference_values() -> None:
    assert (MAX_MODELS, MAX_VARIANTS_PER_MODEL, MAX_ENGINES_PER_VARIANT) == (1024, 128, 16)
    assert (MAX_ID_BYTES, MAX_REVISION_BYTES) == (128, 128)


@pytest.mark.parametrize("count", [MAX_MODELS, MAX_MODELS + 1])
def test_model_count_limit(count: int) -> None:
    doc = document(models={f"m{i}": legacy_entry() for i in range(count)})
    if count <= MAX_MODELS:
        assert len(parse(doc).models) == count
        return
    with pytest.raises(CatalogError) as info:
        parse(doc)
    assert "models: lists 1025 models; at most 1024" in str(info.value)


@pytest.mark.parametrize("count", [MAX_VARIANTS_PER_MODEL, MAX_VARIANTS_PER_MODEL + 1])
def test_variant_count_limit(count: int) -> None:
    doc = document(models={"acme-1b": entry(*(variant(f"v{i}") for i in range(count)))})
    if count <= MAX_VARIANTS_PER_MODEL:
        assert len(parse(doc).models["acme-1b"].variants) == count
        return
    with pytest.raises(CatalogError) as info:
        parse(doc)
    assert "models.acme-1b.variants: lists 129 variants; at most 128" in str(info.value)


@pytest.mark.parametrize("count", [MAX_ENGINES_PER_VARIANT, MAX_ENGINES_PER_VARIANT + 1])
def test_engine_count_limit(count: int) -> None:
    kinds = ["llama_cpp", "vllm", "sglang", "mistralrs"]
    engines = [kinds[i % len(kinds)] for i in range(count)]
    doc = document(models={"acme-1b": entry(variant(engines=engines))})
    if count <= MAX_ENGINES_PER_VARIANT:
        assert len(parse(doc).models["acme-1b"].variants[0].engines) == count
        return
    with pytest.raises(CatalogError) as info:
        parse(doc)
    assert "models.acme-1b.variants[0].engines: lists 17 engines; at most 16" in str(info.value)


@pytest.mark.parametrize("size", [MAX_ID_BYTES, MAX_ID_BYTES + 1])
def test_model_id_byte_limit(size: int) -> None:
    model_id = "m" * size
    doc = document(models={model_id: entry()})
    if size <= MAX_ID_BYTES:
        assert model_id in parse(doc).models
        return
    with pytest.raises(CatalogError) as info:
        parse(doc)
    assert f"models.{model_id}: is 129 bytes; at most 128" in str(info.value)


@pytest.mark.parametrize("size", [MAX_ID_BYTES, MAX_ID_BYTES + 1])
def test_variant_id_byte_limit(size: int) -> None:
    doc = document(models={"acme-1b": entry(variant("v" * size))})
    if size <= MAX_ID_BYTES:
        assert parse(doc).models["acme-1b"].variants[0].id == "v" * size
        return
    with pytest.raises(CatalogError) as info:
        parse(doc)
    assert "models.acme-1b.variants[0].id: is 129 bytes" in str(info.value)


@pytest.mark.parametrize("size", [MAX_REVISION_BYTES, MAX_REVISION_BYTES + 1])
def test_revision_byte_limit(size: int) -> None:
    revision = "r" * size
    doc = document(models={"acme-1b": entry(variant(revision=revision, stability="preview"))})
    if size <= MAX_REVISION_BYTES:
        assert parse(doc).models["acme-1b"].variants[0].revision == revision
        return
    with pytest.raises(CatalogError) as info:
        parse(doc)
    assert "models.acme-1b.variants[0].revision: is 129 bytes" in str(info.value)


def test_revision_limit_counts_utf8_bytes_not_characters() -> None:
    # 64 two-byte characters: 64 characters but 128 bytes (accepted); one more is 130.
    fits = document(models={"acme-1b": entry(variant(revision="é" * 64, stability="preview"))})
    parse(fits)
    over = document(models={"acme-1b": entry(variant(revision="é" * 65, stability="preview"))})
    with pytest.raises(CatalogError, match="is 130 bytes"):
        parse(over)


@pytest.mark.parametrize("size", [MAX_ID_BYTES, MAX_ID_BYTES + 1])
def test_catalog_revision_byte_limit(size: int) -> None:
    doc = document(catalog_revision="c" * size)
    if size <= MAX_ID_BYTES:
        assert parse(doc).catalog_revision == "c" * size
        return
    with pytest.raises(CatalogError) as info:
        parse(doc)
    assert "catalog_revision: is 129 bytes" in str(info.value)


@pytest.mark.parametrize("size", [MAX_DIGESTED_INT, MAX_DIGESTED_INT + 1, 2**53 + 1, 2**62, 10**30])
def test_file_size_is_bounded_by_the_canonical_json_integer_limit(size: int) -> None:
    # The size goes into the artifact digest's RFC 8785 JSON, which holds at most 2**53 - 1.
    files = [{"path": "model.gguf", "sha256": sha("big"), "size_bytes": size}]
    doc = document(models={"acme-1b": entry(variant(files=files))})
    if size <= MAX_DIGESTED_INT:
        catalog = parse(doc)
        assert catalog.models["acme-1b"].variants[0].files[0].size_bytes == size
        assert len(variant_digest_of(catalog)) == 64
        return
    with pytest.raises(CatalogError) as info:
        parse(doc)
    assert info.value.code == "invalid_catalog"
    assert info.value.details["field"] == "models.acme-1b.variants[0].files[0].size_bytes"
    assert f"{size} is too large; at most {MAX_DIGESTED_INT}" in str(info.value)


def variant_digest_of(catalog: Catalog) -> str:
    return variant_digest(
        catalog_revision=catalog.catalog_revision,
        logical_model="acme-1b",
        variant=catalog.models["acme-1b"].variants[0],
    )
