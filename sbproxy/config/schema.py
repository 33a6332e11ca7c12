"""JSON Schema of ``sb.yml``, generated from the models (``schemas/sb-config.schema.json``)."""

from __future__ import annotations

import json
from typing import Any

from sbproxy.config.document import SbConfig

__all__ = ["SCHEMA_ID", "config_json_schema", "config_json_schema_text"]

SCHEMA_ID = "https://sbproxy.dev/schemas/sb-config.schema.json"


def config_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) that editors can use to check ``sb.yml``."""
    schema = SbConfig.model_json_schema(mode="validation")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "sbproxy configuration (sb.yml)",
        **{k: v for k, v in schema.items() if k != "title"},
    }


def config_json_schema_text() -> str:
    """The schema as stable, pretty-printed JSON text ending in a newline."""
    return json.dumps(config_json_schema(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
