"""Loading sb.yml: YAML errors, ${VAR} interpolation, files and relative paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbproxy.config import load_config
from sbproxy.errors import ConfigError
from tests.config.conftest import BASE, issues, load

ADMIN = """
proxy:
  admin:
    enabled: true
    port: ${ADMIN_PORT:-9191}
    password: ${SB_ADMIN_PASSWORD}
"""


def test_variables_are_interpolated_and_typed_by_the_field() -> None:
    compiled = load(ADMIN, env={"SB_ADMIN_PASSWORD": "s3cret-value", "ADMIN_PORT": "9300"})
    admin = compiled.config.proxy.admin
    assert admin.port == 9300
    assert admin.password is not None
    assert admin.password.get_secret_value() == "s3cret-value"


def test_default_applies_when_unset_or_empty() -> None:
    for env in ({"SB_ADMIN_PASSWORD": "pw"}, {"SB_ADMIN_PASSWORD": "pw", "ADMIN_PORT": ""}):
        assert load(ADMIN, env=env).config.proxy.admin.port == 9191


def test_unset_variable_without_default_names_variable_and_path() -> None:
    found = issues(ADMIN, env={})
    assert len(found) == 1
    assert found[0].path == "proxy.admin.password"
    assert "SB_ADMIN_PASSWORD is not set" in found[0].message
    assert found[0].line == 6


def test_variable_values_never_appear_in_errors() -> None:
    secret = "do-not-print-this-secret"
    text = "proxy:\n  http_bind_port: ${PORT}\n"
    with pytest.raises(ConfigError) as info:
        load(text, env={"PORT": secret})
    assert secret not in str(info.value)
    assert "proxy.http_bind_port" in str(info.value)


def test_escaped_dollar_brace_is_literal() -> None:
    text = "proxy:\n  admin:\n    enabled: true\n    password: 'pa$${x}ss'\n"
    admin = load(text).config.proxy.admin
    assert admin.password is not None
    assert admin.password.get_secret_value() == "pa${x}ss"


def test_malformed_reference_is_an_error() -> None:
    found = issues("proxy:\n  admin:\n    password: ${1BAD}\n")
    assert found[0].path == "proxy.admin.password"
    assert "not a valid reference" in found[0].message


def test_duplicate_yaml_keys_are_refused() -> None:
    found = issues(
        BASE.replace(
            "        variant: q4_k_m\n", "        variant: q4_k_m\n        variant: bf16\n"
        )
    )
    assert found[0].path == "proxy.model_host.deployments.local-qwen.variant"
    assert "duplicate key" in found[0].message


def test_yaml_syntax_error_has_a_line_and_no_traceback() -> None:
    found = issues("proxy:\n  http_bind_port: [8080\n")
    assert "not valid YAML" in found[0].message
    assert found[0].line is not None


def test_top_level_must_be_a_mapping() -> None:
    found = issues("- just\n- a list\n")
    assert "top level must be a mapping" in found[0].message


@pytest.mark.parametrize("text", ["", "  \n\t\n", "# only a comment\n"])
def test_an_empty_file_is_empty_config(text: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load(text)
    assert raised.value.code == "empty_config"
    assert "the file is empty" in str(raised.value)


def test_an_empty_mapping_is_a_valid_empty_configuration() -> None:
    compiled = load("{}")
    assert compiled.model_host is None
    assert compiled.routes == ()


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "absent.yml")


def test_non_utf8_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "sb.yml"
    path.write_bytes(b"proxy:\n  bind_address: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(path)


def test_relative_catalog_file_resolves_against_the_config_directory(tmp_path: Path) -> None:
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    path = conf_dir / "sb.yml"
    path.write_text("proxy:\n  model_host:\n    catalog_file: catalogs/ops.yaml\n")
    compiled = load_config(path)
    assert compiled.model_host is not None
    assert compiled.model_host.catalog_file == str(conf_dir / "catalogs" / "ops.yaml")
    assert compiled.source == path


def test_relative_paths_in_a_configmap_mount_resolve_in_the_mount(tmp_path: Path) -> None:
    """sb.yml -> ..data/sb.yml -> ..<timestamp>/sb.yml: a relative path names the mount's
    sibling link, not the timestamped directory the kubelet replaces at every update."""
    mount = tmp_path / "config"
    version = mount / "..2026_12_01_00_00_00.1"
    version.mkdir(parents=True)
    (version / "sb.yml").write_text("proxy:\n  model_host:\n    catalog_file: catalog.yaml\n")
    (mount / "..data").symlink_to(version.name)
    (mount / "sb.yml").symlink_to("..data/sb.yml")
    compiled = load_config(mount / "sb.yml")
    assert compiled.model_host is not None
    assert compiled.model_host.catalog_file == str(mount / "catalog.yaml")
