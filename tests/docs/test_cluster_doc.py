"""``docs/cluster.md`` is an operator guide: every ``yaml`` example in it that declares
``proxy:`` is a complete, valid ``sb.yml`` -- loaded here with the real configuration loader,
its ``${VAR}`` interpolations given values -- and a cluster one routes a model to a fleet
deployment (an example without ``origins`` answers every request 404 ``unknown_origin``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from sbproxy.config import load_config
from sbproxy.config.model_host import Authority

DOC = Path(__file__).resolve().parents[2] / "docs" / "cluster.md"
# A fenced block, possibly indented under a list item: its indent, its language and body.
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<lang>\w*)\n(?P<body>.*?)^(?P=indent)```", re.M | re.S
)
VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def config_examples(text: str) -> list[str]:
    """Every ```yaml block of ``text`` whose document has a top-level ``proxy:``, dedented."""
    found = []
    for match in FENCE.finditer(text):
        if match.group("lang") != "yaml":
            continue
        indent = match.group("indent")
        lines = match.group("body").splitlines()
        body = "\n".join(line.removeprefix(indent) for line in lines) + "\n"
        document = yaml.safe_load(body)
        if isinstance(document, dict) and "proxy" in document:
            found.append(body)
    return found


def test_the_extraction_finds_indented_blocks_and_skips_others() -> None:
    text = "\n".join(
        [
            "1. step:",
            "",
            "   ```yaml",
            "   proxy:",
            "     http_bind_port: 8080",
            "   ```",
            "```yaml",
            "not_a_config: true",
            "```",
            "```sh",
            "proxy: no",
            "```",
        ]
    )
    assert config_examples(text) == ["proxy:\n  http_bind_port: 8080\n"]


def test_every_config_example_of_the_cluster_guide_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    examples = config_examples(DOC.read_text())
    assert examples, "docs/cluster.md has no yaml example declaring proxy:"
    clusters = 0
    for number, body in enumerate(examples):
        for name in VARIABLE.findall(body):
            # Secrets have minimum lengths: a value long enough for any of them.
            monkeypatch.setenv(name, f"doc-example-{name.lower()}-0123456789abcdef")
            if name.endswith("JOIN_TOKEN"):  # a join token has its own shape
                monkeypatch.setenv(name, "k3x9q2ab.5f0c1e9a7b2d4c6e8f0a1b3c5d7e9f01")
        path = tmp_path / f"example-{number}.yml"
        path.write_text(body)
        compiled = load_config(path)  # raises ConfigError naming the dotted path
        host = compiled.model_host
        if host is None or host.authority != Authority.CLUSTER_AUTHORITY:
            continue
        clusters += 1
        assert compiled.config.origins, f"example {number}: no origins: every request is 404"
        routed = {route.deployment for route in compiled.routes}
        assert routed & set(compiled.deployments), (
            f"example {number}: no route reaches a deployment"
        )
    assert clusters, "docs/cluster.md has no cluster_authority example"
