"""The configuration reference (``docs/configuration.md``), rendered from the JSON Schema.

Every field of ``sb.yml`` is listed under the dotted path an error message would name
(``proxy.model_host.deployments.<id>.queue_timeout_ms``), with its type, allowed values and
bounds, default and description. The page is generated, never edited: ``sbproxy config docs
> docs/configuration.md`` writes it, and a test fails when the checked-in page differs from
what the schema renders now.

Rendering rules:

* an object reached through a field gets its own section, headed by its dotted path, with
  one table row per property (in schema order, which is the models' field order);
* a map (``additionalProperties`` or ``patternProperties``) continues the path with a
  placeholder for the key: ``origins.<host>``, ``deployments.<id>``; a list of objects
  continues it with ``[]``: ``providers[]``;
* ``$ref`` is followed into ``$defs``; ``anyOf [X, null]`` is X, optional, default ``null``;
  an enum's values are listed in the type column;
* a field with no ``default`` in the schema is either required, or takes its default from
  a factory (an empty list or map, or an object whose own fields carry the defaults).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sbproxy.config.schema import config_json_schema

__all__ = ["config_reference_markdown"]

Schema = dict[str, Any]

# The name of the key of each map whose values are objects, by the definition of the value.
_KEY_NAMES = {"OriginConfig": "host", "DeploymentConfig": "id"}

_HEADER = """\
# Configuration reference

<!-- Generated from the JSON Schema (schemas/sb-config.schema.json) by
     `sbproxy config docs > docs/configuration.md`. Do not edit: change the field
     descriptions in sbproxy/config/ and regenerate; tests/config/test_reference_doc.py
     fails while this page is stale. -->

Every field of `sb.yml`, under the dotted path that validation errors name. Types come from
the JSON Schema that editors use (`# yaml-language-server: $schema=...`, see
`schemas/sb-config.schema.json`); the file is strict: an unknown key is an error naming its
path. Any string value may use `${VAR}` or `${VAR:-default}` (an unset variable without a
default is an error naming the variable and the path; `$${` writes a literal `${`).

`sbproxy config validate -f sb.yml` checks a file (exit 0 valid, 2 invalid, every problem
listed with its dotted path and line). Cross-field rules that a schema cannot express (a
non-loopback admin listener needs `tls` and `ip_allowlist`, `admin_managed` needs
`store_path`, a deployment with several replicas pins a `variant` ...) are checked by the
loader too; their messages say what to change.

