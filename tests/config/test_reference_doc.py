"""docs/configuration.md is the JSON Schema rendered, and stays current; it lists every field."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from sbproxy.cli.main import cli
from sbproxy.config import config_json_schema, config_reference_markdown

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "configuration.md"
ROW = re.compile(r"^\| `(?P<path>[^`]+)` \| (?P<type>.+?) \| (?P<default>.+?) \| (?P<text>.*) \|$")


def _rows(text: str) -> dict[str, dict[str, str]]:
    rows = {}
    for line in text.splitlines():
        match = ROW.match(line)
        if match and match["path"] != "Field":
            rows[match["path"]] = match.groupdict()
    return rows


def test_checked_in_reference_is_current() -> None:
    assert REFERENCE.read_text() == config_reference_markdown(), (
        "docs/configuration.md is stale; regenerate it with "
        "`sbproxy config docs > docs/configuration.md`"
    )


def test_cli_prints_the_reference() -> None:
    result = CliRunner().invoke(cli, ["config", "docs"], catch_exceptions=False)
    assert result.exit_code == 0
    assert result.output == config_reference_markdown()


def test_every_schema_property_has_a_described_row() -> None:
    rows = _rows(config_reference_markdown())
    schema: dict[str, Any] = config_json_schema()
    missing = []
    for name, definition in [("sb.yml", schema), *schema["$defs"].items()]:
        for field in definition.get("properties", {}):
            if not any(path == field or path.endswith(f".{field}") for path in rows):
                missing.append(f"{name}.{field}")
    assert missing == []
    for path, row in rows.items():
        assert row["text"].strip(), f"{path} has no description"
        assert row["default"].strip(), f"{path} has no default cell"


def test_rows_carry_type_bounds_and_default() -> None:
    rows = _rows(config_reference_markdown())
    deployment = "proxy.model_host.deployments.<id>"
    queue = rows[f"{deployment}.queue_timeout_ms"]
    assert queue["type"] == "integer, >= 1, <= 86400000"
    assert queue["default"] == "`30000`"
    for field, default in {
        "request_timeout_ms": 300000,
        "first_token_timeout_ms": 120000,
        "stall_timeout_ms": 30000,
        "unhealthy_after": 3,
        "start_timeout_ms": 300000,
        "restart_backoff_initial_ms": 1000,
        "restart_backoff_max_ms": 60000,
        "max_launch_attempts": 5,
    }.items():
        assert rows[f"{deployment}.{field}"]["default"] == f"`{default}`", field
    assert rows[f"{deployment}.model"]["default"] == "required"
    assert rows[f"{deployment}.rollout"]["type"] == "`rolling` \\| `recreate`"
    assert rows["proxy.admin.ip_allowlist"]["default"] == "`[]`"
    assert rows["proxy.admin.password"]["default"] == "`null`"
    assert "secret" in rows["proxy.admin.password"]["type"]
    assert rows["origins.<host>.action.providers[].provider_type"]["type"].startswith(
        '`"managed_model"`'
    )
    # A bare <repository> would be read as an HTML tag and vanish.
    assert "&lt;repository&gt;" in rows["proxy.model_host.engines.llama_cpp.image"]["text"]


def test_section_links_resolve() -> None:
    text = config_reference_markdown()
    anchors = {
        re.sub(r"[^a-z0-9 _-]", "", heading.lower()).replace(" ", "-")
        for heading in re.findall(r"^## `([^`]+)`$", text, flags=re.MULTILINE)
    }
    targets = set(re.findall(r"\]\(#([^)]+)\)", text))
    assert targets - anchors == set()
