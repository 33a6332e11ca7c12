"""Variant selection: order of checks, per-candidate reasons and reason codes."""

from __future__ import annotations

import pytest

from sbproxy.catalog import (
    Accelerator,
    ArtifactRequest,
    EngineKind,
    NoCompatibleVariantError,
    RejectionKind,
    WorkerProfile,
    resolve_artifact,
)
from sbproxy.errors import ResolutionError
from tests.catalog.builders import document, entry, legacy_entry, parse, variant

GIB = 2**30
CPU = WorkerProfile(accelerator=Accelerator.CPU, memory_bytes=32 * GIB)
METAL = WorkerProfile(accelerator=Accelerator.METAL, memory_bytes=32 * GIB)
CUDA = WorkerProfile(accelerator=Accelerator.CUDA, memory_bytes=80 * GIB, compute_capability=(9, 0))


def two_variant_catalog() -> dict[str, object]:
    """q4_k_m (gguf, anywhere) declared before awq (safetensors, CUDA only)."""
    return document(
        models={
            "acme-8b": entry(
                variant("q4_k_m"),
                variant("awq", fmt="safetensors", engines=["vllm"], accelerators=["cuda"]),
            ),
            "acme-8b-gpu-first": entry(
                variant("awq", fmt="safetensors", engines=["vllm"], accelerators=["cuda"]),
                variant("q4_k_m"),
            ),
        }
    )


def test_pinned_variant_resolves_to_its_exact_files() -> None:
    doc = two_variant_catalog()
    catalog = parse(doc)
    request = ArtifactRequest(model="acme-8b", variant="awq")
    resolution = resolve_artifact(catalog, request, CUDA)
    artifact = resolution.artifact
    declared = catalog.models["acme-8b"].variants[1]
    assert artifact.variant_id == "awq"
    assert artifact.files == declared.files
    assert artifact.source == declared.source
    assert artifact.revision == declared.revision
    assert artifact.engine is EngineKind.VLLM
    assert artifact.catalog_revision == "ops-2026-01-01"
    assert artifact.context_length == 4096
    assert artifact.min_memory_bytes == declared.requirements.min_memory_bytes
    assert len(artifact.digest) == 64
    assert resolution.rejected == ()


def test_unknown_model_is_reported_with_its_code() -> None:
    with pytest.raises(ResolutionError) as info:
        resolve_artifact(parse(document()), ArtifactRequest(model="nope"), CPU)
    assert info.value.code == "unknown_catalog_model"
    assert "model 'nope' is not in the catalog" in str(info.value)


def test_explicit_unknown_variant_lists_the_available_ids_sorted() -> None:
    with pytest.raises(ResolutionError) as info:
        resolve_artifact(
            parse(two_variant_catalog()), ArtifactRequest(model="acme-8b", variant="fp8"), CUDA
        )
    assert info.value.code == "unknown_catalog_variant"
    assert "model 'acme-8b' has no variant 'fp8' (available: awq, q4_k_m)" in str(info.value)


def test_replicas_without_a_pinned_variant_are_refused() -> None:
    request = ArtifactRequest(model="acme-8b", replicas=2)
    with pytest.raises(ResolutionError) as info:
        resolve_artifact(parse(two_variant_catalog()), request, CUDA)
    assert info.value.code == "variant_not_pinned"
    assert "pin a variant" in str(info.value)
    assert "heterogeneous_variants" in str(info.value)


def test_replicas_check_comes_before_the_variant_existence_check() -> None:
    with pytest.raises(ResolutionError) as info:
        resolve_artifact(parse(document()), ArtifactRequest(model="acme-1b", replicas=3), CPU)
    assert info.value.code == "variant_not_pinned"