Placeholders in paths: `<host>` is an origin's Host header value, `<id>` a deployment id
(`[A-Za-z0-9._-]`, at most 128 characters), `[]` an element of a list.
"""


@dataclass(frozen=True)
class _Row:
    path: str
    type: str
    default: str
    description: str


@dataclass(frozen=True)
class _Section:
    path: str
    description: str
    rows: tuple[_Row, ...]


def config_reference_markdown() -> str:
    """The whole Markdown page, ending in one newline (see the module docstring)."""
    schema = config_json_schema()
    sections = list(_Walker(schema["$defs"]).sections("", schema))
    out = [_HEADER]
    out.append("## Contents\n")
    out.extend(f"- [`{s.path}`](#{_anchor(s.path)})" for s in sections)
    out.append("")
    for section in sections:
        out.append(f"## `{section.path}`\n")
        if section.description:
            out.append(f"{section.description}\n")
        out.append("| Field | Type | Default | Description |")
        out.append("|---|---|---|---|")
        out.extend(
            f"| `{r.path}` | {r.type} | {r.default} | {r.description} |" for r in section.rows
        )
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


class _Walker:
    def __init__(self, defs: dict[str, Schema]) -> None:
        self.defs = defs

    def resolve(self, node: Schema) -> tuple[Schema, str | None]:
        """``node`` with a ``$ref`` followed (one level), and the definition's name."""
        ref = node.get("$ref")
        if ref is None:
            return node, None
        name = str(ref).rsplit("/", 1)[-1]
        return self.defs[name], name

    def sections(self, path: str, node: Schema) -> Iterator[_Section]:
        """The section of the object ``node`` at ``path``, then those of its sub-objects."""
        node, _ = self.resolve(node)
        required = set(node.get("required", ()))
        rows = []
        children: list[tuple[str, Schema]] = []
        for name, field in node.get("properties", {}).items():
            field_path = f"{path}.{name}" if path else name
            rows.append(self.row(field_path, field, required=name in required))
            children.extend(self.nested(field_path, field))
        title = path or "sb.yml"
        yield _Section(title, _summary(node.get("description", "")), tuple(rows))
        for child_path, child in children:
            yield from self.sections(child_path, child)

    def nested(self, path: str, field: Schema) -> Iterator[tuple[str, Schema]]:
        """The objects below a field that get their own section, with their paths."""
        for option in _options(field):
            target, _ = self.resolve(option)
            if "properties" in target:
                yield path, target
                continue
            if target.get("type") == "array" and "items" in target:
                item, _ = self.resolve(target["items"])
                if "properties" in item:
                    yield f"{path}[]", item
                continue
            value = self._map_value(target)
            if value is not None:
                value_node, value_name = self.resolve(value)
                if "properties" in value_node:
                    key = _KEY_NAMES.get(value_name or "", "key")
                    yield f"{path}.<{key}>", value_node

    @staticmethod
    def _map_value(node: Schema) -> Schema | None:
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            return extra
        patterns = node.get("patternProperties")
        if isinstance(patterns, dict) and len(patterns) == 1:
            value: Schema = next(iter(patterns.values()))
            return value
        return None

    def row(self, path: str, field: Schema, *, required: bool) -> _Row:
        options = _options(field)
        nullable = len(options) < len(field.get("anyOf", [field]))
        types = [self.type_of(option, path) for option in options]
        type_text = " or ".join(types)
        if "default" in field:
            default = _literal(field["default"])
        elif required:
            default = "required"
        else:
            default = self.factory_default(options)
        description = _prose(field.get("description", ""))
        if nullable and "default" not in field and not required:
            default = "`null`"
        return _Row(path, _cell(type_text), _cell(default), _cell(description))

    def factory_default(self, options: list[Schema]) -> str:
        target, _ = self.resolve(options[0]) if options else ({}, None)
        kind = target.get("type")
        if kind == "array":
            return "`[]`"
        if "properties" in target:
            return "see below"
        if kind == "object":
            return "`{}`"
        return "none"

    def type_of(self, node: Schema, path: str) -> str:
        """A short type description of one (non-null) schema option, bounds included."""
        target, _ = self.resolve(node)
        if "const" in target:
            return f"`{json.dumps(target['const'])}` (constant)"
        if "enum" in target:
            return " \\| ".join(f"`{value}`" for value in target["enum"])
        if "properties" in target:
            return f"object ([below](#{_anchor(path)}))"
        kind = target.get("type")
        if kind == "array":
            return self._list_type(target, path)
        if kind == "object":
            return self._map_type(target, path)
        text = str(kind or "any")
        if target.get("format") == "password":
            text += " (secret: never echoed)"
        return text + _bounds(target)

    def _list_type(self, target: Schema, path: str) -> str:
        item = target.get("items", {})
        item_target, _ = self.resolve(item)
        if "properties" in item_target:
            inner = f"objects ([below](#{_anchor(path + '[]')}))"
        else:
            inner = self.type_of(item, path)
        return f"list of {inner}" + _bounds(target, items=True)

    def _map_type(self, target: Schema, path: str) -> str:
        value = self._map_value(target)
        if value is None:
            return "object"
        value_node, value_name = self.resolve(value)
        key = _KEY_NAMES.get(value_name or "", "key")
        if "properties" in value_node:
            inner = f"objects ([below](#{_anchor(f'{path}.<{key}>')}))"
        else:
            inner = self.type_of(value, path)
        keys = target.get("patternProperties")
        key_rule = f", keys match `{next(iter(keys))}`" if isinstance(keys, dict) else ""
        return f"map of {key} to {inner}{key_rule}"


def _options(field: Schema) -> list[Schema]:
    """The non-null alternatives of a field."""
    alternatives: list[Schema] = field.get("anyOf", [field])
    return [option for option in alternatives if option.get("type") != "null"]


def _bounds(node: Schema, *, items: bool = False) -> str:
    parts = []
    if "minimum" in node:
        parts.append(f">= {_number(node['minimum'])}")
    if "exclusiveMinimum" in node:
        parts.append(f"> {_number(node['exclusiveMinimum'])}")
    if "maximum" in node:
        parts.append(f"<= {_number(node['maximum'])}")
    if "exclusiveMaximum" in node:
        parts.append(f"< {_number(node['exclusiveMaximum'])}")
    if items and "minItems" in node:
        parts.append(f"at least {node['minItems']} item{'s' if node['minItems'] != 1 else ''}")
    if items and "maxItems" in node:
        parts.append(f"at most {node['maxItems']} items")
    if "pattern" in node:
        parts.append(f"matches `{node['pattern']}`")
    return f", {', '.join(parts)}" if parts else ""


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _literal(value: object) -> str:
    return f"`{json.dumps(value)}`"


def _prose(text: str) -> str:
    """A description as Markdown: RST ````code```` becomes Markdown ```code```, and ``<``,
    ``>`` outside code are escaped (``<repository>`` would otherwise read as an HTML tag)."""
    text = re.sub(r"``(.+?)``", r"`\1`", " ".join(str(text).split()))
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(
        part if part.startswith("`") else part.replace("<", "&lt;").replace(">", "&gt;")
        for part in parts
    )


def _summary(text: str) -> str:
    """A section's description without the leading ```path`: `` that repeats its heading."""
    text = _prose(text)
    match = re.match(r"`[^`]+`: (.+)", text)
    if match is None:
        return text
    rest = match.group(1)
    return rest[:1].upper() + rest[1:]


def _cell(text: str) -> str:
    """Text safe inside a table cell (an unescaped ``|`` would end the cell)."""
    return re.sub(r"(?<!\\)\|", r"\\|", text)


def _anchor(heading: str) -> str:
    """The anchor GitHub gives a heading ``## `<heading>` ``: lower case, punctuation other
    than ``-`` and ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.lower()).replace(" ", "-")
