"""Read catalog documents from YAML: the built-in one shipped with the package, or an
operator's file, which replaces the built-in catalog entirely.

The built-in catalog is written in ``data/builtin-catalog.yaml`` and shipped also as
``data/builtin-catalog.json``, the same document in JSON: the stdlib parses it in well under
a millisecond, where PyYAML takes ~7 ms to import and ~10 ms to parse it in pure Python, on
every ``sbproxy models list``. Both validate through the same model; the tests hold the two
documents equal, and ``python scripts/write_builtin_catalog_json.py`` rewrites the JSON from
the YAML.

Every failure is a :class:`~sbproxy.errors.CatalogError` with code ``invalid_catalog``
whose message names the file, the line when known, and the dotted path of the offending
field (``models.qwen3-8b.variants[0].revision``), then says what is allowed.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from sbproxy.catalog.schema import Catalog
from sbproxy.errors import CatalogError

if typing.TYPE_CHECKING:
    import yaml

__all__ = [
    "BUILTIN_CATALOG_JSON_RESOURCE",
    "BUILTIN_CATALOG_RESOURCE",
    "builtin_catalog_json",
    "load_builtin_catalog",
    "load_catalog",
    "load_catalog_file",
    "parse_catalog",
]

BUILTIN_CATALOG_RESOURCE = "builtin-catalog.yaml"
"""File name of the built-in catalog inside the ``sbproxy.catalog.data`` resources."""
BUILTIN_CATALOG_JSON_RESOURCE = "builtin-catalog.json"
"""The same document in JSON, which :func:`load_builtin_catalog` reads."""

_MAX_REPORTED_ISSUES = 20


@dataclass(frozen=True, slots=True)
class _Issue:
    path: str
    message: str
    line: int | None

    def render(self) -> str:
        where = f"line {self.line}: " if self.line is not None else ""
        subject = f"{self.path}: " if self.path else ""
        return f"{where}{subject}{self.message}"


def load_builtin_catalog() -> Catalog:
    """Load the catalog shipped inside the package (``data/builtin-catalog.json``, the JSON
    form of ``data/builtin-catalog.yaml``).

    Returns:
        The validated built-in catalog (schema 2, revision ``builtin-2026-07-10``).

    Raises:
        CatalogError: ``invalid_catalog`` if the packaged file is missing or invalid, which
            the test suite guards against.
    """
    resource = resources.files("sbproxy.catalog").joinpath("data", BUILTIN_CATALOG_JSON_RESOURCE)
    source = f"<built-in {BUILTIN_CATALOG_JSON_RESOURCE}>"
    try:
        text = resource.read_text(encoding="utf-8")
    except OSError as exc:
        raise CatalogError(
            f"the built-in catalog {BUILTIN_CATALOG_JSON_RESOURCE} is missing from the "
            f"package: {exc}",
            remediation="Reinstall sbproxy.",
        ) from exc
    try:
        data = json.loads(text)
    except ValueError as exc:
        _raise(source, [_Issue("", f"not valid JSON: {exc}", None)])
    return _validate(data, source=source, root=None)


def builtin_catalog_json(yaml_text: str) -> str:
    """The text of ``builtin-catalog.json`` for the built-in catalog's YAML ``yaml_text``.

    Raises:
        CatalogError: ``invalid_catalog`` if the YAML is not a valid catalog.
    """
    parse_catalog(yaml_text, source=f"<built-in {BUILTIN_CATALOG_RESOURCE}>")
    _, data = _load_yaml(yaml_text, source=f"<built-in {BUILTIN_CATALOG_RESOURCE}>")
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n"


def load_catalog_file(path: Path) -> Catalog:
    """Load an operator catalog file.

    Args:
        path: A YAML catalog document.

    Returns:
        The validated catalog. It replaces the built-in catalog; nothing is merged.

    Raises:
        CatalogError: ``invalid_catalog`` if the file cannot be read, is not UTF-8 YAML, has
            duplicate keys, or breaks the schema.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise CatalogError(
            f"cannot read catalog file {path}: {reason}.",
            remediation="Check the path given as the catalog file.",
            details={"path": str(path)},
        ) from exc
    return parse_catalog(text, source=str(path))


def load_catalog(catalog_file: Path | None = None) -> Catalog:
    """Load the operator's catalog when one is given, else the built-in one.

    Raises:
        CatalogError: ``invalid_catalog`` as for :func:`load_catalog_file`.
    """
    if catalog_file is not None:
        return load_catalog_file(catalog_file)
    return load_builtin_catalog()


def parse_catalog(text: str, *, source: str) -> Catalog:
    """Parse and validate catalog YAML.

    Args:
        text: The YAML document.
        source: How to name the document in error messages (usually its path).

    Returns:
        The validated catalog.

    Raises:
        CatalogError: ``invalid_catalog`` naming ``source`` and the offending dotted path.
    """
    # Whitespace alone (tabs included, which YAML would call a syntax error) is empty too.
    root, data = _load_yaml(text, source=source) if text.strip() else (None, None)
    if data is None:
        # An empty (or whitespace/comment-only, or null) file is almost always a truncated
        # write or the wrong path; loading it as an empty catalog would hide every model.
        _raise(
            source,
            [
                _Issue(
                    "",
                    "empty document; a catalog file is a mapping with schema_version, "
                    "catalog_revision and models (write at least `models: {}` for an empty one)",
                    None,
                )
            ],
        )
    return _validate(data, source=source, root=root)