def test_pinned_replicas_resolve_to_the_same_digest_on_cuda_and_metal() -> None:
    catalog = parse(two_variant_catalog())
    request = ArtifactRequest(model="acme-8b", variant="q4_k_m", replicas=2)
    on_cuda = resolve_artifact(catalog, request, CUDA).artifact
    on_metal = resolve_artifact(catalog, request, METAL).artifact
    assert on_cuda.digest == on_metal.digest
    assert on_cuda.variant_id == on_metal.variant_id == "q4_k_m"


def test_heterogeneous_replicas_pick_per_worker() -> None:
    catalog = parse(two_variant_catalog())
    request = ArtifactRequest(model="acme-8b-gpu-first", replicas=2, heterogeneous_variants=True)
    assert resolve_artifact(catalog, request, CUDA).artifact.variant_id == "awq"
    on_metal = resolve_artifact(catalog, request, METAL)
    assert on_metal.artifact.variant_id == "q4_k_m"
    assert [(r.variant_id, r.kind) for r in on_metal.rejected] == [
        ("awq", RejectionKind.ACCELERATOR_UNSUPPORTED)
    ]


def test_auto_takes_candidates_in_declaration_order() -> None:
    catalog = parse(two_variant_catalog())
    assert (
        resolve_artifact(catalog, ArtifactRequest(model="acme-8b"), CUDA).artifact.variant_id
        == "q4_k_m"
    )
    first_gpu = resolve_artifact(catalog, ArtifactRequest(model="acme-8b-gpu-first"), CUDA)
    assert first_gpu.artifact.variant_id == "awq"


def test_safetensors_is_preferred_over_pickle_even_when_declared_later() -> None:
    doc = document(
        models={
            "acme-1b": entry(
                variant("pt", fmt="pickle"),
                variant("st", fmt="safetensors"),
                allow_pickle=True,
            )
        }
    )
    resolution = resolve_artifact(parse(doc), ArtifactRequest(model="acme-1b"), CUDA)
    assert resolution.artifact.variant_id == "st"
    assert resolution.rejected == ()


def test_pickle_is_the_fallback_when_allowed_and_nothing_else_fits() -> None:
    doc = document(
        models={
            "acme-1b": entry(
                variant("pt", fmt="pickle"),
                variant("st", fmt="safetensors", accelerators=["metal"]),
                allow_pickle=True,
            )
        }
    )
    resolution = resolve_artifact(parse(doc), ArtifactRequest(model="acme-1b"), CUDA)
    assert resolution.artifact.variant_id == "pt"
    assert [r.variant_id for r in resolution.rejected] == ["st"]


def test_pickle_only_model_without_allow_pickle_is_refused() -> None:
    doc = document(models={"acme-1b": entry(variant("pt", fmt="pickle"))})
    with pytest.raises(NoCompatibleVariantError) as info:
        resolve_artifact(parse(doc), ArtifactRequest(model="acme-1b"), CUDA)
    assert info.value.code == "no_compatible_variant"
    assert "pt: pickle weights require allow_pickle: true" in str(info.value)
    assert [r.kind for r in info.value.rejected] == [RejectionKind.PICKLE_REFUSED]


def test_pinned_pickle_variant_is_refused_without_allow_pickle() -> None:
    doc = document(
        models={"acme-1b": entry(variant("st", fmt="safetensors"), variant("pt", fmt="pickle"))}
    )
    with pytest.raises(NoCompatibleVariantError, match="allow_pickle"):
        resolve_artifact(parse(doc), ArtifactRequest(model="acme-1b", variant="pt"), CUDA)


def test_too_little_memory_names_both_figures() -> None:
    doc = document(models={"acme-1b": entry(variant(min_memory_bytes=8 * GIB))})
    small = WorkerProfile(accelerator=Accelerator.CPU, memory_bytes=4 * GIB)
    with pytest.raises(NoCompatibleVariantError) as info:
        resolve_artifact(parse(doc), ArtifactRequest(model="acme-1b"), small)
    assert f"q4_k_m: worker has {4 * GIB} bytes but variant needs {8 * GIB}" in str(info.value)
    assert info.value.rejected[0].kind is RejectionKind.INSUFFICIENT_MEMORY


