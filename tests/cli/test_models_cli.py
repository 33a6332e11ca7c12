"""``sbproxy models list|show``: JSON envelopes, resolution on the probed worker, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from sbproxy.catalog import (
    Accelerator,
    ArtifactRequest,
    NoCompatibleVariantError,
    WorkerProfile,
    load_builtin_catalog,
    load_catalog_file,
    resolve_artifact,
    variant_digest,
)
from sbproxy.cli import models_cmd
from sbproxy.cli.main import cli
from sbproxy.errors import ResolutionError
from sbproxy.model_host.runtime import probe_worker
from tests.catalog.builders import document, dump, entry, legacy_entry, variant, write

GIB = 2**30
SBPROXY = Path(sys.executable).parent / "sbproxy"
ROW_FIELDS = {
    "id",
    "params",
    "license",
    "family",
    "modality",
    "quants",
    "selected_variant",
    "format",
    "stability",
    "chat_template",
    "exact_size_bytes",
    "engine",
    "fit",
    "estimated_memory_bytes",
    "status",
}


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, ["models", *args], catch_exceptions=False)


def run_json(*args: str) -> dict[str, Any]:
    result = run(*args, "--format", "json")
    assert result.exit_code == 0, result.stderr
    payload: dict[str, Any] = json.loads(result.stdout)
    return payload


@pytest.fixture
def small_cpu_worker(monkeypatch: pytest.MonkeyPatch) -> WorkerProfile:
    """Pin the probed worker so fit outcomes do not depend on this machine's RAM."""
    worker = WorkerProfile(accelerator=Accelerator.CPU, memory_bytes=8 * GIB)
    monkeypatch.setattr(models_cmd, "probe_worker", lambda: worker)
    return worker


def test_list_json_envelope_and_rows_match_resolution_on_the_probed_worker() -> None:
    payload = run_json("list")
    assert payload["schema_version"] == 1
    assert payload["command"] == "models.list"
    catalog = load_builtin_catalog()
    assert payload["catalog_revision"] == catalog.catalog_revision
    rows = {row["id"]: row for row in payload["models"]}
    assert set(rows) == set(catalog.models)
    worker = probe_worker()
    for model_id, row in rows.items():
        assert set(row) == ROW_FIELDS, model_id
        found = catalog.models[model_id]
        assert (row["params"], row["license"], row["family"]) == (
            found.params,
            found.license,
            found.family,
        )
        try:
            artifact = resolve_artifact(catalog, ArtifactRequest(model=model_id), worker).artifact
        except ResolutionError:
            assert row["selected_variant"] is None
            assert row["fit"] in {"too-large", "capability-refused", "unknown"}
            continue
        assert row["selected_variant"] == artifact.variant_id
        assert row["engine"] == artifact.engine.value
        assert row["exact_size_bytes"] == sum(f.size_bytes for f in artifact.files)
        assert row["chat_template"] == artifact.chat_template
        assert row["fit"] == "fits"