def _validate(data: object, *, source: str, root: yaml.Node | None) -> Catalog:
    """Validate a parsed document (``root``: its YAML node tree, for line numbers)."""
    if not isinstance(data, dict):
        _raise(source, [_Issue("", "the document must be a mapping with a 'models' key", 1)])
    try:
        return Catalog.model_validate(data)
    except ValidationError as exc:
        issues = [_issue_from_error(error, root) for error in exc.errors()]
        _raise(source, issues)


def _raise(source: str, issues: Sequence[_Issue]) -> typing.NoReturn:
    shown = list(issues[:_MAX_REPORTED_ISSUES])
    if len(shown) == 1:
        message = f"{source}: invalid catalog: {shown[0].render()}"
    else:
        lines = "\n".join(f"  - {issue.render()}" for issue in shown)
        more = len(issues) - len(shown)
        tail = f"\n  ... and {more} more" if more else ""
        message = f"{source}: invalid catalog ({len(issues)} problems):\n{lines}{tail}"
    first = shown[0]
    raise CatalogError(
        message,
        details={"source": source, "field": first.path, "line": first.line},
    )


# --- YAML -----------------------------------------------------------------------------------


def _load_yaml(text: str, *, source: str) -> tuple[yaml.Node | None, object]:
    """Parse one YAML document, refusing duplicate keys, and keep its node tree for lines."""
    # PyYAML loads with the first YAML document read: the built-in catalog needs none of it.
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is not None:
            _reject_duplicate_keys(root, source=source)
        data = loader.construct_document(root) if root is not None else None
    except yaml.MarkedYAMLError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark is not None else None
        problem = exc.problem or str(exc)
        _raise(source, [_Issue("", f"not valid YAML: {problem}", line)])
    except yaml.YAMLError as exc:
        _raise(source, [_Issue("", f"not valid YAML: {exc}", None)])
    finally:
        loader.dispose()
    return root, data


def _reject_duplicate_keys(root: yaml.Node, *, source: str) -> None:
    import yaml  # loaded already: ``root`` came from it

    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = str(key_node.value)
                if key == "<<":
                    continue
                child = _join(path, key)
                if key in seen:
                    _raise(
                        source,
                        [
                            _Issue(
                                child,
                                f"duplicate key {key!r} (first defined on line {seen[key]}); "
                                "each key may appear once",
                                key_node.start_mark.line + 1,
                            )
                        ],
                    )
                seen[key] = key_node.start_mark.line + 1
                stack.append((value_node, child))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(node.value))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _line_of(root: yaml.Node | None, loc: Sequence[int | str]) -> int | None:
    """1-based line of the deepest node on ``loc`` that exists in the YAML tree."""
    if root is None:
        return None
    import yaml  # loaded already: ``root`` came from it

    node = root
    line = node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode) and isinstance(part, str):
            match = next(
                (
                    (k, v)
                    for k, v in node.value
                    if isinstance(k, yaml.ScalarNode) and str(k.value) == part
                ),
                None,
            )
            if match is None:
                break
            node = match[1]
            line = match[0].start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                break
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


# --- pydantic errors -> dotted paths ----------------------------------------------------------


def _issue_from_error(error: ErrorDetails, root: yaml.Node | None) -> _Issue:
    loc: list[int | str] = [part for part in error["loc"] if part != "[key]"]
    ctx = error.get("ctx") or {}
    message = error["msg"]
    if error["type"] == "catalog_field":
        loc.extend(_split_field(str(ctx["field"])))
        message = str(ctx["message"])
    elif error["type"] == "value_error" and "error" in ctx:
        message = str(ctx["error"])
    elif error["type"] == "extra_forbidden":
        allowed = _allowed_fields(loc[:-1])
        message = "unknown field" + (f"; allowed here: {', '.join(allowed)}" if allowed else "")
    elif error["type"] == "missing":
        message = "is required"
    return _Issue(_render_loc(loc), message, _line_of(root, loc))


def _split_field(field: str) -> Iterator[int | str]:
    """Split ``files[2].path`` into ``files``, ``2``, ``path``."""
    for part in field.split("."):
        name, _, rest = part.partition("[")
        if name:
            yield name
        while rest:
            index, _, rest = rest.partition("]")
            yield int(index)
            rest = rest.removeprefix("[")


def _render_loc(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _allowed_fields(loc: Sequence[int | str]) -> list[str]:
    """Field names of the model found by walking ``loc`` down from the document model."""
    target: object = Catalog
    for part in loc:
        if isinstance(target, type) and issubclass(target, BaseModel):
            field = target.model_fields.get(str(part))
            if field is None:
                return []
            target = field.annotation
        else:
            target = _element_type(target)
        target = _strip_optional(target)
    if isinstance(target, type) and issubclass(target, BaseModel):
        return sorted(target.model_fields)
    return []


def _element_type(annotation: object) -> object:
    """The value type of ``dict[K, V]`` or the item type of ``tuple[X, ...]``/``list[X]``."""
    args = typing.get_args(annotation)
    return _strip_optional(args[-1] if typing.get_origin(annotation) is dict else args[0])


def _strip_optional(annotation: object) -> object:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return members[0]
    return annotation
