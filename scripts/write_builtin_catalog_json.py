"""Rewrite ``sbproxy/catalog/data/builtin-catalog.json`` from ``builtin-catalog.yaml``.

The YAML is the file people edit; the JSON is the same document, which the package loads
(``sbproxy.catalog.loader``). Run from the repository root after changing the YAML:
``.venv/bin/python scripts/write_builtin_catalog_json.py``; the catalog tests fail until the
two agree.
"""

from __future__ import annotations

import sys
from pathlib import Path

from sbproxy.catalog.loader import (
    BUILTIN_CATALOG_JSON_RESOURCE,
    BUILTIN_CATALOG_RESOURCE,
    builtin_catalog_json,
)

DATA = Path(__file__).resolve().parents[1] / "sbproxy" / "catalog" / "data"


def main() -> None:
    yaml_text = (DATA / BUILTIN_CATALOG_RESOURCE).read_text(encoding="utf-8")
    target = DATA / BUILTIN_CATALOG_JSON_RESOURCE
    target.write_text(builtin_catalog_json(yaml_text), encoding="utf-8")
    sys.stdout.write(f"wrote {target}\n")


if __name__ == "__main__":
    main()
