"""The checked-in JSON Schema stays current, and every example configuration loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sbproxy.config import config_json_schema, config_json_schema_text, load_config

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_FILE = ROOT / "schemas" / "sb-config.schema.json"
EXAMPLES = sorted((ROOT / "examples").glob("*/sb.yml"))


def test_checked_in_schema_is_current() -> None:
    assert SCHEMA_FILE.read_text() == config_json_schema_text(), (
        "schemas/sb-config.schema.json is stale; regenerate it with "
        "`sbproxy config schema > schemas/sb-config.schema.json`"
    )


def test_schema_describes_every_field() -> None:
    schema = config_json_schema()
    assert schema["$schema"].endswith("2020-12/schema")
    undocumented = []
    for name, definition in schema["$defs"].items():
        for field, spec in definition.get("properties", {}).items():
            if "description" not in spec:
                undocumented.append(f"{name}.{field}")
    assert undocumented == []
    deployment = schema["$defs"]["DeploymentConfig"]
    assert deployment["additionalProperties"] is False
    assert deployment["properties"]["max_queue_depth"]["default"] == 128


def test_example_list_is_not_empty() -> None:
    assert any(p.parent.name == "model-host-managed" for p in EXAMPLES)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.parent.name)
def test_example_configuration_loads(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SB_ADMIN_PASSWORD", "example-password")
    compiled = load_config(path)
    assert compiled.routes, "an example should route at least one model"
    for route in compiled.routes:
        assert route.deployment in compiled.deployments


def test_canonical_example_matches_the_spec() -> None:
    compiled = load_config(
        ROOT / "examples" / "model-host-managed" / "sb.yml",
        env={"SB_ADMIN_PASSWORD": "example-password"},
    )
    deployment = compiled.deployments["local-qwen"]
    assert (deployment.model, deployment.variant) == ("qwen2.5-0.5b-instruct", "q4_k_m")
    assert deployment.pull == "on_boot"
    assert deployment.warm is True
    assert deployment.max_concurrency == 4
    assert [(r.origin, r.public_model, r.default) for r in compiled.routes] == [
        ("localhost", "qwen", True)
    ]
    first_line = (ROOT / "examples" / "model-host-managed" / "sb.yml").read_text().splitlines()[0]
    assert json.dumps("../../schemas/sb-config.schema.json")[1:-1] in first_line