def test_memory_exactly_at_the_minimum_fits() -> None:
    doc = document(models={"acme-1b": entry(variant(min_memory_bytes=4 * GIB))})
    exact = WorkerProfile(accelerator=Accelerator.CPU, memory_bytes=4 * GIB)
    assert resolve_artifact(parse(doc), ArtifactRequest(model="acme-1b"), exact).artifact


def test_accelerator_mismatch_is_refused() -> None:
    doc = document(models={"acme-1b": entry(variant(accelerators=["cuda"]))})
    with pytest.raises(NoCompatibleVariantError) as info:
        resolve_artifact(parse(doc), ArtifactRequest(model="acme-1b"), METAL)
    assert "q4_k_m: variant runs on cuda; worker is metal" in str(info.value)
    assert info.value.rejected[0].kind is RejectionKind.ACCELERATOR_UNSUPPORTED


def capability_catalog() -> dict[str, object]:
    needs = {
        "accelerators": ["cuda", "cpu"],
        "min_memory_bytes": 1,
        "min_compute_capability": {"major": 8, "minor": 9},
    }
    return document(models={"acme-1b": entry(variant(requirements=needs))})


@pytest.mark.parametrize(
    ("capability", "phrase"),
    [
        ((8, 6), "worker CUDA compute capability 8.6 is below the variant's minimum 8.9"),
        (None, "unknown"),
    ],
)
def test_cuda_compute_capability_below_minimum_or_unknown_is_refused(
    capability: tuple[int, int] | None, phrase: str
) -> None:
    worker = WorkerProfile(
        accelerator=Accelerator.CUDA, memory_bytes=80 * GIB, compute_capability=capability
    )
    with pytest.raises(NoCompatibleVariantError) as info:
        resolve_artifact(parse(capability_catalog()), ArtifactRequest(model="acme-1b"), worker)
    assert phrase in str(info.value)
    assert info.value.rejected[0].kind is RejectionKind.COMPUTE_CAPABILITY


@pytest.mark.parametrize("capability", [(8, 9), (9, 0)])
def test_cuda_compute_capability_at_or_above_minimum_is_accepted(
    capability: tuple[int, int],
) -> None:
    worker = WorkerProfile(
        accelerator=Accelerator.CUDA, memory_bytes=80 * GIB, compute_capability=capability
    )
    assert resolve_artifact(parse(capability_catalog()), ArtifactRequest(model="acme-1b"), worker)


def test_compute_capability_is_not_checked_on_cpu_workers() -> None:
    assert resolve_artifact(parse(capability_catalog()), ArtifactRequest(model="acme-1b"), CPU)


def test_forced_engine_must_be_listed_by_the_variant() -> None:
    with pytest.raises(NoCompatibleVariantError) as info:
        resolve_artifact(parse(document()), ArtifactRequest(model="acme-1b", engine="vllm"), CUDA)
    assert "q4_k_m: engine vllm was requested but the variant is served by llama_cpp" in str(
        info.value
    )
    assert info.value.rejected[0].kind is RejectionKind.ENGINE_UNAVAILABLE


def test_forced_engine_listed_by_the_variant_is_used() -> None:
    doc = document(models={"acme-1b": entry(variant(engines=["llama_cpp", "mistralrs"]))})
    artifact = resolve_artifact(
        parse(doc), ArtifactRequest(model="acme-1b", engine="mistralrs"), CPU
    ).artifact
    assert artifact.engine is EngineKind.MISTRALRS


def test_auto_engine_is_the_first_variant_engine_the_worker_offers() -> None:
    doc = document(models={"acme-1b": entry(variant(engines=["sglang", "vllm", "llama_cpp"]))})
    artifact = resolve_artifact(parse(doc), ArtifactRequest(model="acme-1b"), CUDA).artifact
    assert artifact.engine is EngineKind.VLLM


