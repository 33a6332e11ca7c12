"""Compatibility `serve:` blocks lower to canonical deployments with deterministic ids."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from sbproxy.config import EngineChoice, legacy_deployment_id
from sbproxy.config.origins import ServeEntry
from tests.config.conftest import load

ErrorsAt = Callable[..., dict[str, str]]


def origin(host: str, *, provider: str = "local", serve: str, models: str = "") -> str:
    extra = f"          models: {models}\n" if models else ""
    return (
        f"  {host}:\n"
        "    action:\n"
        "      type: ai_proxy\n"
        "      providers:\n"
        f"        - name: {provider}\n"
        "          provider_type: managed_model\n"
        f"{extra}"
        "          serve:\n"
        f"{serve}"
    )


SERVE = (
    "            cache_dir: /var/lib/sbproxy/models\n"
    "            models:\n"
    "              - model: qwen2.5-0.5b-instruct\n"
    "                name: qwen\n"
    "                variant: q4_k_m\n"
    "                engine: llama_cpp\n"
    "                keep_alive: 30m\n"
)


def test_serve_block_lowers_to_a_canonical_deployment() -> None:
    compiled = load("origins:\n" + origin("localhost", serve=SERVE, models="[qwen]"))
    assert compiled.model_host is not None
    assert compiled.model_host.cache.directory == "/var/lib/sbproxy/models"
    (deployment_id,) = compiled.deployments
    assert re.fullmatch(r"legacy-local-qwen-[0-9a-f]{8}", deployment_id)
    deployment = compiled.deployments[deployment_id]
    assert deployment.model == "qwen2.5-0.5b-instruct"
    assert deployment.variant == "q4_k_m"
    assert deployment.engine == "llama_cpp"
    assert deployment.keep_alive_secs == 1800
    assert deployment.replicas == 1
    assert deployment.max_queue_depth == 128
    (route,) = compiled.routes
    assert (route.origin, route.public_model, route.deployment) == (
        "localhost",
        "qwen",
        deployment_id,
    )
    assert (
        compiled.lowered_from[deployment_id]
        == "origins.localhost.action.providers[0].serve.models[0]"
    )


def test_lowered_id_is_deterministic_and_content_addressed() -> None:
    entry = ServeEntry(model="qwen2.5-0.5b-instruct", name="qwen", variant="q4_k_m")
    same = ServeEntry(
        model="qwen2.5-0.5b-instruct", name="qwen", variant="q4_k_m", engine=EngineChoice.AUTO
    )
    other = ServeEntry(model="qwen2.5-0.5b-instruct", name="qwen", variant="bf16")
    first = legacy_deployment_id("Local Provider", "qwen", entry)
    assert first == legacy_deployment_id("Local Provider", "qwen", same)
    assert first.startswith("legacy-local-provider-qwen-")
    assert first != legacy_deployment_id("Local Provider", "qwen", other)


def test_equivalent_declarations_in_two_origins_dedupe() -> None:
    text = "origins:\n" + origin("localhost", serve=SERVE) + origin("127.0.0.1", serve=SERVE)
    compiled = load(text)
    assert len(compiled.deployments) == 1
    assert len(compiled.routes) == 2
    assert len({r.deployment for r in compiled.routes}) == 1


def test_conflicting_cache_roots_reject_the_whole_file(errors_at: ErrorsAt) -> None:
    other = SERVE.replace("/var/lib/sbproxy/models", "/srv/models")
    found = errors_at(
        "origins:\n" + origin("localhost", serve=SERVE) + origin("127.0.0.1", serve=other)
    )
    message = found['origins."127.0.0.1".action.providers[0].serve.cache_dir']
    assert "conflicting legacy host policy" in message


def test_conflicting_host_policy_rejects_the_whole_file(errors_at: ErrorsAt) -> None:
    other = SERVE + "            max_concurrent_requests: 8\n"
    found = errors_at(
        "origins:\n" + origin("localhost", serve=SERVE) + origin("127.0.0.1", serve=other)
    )
    assert (
        "max_concurrent_requests differs"
        in found['origins."127.0.0.1".action.providers[0].serve.max_concurrent_requests']
    )


def test_legacy_cache_root_conflicting_with_canonical_is_refused(errors_at: ErrorsAt) -> None:
    text = "proxy:\n  model_host:\n    cache:\n      directory: /srv/other\norigins:\n" + origin(
        "localhost", serve=SERVE
    )
    found = errors_at(text)
    assert (
        "one node has one cache root"
        in found["origins.localhost.action.providers[0].serve.cache_dir"]
    )


def test_conflicting_routes_from_serve_reject_the_whole_file(errors_at: ErrorsAt) -> None:
    other = SERVE.replace("variant: q4_k_m", "variant: bf16")
    found = errors_at(
        "origins:\n" + origin("localhost", serve=SERVE) + origin("127.0.0.1", serve=other)
    )
    message = found['origins."127.0.0.1".action.providers[0].serve.models[0]']
    assert "conflicting route local/qwen" in message


@pytest.mark.parametrize(
    ("field", "phrase"),
    [
        ("gguf_file: qwen.gguf", "pin `variant:`"),
        ("lora_adapters: [{name: a}]", "LoRA"),
        ("max_loras: 2", "LoRA"),
        ("speculative: {draft_model: x}", "speculative"),
        ("chunked_prefill: {max_batched_tokens: 512}", "canonical vLLM deployment"),
        ("tool_call_parser: hermes", "canonical vLLM deployment"),
        ("swap_space_gib: 4", "canonical vLLM deployment"),
        ("cpu_offload_gib: 4", "canonical vLLM deployment"),
    ],
)
def test_unsupported_serve_fields_are_refused_with_remediation(
    errors_at: ErrorsAt, field: str, phrase: str
) -> None:
    serve = SERVE + f"                {field}\n"
    found = errors_at("origins:\n" + origin("localhost", serve=serve))
    name = field.split(":", maxsplit=1)[0]
    message = found[f"origins.localhost.action.providers[0].serve.models[0].{name}"]
    assert phrase in message


@pytest.mark.parametrize(
    "reference", ["hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF", "Qwen/Qwen2.5", "qwen:q4"]
)
def test_raw_repository_references_are_refused(errors_at: ErrorsAt, reference: str) -> None:
    serve = SERVE.replace("model: qwen2.5-0.5b-instruct", f"model: '{reference}'")
    found = errors_at("origins:\n" + origin("localhost", serve=serve))
    message = found["origins.localhost.action.providers[0].serve.models[0].model"]
    assert "raw repository reference" in message
    assert "catalog" in message


def test_unpinned_refs_and_legacy_engines_are_refused(errors_at: ErrorsAt) -> None:
    found = errors_at(
        "origins:\n" + origin("localhost", serve=SERVE + "            allow_unpinned_refs: true\n")
    )
    assert (
        "pin catalog v2" in found["origins.localhost.action.providers[0].serve.allow_unpinned_refs"]
    )
    found = errors_at(
        "origins:\n"
        + origin("localhost", serve=SERVE + "            engines: {llama_cpp: {launch: binary}}\n")
    )
    assert (
        "proxy.model_host.engines" in found["origins.localhost.action.providers[0].serve.engines"]
    )


def test_bad_keep_alive_duration(errors_at: ErrorsAt) -> None:
    serve = SERVE.replace("keep_alive: 30m", "keep_alive: soon")
    found = errors_at("origins:\n" + origin("localhost", serve=serve))
    assert (
        "not a duration"
        in found["origins.localhost.action.providers[0].serve.models[0].keep_alive"]
    )


@pytest.mark.parametrize(
    ("line", "field", "needle"),
    [
        ("max_context: 4611686018427387904", "max_context", "less than or equal to 4294967295"),
        ("max_context: 1000000000000000000000000000000", "max_context", "less than or equal"),
        ("keep_alive: 4611686018427387904", "keep_alive", "at most 31622400 (366 days)"),
        ("keep_alive: 400d", "keep_alive", "at most 31622400 (366 days)"),
    ],
)
def test_huge_serve_entry_integers_are_refused_not_a_canonical_json_crash(
    errors_at: ErrorsAt, line: str, field: str, needle: str
) -> None:
    # The entry is hashed as RFC 8785 JSON into the deployment id, which holds at most 2**53-1.
    serve = SERVE.replace("keep_alive: 30m", line)
    found = errors_at("origins:\n" + origin("localhost", serve=serve))
    assert needle in found[f"origins.localhost.action.providers[0].serve.models[0].{field}"]


def test_provider_models_must_be_served(errors_at: ErrorsAt) -> None:
    found = errors_at("origins:\n" + origin("localhost", serve=SERVE, models="[qwen, llama]"))
    assert (
        "not served by any serve: entry" in found["origins.localhost.action.providers[0].models[1]"]
    )


def test_deployment_and_serve_together_are_refused(errors_at: ErrorsAt) -> None:
    text = "origins:\n" + origin("localhost", serve=SERVE).replace(
        "          serve:\n", "          deployment: x\n          serve:\n"
    )
    found = errors_at(text)
    assert "not both" in found["origins.localhost.action.providers[0].serve"]