def test_list_rows_report_not_pulled_for_an_empty_cache_without_creating_it(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    for row in run_json("list", "--cache-dir", str(cache))["models"]:
        assert row["status"] == "not-pulled"
    assert not cache.exists()


def test_list_fit_values_on_a_pinned_worker(
    tmp_path: Path, small_cpu_worker: WorkerProfile
) -> None:
    doc = document(
        models={
            "fits": entry(variant(min_memory_bytes=GIB)),
            "huge": entry(variant(min_memory_bytes=64 * GIB)),
            "gpu-only": entry(variant(accelerators=["cuda"])),
            "legacy": legacy_entry(),
        }
    )
    payload = run_json("list", "--catalog-file", str(write(tmp_path / "ops.yaml", doc)))
    fit = {row["id"]: row["fit"] for row in payload["models"]}
    assert fit == {
        "fits": "fits",
        "huge": "too-large",
        "gpu-only": "capability-refused",
        "legacy": "unknown",
    }
    assert payload["worker"]["accelerator"] == "cpu"
    assert payload["worker"]["memory_bytes"] == small_cpu_worker.memory_bytes
    rows = {row["id"]: row for row in payload["models"]}
    assert rows["fits"]["estimated_memory_bytes"] == GIB
    assert rows["legacy"]["quants"] == ["bf16"]


def test_show_json_has_variants_with_digests_and_the_selection(
    small_cpu_worker: WorkerProfile,
) -> None:
    payload = run_json("show", "qwen2.5-0.5b-instruct")
    assert payload["schema_version"] == 1
    assert payload["command"] == "models.show"
    assert payload["id"] == "qwen2.5-0.5b-instruct"
    catalog = load_builtin_catalog()
    found = catalog.models["qwen2.5-0.5b-instruct"]
    assert payload["catalog_revision"] == catalog.catalog_revision
    assert payload["context_length"] == found.context_length
    assert payload["allow_pickle"] is False
    assert [v["id"] for v in payload["variants"]] == [v.id for v in found.variants]
    for shown, declared in zip(payload["variants"], found.variants, strict=True):
        assert shown["artifact_digest"] == variant_digest(
            catalog_revision=catalog.catalog_revision,
            logical_model="qwen2.5-0.5b-instruct",
            variant=declared,
        )
        assert shown["files"] == [f.model_dump() for f in declared.files]
        assert shown["requirements"]["min_memory_bytes"] == declared.requirements.min_memory_bytes
    expected = resolve_artifact(
        catalog, ArtifactRequest(model="qwen2.5-0.5b-instruct"), small_cpu_worker
    )
    assert payload["selected_variant"] == expected.artifact.variant_id
    assert payload["artifact_digest"] == expected.artifact.digest


def test_show_json_lists_rejected_candidates_with_reasons(
    tmp_path: Path, small_cpu_worker: WorkerProfile
) -> None:
    doc = document(
        models={
            "acme-1b": entry(
                variant("gpu", accelerators=["cuda"]), variant("big", min_memory_bytes=64 * GIB)
            )
        }
    )
    path = write(tmp_path / "ops.yaml", doc)
    payload = run_json("show", "acme-1b", "--catalog-file", str(path))
    assert payload["selected_variant"] is None
    assert payload["fit"] == "too-large"
    with pytest.raises(NoCompatibleVariantError) as info:
        resolve_artifact(
            load_catalog_file(path), ArtifactRequest(model="acme-1b"), small_cpu_worker
        )
    assert payload["rejected"] == [
        {"variant": r.variant_id, "reason_code": r.kind.value, "reason": r.reason}
        for r in info.value.rejected
    ]
    assert payload["resolution_error"]["code"] == "no_compatible_variant"


def test_show_unknown_id_exits_2_with_a_clear_message() -> None:
    result = run("show", "no-such-model")
    assert result.exit_code == 2
    assert "sbproxy models show: 'no-such-model' is not in the catalog" in result.stderr
    assert result.stdout == ""


def test_show_unknown_id_in_json_mode_reports_the_code() -> None:
    result = run("show", "no-such-model", "--format", "json")
    assert result.exit_code == 2
    payload = json.loads(result.stdout)
    assert payload["command"] == "models.show"
    assert payload["ok"] is False
    assert payload["error"]["code"] == "unknown_catalog_model"


@pytest.mark.parametrize("verb", [("list",), ("show", "acme-1b")])
def test_bad_catalog_file_exits_2_naming_the_file_and_field(
    tmp_path: Path, verb: tuple[str, ...]
) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(dump(document(models={"acme-1b": entry(variant(revision="main"))})))
    result = run(*verb, "--catalog-file", str(path))
    assert result.exit_code == 2
    assert str(path) in result.stderr
    assert "models.acme-1b.variants[0].revision" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize("size", [2**53, 2**62, 10**30])
@pytest.mark.parametrize("verb", [("list",), ("show", "acme-1b"), ("pull", "acme-1b")])
def test_a_size_beyond_canonical_json_exits_2_naming_the_file_and_field(
    tmp_path: Path, verb: tuple[str, ...], size: int
) -> None:
    # Past 2**53 - 1 the artifact digest's RFC 8785 canonical JSON cannot hold the size.
    files = [{"path": "model.gguf", "sha256": "ab" * 32, "size_bytes": size}]
    path = write(tmp_path / "huge.yaml", document(models={"acme-1b": entry(variant(files=files))}))
    cache = ("--cache-dir", str(tmp_path / "cache")) if verb[0] == "pull" else ()
    result = run(*verb, "--catalog-file", str(path), *cache, "--format", "json")
    assert result.exit_code == 2, result.output
    error = json.loads(result.stdout)["error"]
    assert error["code"] == "invalid_catalog"
    assert error["field"] == "models.acme-1b.variants[0].files[0].size_bytes"
    assert str(path) in error["error"]
    assert "at most 9007199254740991 (2**53 - 1)" in result.stderr


@pytest.mark.parametrize("text", ["", "  \n\n   \n", "\t\n"])
@pytest.mark.parametrize("verb", [("list",), ("show", "acme-1b"), ("pull", "acme-1b")])
def test_an_empty_catalog_file_exits_2_as_an_empty_document(
    tmp_path: Path, verb: tuple[str, ...], text: str
) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text(text, encoding="utf-8")
    cache = ("--cache-dir", str(tmp_path / "cache")) if verb[0] == "pull" else ()
    result = run(*verb, "--catalog-file", str(path), *cache, "--format", "json")
    assert result.exit_code == 2, result.output
    assert json.loads(result.stdout)["error"]["code"] == "invalid_catalog"
    assert f"{path}: invalid catalog: empty document" in result.stderr


def test_missing_catalog_file_exits_2_naming_the_path(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    result = run("list", "--catalog-file", str(path))
    assert result.exit_code == 2
    assert f"cannot read catalog file {path}" in result.stderr


def test_catalog_file_replaces_the_builtin_catalog(tmp_path: Path) -> None:
    path = write(tmp_path / "ops.yaml", document(models={"acme-1b": entry()}))
    payload = run_json("list", "--catalog-file", str(path))
    assert [row["id"] for row in payload["models"]] == ["acme-1b"]
    assert payload["catalog_revision"] == "ops-2026-01-01"
    assert run("show", "qwen3-8b", "--catalog-file", str(path)).exit_code == 2


def test_text_list_is_an_aligned_table(small_cpu_worker: WorkerProfile) -> None:
    result = run("list")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    header = lines[0]
    assert header.split() == [
        "MODEL",
        "VARIANT",
        "FORMAT",
        "SIZE",
        "STABILITY",
        "FIT",
        "MEMORY",
        "ENGINE",
        "STATUS",
    ]
    ids = sorted(load_builtin_catalog().models)
    body = lines[1 : 1 + len(ids)]
    assert [line.split()[0] for line in body] == ids
    fit_column = header.index("FIT")
    assert all(
        line[fit_column:].split()[0] in {"fits", "too-large", "capability-refused", "unknown"}
        for line in body
    )
    assert "worker: cpu" in result.stdout


@pytest.mark.parametrize(
    ("size", "shown"),
    [(512, "512 B"), (12 * 1024, "12.0 KiB"), (3 * 2**20 // 2, "1.5 MiB"), (5 * 2**30, "5.0 GiB")],
)
def test_text_sizes_are_human_readable_and_json_keeps_exact_bytes(
    small_cpu_worker: WorkerProfile, tmp_path: Path, size: int, shown: str
) -> None:
    files = [{"path": "model.gguf", "sha256": "ab" * 32, "size_bytes": size}]
    doc = document(models={"acme-1b": entry(variant(files=files, min_memory_bytes=size))})
    path = write(tmp_path / "ops.yaml", doc)
    result = run("list", "--catalog-file", str(path))
    assert result.exit_code == 0, result.output
    header, row = result.stdout.splitlines()[:2]
    assert row[header.index("SIZE") :].startswith(shown + " ")
    assert row[header.index("MEMORY") :].startswith(shown + " ")
    (listed,) = run_json("list", "--catalog-file", str(path))["models"]
    assert listed["exact_size_bytes"] == size
    assert listed["estimated_memory_bytes"] == size
    text = run("show", "acme-1b", "--catalog-file", str(path)).stdout
    assert f"Q4_K_M, {shown}, stable" in text
    assert f"{shown} memory" in text
    assert f"model.gguf  {size} bytes" in text


def test_bare_models_lists(small_cpu_worker: WorkerProfile) -> None:
    assert run().stdout == run("list").stdout


def test_text_show_summarises_the_model(small_cpu_worker: WorkerProfile) -> None:
    result = run("show", "gemma-3-270m")
    assert result.exit_code == 0
    expected = resolve_artifact(
        load_builtin_catalog(), ArtifactRequest(model="gemma-3-270m"), small_cpu_worker
    )
    assert "selected q4_k_m via llama_cpp" in result.stdout
    assert expected.artifact.digest in result.stdout
    assert "gemma-3-270m-q4_k_m.gguf" in result.stdout


@pytest.mark.parametrize(
    "args", [["list"], ["show", "qwen3-8b"], ["show", "glm-4-flash"], ["show", "nope"]]
)
def test_json_stdout_from_the_real_executable_has_no_escape_or_carriage_return(
    args: list[str],
) -> None:
    completed = subprocess.run(
        [str(SBPROXY), "models", *args, "--format", "json"],
        capture_output=True,
        check=False,
        timeout=60,
    )
    assert completed.returncode == (2 if "nope" in args else 0), completed.stderr
    assert b"\x1b" not in completed.stdout
    assert b"\r" not in completed.stdout
    payload = json.loads(completed.stdout)
    assert payload["schema_version"] == 1
    assert payload["command"] == f"models.{args[0]}"
    assert b"Traceback" not in completed.stderr
