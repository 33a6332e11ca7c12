"""Every catalog schema rule, each broken once: the load fails with code invalid_catalog and
a message naming the file and the dotted path of the offending field."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from sbproxy.catalog import Catalog, Stability, parse_catalog
from sbproxy.errors import CatalogError
from tests.catalog.builders import (
    SOURCE,
    Doc,
    document,
    dump,
    entry,
    legacy_entry,
    parse,
    sha,
    variant,
)

M = "models.acme-1b"
V = f"{M}.variants[0]"


def load_error(doc: Doc) -> CatalogError:
    with pytest.raises(CatalogError) as info:
        parse(doc)
    error = info.value
    assert error.code == "invalid_catalog"
    assert SOURCE in str(error)
    return error


def with_variant(**fields: Any) -> Doc:
    return document(models={"acme-1b": entry(variant(**fields))})


def with_entry(**fields: Any) -> Doc:
    return document(models={"acme-1b": entry(**fields)})


def with_file(**fields: Any) -> Doc:
    file: dict[str, Any] = {"path": "model.gguf", "sha256": sha("f"), "size_bytes": 10}
    file.update(fields)
    return with_variant(files=[file])


def requirements(**fields: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"accelerators": ["cpu"], "min_memory_bytes": 1}
    out.update(fields)
    return {k: v for k, v in out.items() if v is not None}


def without(doc: Doc, *path: str | int) -> Doc:
    node: Any = doc
    for part in path[:-1]:
        node = node[part]
    del node[path[-1]]
    return doc


BAD: list[tuple[str, Callable[[], Doc], str, str]] = [
    # (case id, document, dotted path, phrase the message must contain)
    ("stable-hf-branch", lambda: with_variant(revision="main"), f"{V}.revision", "40-character"),
    ("stable-hf-short-commit", lambda: with_variant(revision="0123abc"), f"{V}.revision", "commit"),
    ("blank-revision", lambda: with_variant(revision="  "), f"{V}.revision", "blank"),
    ("revision-space", lambda: with_variant(revision="v 1"), f"{V}.revision", "whitespace"),
    ("dotdot-path", lambda: with_file(path="../model.gguf"), f"{V}.files[0].path", "'..'"),
    ("inner-dotdot", lambda: with_file(path="a/../model.gguf"), f"{V}.files[0].path", "'..'"),
    ("dot-path", lambda: with_file(path="./model.gguf"), f"{V}.files[0].path", "'.'"),
    ("empty-component", lambda: with_file(path="a//model.gguf"), f"{V}.files[0].path", "empty"),
    ("absolute-path", lambda: with_file(path="/etc/model.gguf"), f"{V}.files[0].path", "absolute"),
    ("backslash", lambda: with_file(path="a\\model.gguf"), f"{V}.files[0].path", "backslash"),
    ("question-mark", lambda: with_file(path="model.gguf?x=1"), f"{V}.files[0].path", "'?'"),
    ("hash", lambda: with_file(path="model#1.gguf"), f"{V}.files[0].path", "'#'"),
    ("control-char", lambda: with_file(path="model\x07.gguf"), f"{V}.files[0].path", "control"),
    ("empty-path", lambda: with_file(path=""), f"{V}.files[0].path", "empty"),
    ("short-sha", lambda: with_file(sha256="abc123"), f"{V}.files[0].sha256", "64 lowercase"),
    (
        "uppercase-sha",
        lambda: with_file(sha256=sha("f").upper()),
        f"{V}.files[0].sha256",
        "64 lowercase",
    ),
    ("size-zero", lambda: with_file(size_bytes=0), f"{V}.files[0].size_bytes", "greater than 0"),
    ("size-string", lambda: with_file(size_bytes="10"), f"{V}.files[0].size_bytes", "integer"),
    ("no-gguf-file", lambda: with_file(path="model.bin"), f"{V}.files", ".gguf"),
    (
        "no-pickle-file",
        lambda: with_variant(
            fmt="pickle", files=[{"path": "model.safetensors", "sha256": sha("x"), "size_bytes": 1}]
        ),
        f"{V}.files",
        ".bin or .pt or .pth",
    ),
    (
        "no-safetensors-file",
        lambda: with_variant(
            fmt="safetensors", files=[{"path": "config.json", "sha256": sha("x"), "size_bytes": 1}]
        ),
        f"{V}.files",
        ".safetensors",
    ),
    (
        "duplicate-file",
        lambda: with_variant(
            files=[
                {"path": "model.gguf", "sha256": sha("a"), "size_bytes": 1},
                {"path": "model.gguf", "sha256": sha("b"), "size_bytes": 2},
            ]
        ),
        f"{V}.files[1].path",
        "listed twice",
    ),
    ("no-files", lambda: with_variant(files=[]), f"{V}.files", "at least 1"),
    ("variant-id-chars", lambda: with_variant(variant_id="q4 k/m"), f"{V}.id", "letters, digits"),
    ("unknown-format", lambda: with_variant(format="onnx"), f"{V}.format", "'gguf'"),
    ("unknown-engine", lambda: with_variant(engines=["tgi"]), f"{V}.engines[0]", "'llama_cpp'"),
    ("no-engines", lambda: with_variant(engines=[]), f"{V}.engines", "at least 1"),
    ("blank-quant", lambda: with_variant(quant=" "), f"{V}.quant", "blank"),
    ("blank-certification", lambda: with_variant(certification=""), f"{V}.certification", "blank"),
    ("unknown-stability", lambda: with_variant(stability="beta"), f"{V}.stability", "'preview'"),
    ("unknown-source-scheme", lambda: with_variant(source="s3://b/m"), f"{V}.source", "hf:Org"),
    ("hf-source-no-repo", lambda: with_variant(source="hf:Acme"), f"{V}.source", "hf:Org/Repo"),
    ("relative-file-source", lambda: with_variant(source="file:models/x"), f"{V}.source", "abs"),
    (
        "no-accelerators",
        lambda: with_variant(requirements=requirements(accelerators=[])),
        f"{V}.requirements.accelerators",
        "at least 1",
    ),
    (
        "unknown-accelerator",
        lambda: with_variant(requirements=requirements(accelerators=["rocm"])),
        f"{V}.requirements.accelerators[0]",
        "'cuda'",
    ),
    (
        "missing-min-memory",
        lambda: with_variant(requirements=requirements(min_memory_bytes=None)),
        f"{V}.requirements.min_memory_bytes",
        "required",
    ),
    (
        "negative-min-memory",
        lambda: with_variant(requirements=requirements(min_memory_bytes=-1)),
        f"{V}.requirements.min_memory_bytes",
        "greater than or equal to 0",
    ),
    (
        "capability-without-minor",
        lambda: with_variant(requirements=requirements(min_compute_capability={"major": 8})),
        f"{V}.requirements.min_compute_capability.minor",
        "required",
    ),
    ("unknown-variant-field", lambda: with_variant(colour="red"), f"{V}.colour", "certification"),
    ("blank-params", lambda: with_entry(params=""), f"{M}.params", "blank"),
    (
        "missing-license",
        lambda: without(with_entry(), "models", "acme-1b", "license"),
        f"{M}.license",
        "required",
    ),
    (
        "missing-family",
        lambda: without(with_entry(), "models", "acme-1b", "family"),
        f"{M}.family",
        "required",
    ),
    (
        "missing-context-length",
        lambda: without(with_entry(), "models", "acme-1b", "context_length"),
        f"{M}.context_length",
        "required",
    ),
    (
        "zero-context-length",
        lambda: with_entry(context_length=0),
        f"{M}.context_length",
        "greater than 0",
    ),
    (
        "duplicate-variant-id",
        lambda: document(models={"acme-1b": entry(variant("a"), variant("b"), variant("a"))}),
        f"{M}.variants[2].id",
        "declared twice",
    ),
    ("literal-hf-token", lambda: with_entry(hf_token="hf_abcdef"), f"{M}.hf_token", "${NAME}"),
    (
        "hf-token-expression",
        lambda: with_entry(hf_token="${HF_TOKEN:-x}"),
        f"{M}.hf_token",
        "${NAME}",
    ),
    ("allow-pickle-string", lambda: with_entry(allow_pickle="yes"), f"{M}.allow_pickle", "boolean"),
    ("unknown-pull", lambda: with_entry(pull="sometimes"), f"{M}.pull", "'on_demand'"),
    ("unknown-entry-field", lambda: with_entry(colour="red"), f"{M}.colour", "allow_pickle"),
    (
        "no-variants-no-legacy",
        lambda: document(models={"acme-1b": without(legacy_entry(), "hf_repo")}),
        f"{M}.variants",
        "hf_repo and quants",
    ),
    (
        "legacy-without-quants",
        lambda: document(models={"acme-1b": without(legacy_entry(), "quants")}),
        f"{M}.variants",
        "hf_repo and quants",
    ),
    ("model-id-chars", lambda: document(models={"acme 1b": entry()}), "models.acme 1b", "letters"),
    ("model-id-slash", lambda: document(models={"acme/1b": entry()}), "models.acme/1b", "letters"),
    ("schema-version-3", lambda: document(schema_version=3), "schema_version", "1 (legacy) or 2"),
    ("schema-version-string", lambda: document(schema_version="2"), "schema_version", "integer"),
    (
        "v2-without-revision",
        lambda: without(document(), "catalog_revision"),
        "catalog_revision",
        "required for schema_version 2",
    ),
    ("blank-catalog-revision", lambda: document(catalog_revision=" "), "catalog_revision", "blank"),
    (
        "variants-in-v1",
        lambda: document(schema_version=1),
        f"{M}.variants",
        "schema_version: 2",
    ),
    ("unknown-top-level", lambda: document(colour="red"), "colour", "catalog_revision"),
]


@pytest.mark.parametrize(("make", "path", "phrase"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_invalid_catalog_names_the_dotted_path(
    make: Callable[[], Doc], path: str, phrase: str
) -> None:
    error = load_error(make())
    assert f"{path}: " in str(error)
    assert phrase in str(error)
    assert error.details["field"] == path


def test_stable_hf_variant_with_commit_revision_is_accepted() -> None:
    catalog = parse(with_variant(revision="a" * 40))
    assert catalog.models["acme-1b"].variants[0].stability is Stability.STABLE


@pytest.mark.parametrize("revision", ["main", "v1.0", "refs/pr/1"])
def test_preview_and_file_variants_may_use_a_branch_revision(revision: str) -> None:
    parse(with_variant(revision=revision, stability="preview"))
    parse(with_variant(revision=revision, source="file:/srv/models/acme"))


def test_hf_token_environment_reference_is_accepted() -> None:
    catalog = parse(with_entry(hf_token="${HF_TOKEN}"))
    assert catalog.models["acme-1b"].hf_token == "${HF_TOKEN}"


def test_defaults_for_optional_entry_fields() -> None:
    found = parse(document()).models["acme-1b"]
    assert found.modality == "chat"
    assert found.allow_pickle is False
    assert found.pull.value == "on_demand"


def test_nested_files_and_pickle_extensions_are_accepted() -> None:
    files = [
        {"path": "weights/part-1.pt", "sha256": sha("1"), "size_bytes": 1},
        {"path": "weights/part-2.pth", "sha256": sha("2"), "size_bytes": 1},
        {"path": "config.json", "sha256": sha("3"), "size_bytes": 1},
    ]
    catalog = parse(with_variant(fmt="pickle", files=files))
    assert [f.path for f in catalog.models["acme-1b"].variants[0].files] == [
        "weights/part-1.pt",
        "weights/part-2.pth",
        "config.json",
    ]


def test_schema_1_document_defaults_its_revision_and_keeps_legacy_entries() -> None:
    catalog = parse({"models": {"glm": legacy_entry()}})
    assert catalog.schema_version == 1
    assert catalog.catalog_revision == "legacy-v1"
    assert catalog.models["glm"].is_preview_incomplete


def test_every_problem_is_listed_when_there_are_several() -> None:
    doc = document(
        models={
            "acme-1b": entry(variant(revision="main")),
            "acme-2b": entry(params=""),
        }
    )
    message = str(load_error(doc))
    assert "2 problems" in message
    assert f"{V}.revision" in message
    assert "models.acme-2b.params" in message


def test_error_names_the_yaml_line_of_the_bad_field() -> None:
    text = dump(with_variant(revision="main"))
    line = 1 + next(i for i, t in enumerate(text.splitlines()) if t.strip() == "revision: main")
    with pytest.raises(CatalogError) as info:
        parse_catalog(text, source=SOURCE)
    assert f"line {line}: {V}.revision" in str(info.value)
    assert info.value.details["line"] == line


def test_duplicate_yaml_keys_are_rejected_with_their_path() -> None:
    text = dump(document()).replace(
        "  acme-1b:\n    params: 1B\n", "  acme-1b:\n    params: 1B\n    params: 2B\n"
    )
    assert text.count("params:") == 2
    with pytest.raises(CatalogError) as info:
        parse_catalog(text, source=SOURCE)
    message = str(info.value)
    assert info.value.code == "invalid_catalog"
    assert SOURCE in message
    assert "models.acme-1b.params" in message
    assert "duplicate key 'params'" in message


def test_duplicate_model_ids_are_rejected() -> None:
    one = dump(document(models={"acme-1b": entry()}))
    body = one.split("models:\n", 1)[1]
    with pytest.raises(CatalogError) as info:
        parse_catalog(one + body, source=SOURCE)
    assert "models.acme-1b: duplicate key 'acme-1b'" in str(info.value)


def test_duplicate_keys_inside_a_variant_list_item_are_rejected() -> None:
    text = dump(document()).replace(
        "      quant: Q4_K_M\n", "      quant: Q4_K_M\n      quant: Q8_0\n"
    )
    with pytest.raises(CatalogError) as info:
        parse_catalog(text, source=SOURCE)
    assert f"{V}.quant: duplicate key 'quant'" in str(info.value)


def test_malformed_yaml_names_the_file_and_line() -> None:
    text = "schema_version: 2\ncatalog_revision: x\nmodels: [\n"
    with pytest.raises(CatalogError) as info:
        parse_catalog(text, source=SOURCE)
    assert info.value.code == "invalid_catalog"
    assert f"{SOURCE}: invalid catalog: line " in str(info.value)
    assert "not valid YAML" in str(info.value)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_a_document_that_is_not_a_mapping_is_rejected(text: str) -> None:
    with pytest.raises(CatalogError, match="must be a mapping"):
        parse_catalog(text, source=SOURCE)


@pytest.mark.parametrize("text", ["", "   \n\t\n", "# only a comment\n", "~\n", "---\n"])
def test_an_empty_document_is_refused_naming_the_file(text: str) -> None:
    with pytest.raises(CatalogError) as info:
        parse_catalog(text, source=SOURCE)
    assert info.value.code == "invalid_catalog"
    assert str(info.value).startswith(f"{SOURCE}: invalid catalog: empty document")


def test_an_explicitly_empty_mapping_is_an_empty_legacy_catalog() -> None:
    catalog = parse_catalog("models: {}\n", source=SOURCE)
    assert catalog == Catalog()
    assert catalog.models == {}


def test_catalog_models_are_frozen() -> None:
    catalog = parse(document())
    with pytest.raises(ValueError, match="frozen"):
        catalog.models["acme-1b"].variants[0].revision = "main"