def test_auto_never_picks_an_opt_in_engine_on_a_default_worker() -> None:
    doc = document(
        models={"acme-1b": entry(variant("bf16", fmt="safetensors", engines=["mistralrs"]))}
    )
    with pytest.raises(NoCompatibleVariantError) as info:
        resolve_artifact(parse(doc), ArtifactRequest(model="acme-1b"), CPU)
    assert "bf16: no compatible engine on worker" in str(info.value)
    worker = CPU.model_copy(update={"engines": frozenset({EngineKind.MISTRALRS})})
    assert (
        resolve_artifact(parse(doc), ArtifactRequest(model="acme-1b"), worker).artifact.engine
        is EngineKind.MISTRALRS
    )


def test_all_rejected_lists_every_candidate_with_its_reason() -> None:
    doc = document(
        models={
            "acme-1b": entry(
                variant("big", min_memory_bytes=1024 * GIB),
                variant("gpu", accelerators=["cuda"]),
                variant("pt", fmt="pickle"),
            )
        }
    )
    with pytest.raises(NoCompatibleVariantError) as info:
        resolve_artifact(parse(doc), ArtifactRequest(model="acme-1b"), CPU)
    message = str(info.value)
    assert message.startswith("model 'acme-1b' has no compatible artifact variant")
    reasons = message.split(": ", 1)[1]
    assert (
        reasons.index("big: worker has")
        < reasons.index("gpu: variant runs on cuda")
        < reasons.index("pt: pickle weights require allow_pickle")
    )
    assert [r.variant_id for r in info.value.rejected] == ["big", "gpu", "pt"]


def test_checks_run_in_reference_order_per_candidate() -> None:
    # Pickle refusal wins over accelerator, accelerator over memory.
    doc = document(
        models={
            "acme-1b": entry(
                variant("pt", fmt="pickle", accelerators=["cuda"], min_memory_bytes=1024 * GIB),
                variant("gpu", accelerators=["cuda"], min_memory_bytes=1024 * GIB),
            )
        }
    )
    with pytest.raises(NoCompatibleVariantError) as info:
        resolve_artifact(parse(doc), ArtifactRequest(model="acme-1b"), CPU)
    # Pickle candidates are tried last, whatever their declaration order.
    assert [(r.variant_id, r.kind) for r in info.value.rejected] == [
        ("gpu", RejectionKind.ACCELERATOR_UNSUPPORTED),
        ("pt", RejectionKind.PICKLE_REFUSED),
    ]


def test_legacy_entry_cannot_resolve_and_mentions_catalog_v2() -> None:
    doc = document(models={"glm": legacy_entry()})
    with pytest.raises(ResolutionError) as info:
        resolve_artifact(parse(doc), ArtifactRequest(model="glm"), CPU)
    assert info.value.code == "preview_incomplete"
    assert "catalog v2" in str(info.value)


def test_check_reference_reports_unknown_models_and_variants() -> None:
    catalog = parse(two_variant_catalog())
    assert catalog.check_reference("acme-8b") is None
    assert catalog.check_reference("acme-8b", "awq") is None
    missing_model = catalog.check_reference("nope")
    assert missing_model is not None
    assert missing_model[0] == "model"
    assert "model 'nope' is not in the catalog" in missing_model[1]
    missing_variant = catalog.check_reference("acme-8b", "fp8")
    assert missing_variant == (
        "variant",
        "model 'acme-8b' has no variant 'fp8' (available: awq, q4_k_m)",
    )


def test_request_rejects_zero_replicas_and_unknown_engines() -> None:
    with pytest.raises(ValueError, match="replicas"):
        ArtifactRequest(model="acme-1b", replicas=0)
    with pytest.raises(ValueError, match="engine"):
        ArtifactRequest.model_validate({"model": "acme-1b", "engine": "tgi"})
