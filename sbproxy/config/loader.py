"""Load ``sb.yml``: YAML with line tracking, ``${VAR}`` interpolation, validation, compilation.

This is the one place configuration enters the program; everything downstream receives a
:class:`~sbproxy.config.compile.CompiledConfig`.

Interpolation applies to string values (never keys): ``${NAME}`` is replaced by the
environment variable ``NAME``; ``${NAME:-fallback}`` uses ``fallback`` when ``NAME`` is unset
or empty (shell semantics); ``$${`` writes a literal ``${``. An unset variable without a
fallback is an error naming the variable and the dotted path that used it. Values of
variables are never echoed in errors, since they are often secrets.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel as _PydanticModel
from pydantic import ValidationError

from sbproxy.config._rules import RuleViolation, dotted
from sbproxy.config.compile import CompiledConfig, compile_config
from sbproxy.config.document import SbConfig
from sbproxy.config.journal_url import INVALID_JOURNAL_URL
from sbproxy.errors import ConfigError, ConfigIssue

__all__ = ["load_config", "load_config_text", "validation_issues"]

Loc = tuple[str | int, ...]

_VAR_RE = re.compile(r"\$\$\{|\$\{([^}]*)\}")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A configuration is a few KiB; refuse anything absurd before parsing it.
_MAX_CONFIG_BYTES = 4 * 1024 * 1024


class _Document:
    """Parsed YAML plus the line of every node, keyed by its location."""

    def __init__(self, data: Any, lines: dict[Loc, int]) -> None:
        self.data = data
        self.lines = lines

    def line_of(self, loc: Loc) -> int | None:
        # Missing fields have no line of their own: report their nearest present ancestor.
        for end in range(len(loc), -1, -1):
            line = self.lines.get(loc[:end])
            if line is not None:
                return line
        return None


def _parse_yaml(text: str, source: str) -> _Document:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        line = mark.line + 1 if mark is not None else None
        raise ConfigError(
            [ConfigIssue("", f"not valid YAML: {problem}", line=line)], source=source
        ) from None
    if root is None:  # whitespace and comments only
        return _Document(None, {})
    issues: list[ConfigIssue] = []
    lines: dict[Loc, int] = {}
    data = _construct(root, (), lines, issues)
    if issues:
        raise ConfigError(issues, source=source)
    return _Document(data, lines)


def _construct(node: yaml.Node, loc: Loc, lines: dict[Loc, int], issues: list[ConfigIssue]) -> Any:
    lines[loc] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                issues.append(
                    ConfigIssue(
                        dotted(loc),
                        "YAML merge keys (<<) are not supported",
                        line=key_node.start_mark.line + 1,
                    )
                )
                continue
            key = yaml.SafeLoader(  # a scalar key, resolved with YAML's own rules
                ""
            ).construct_object(key_node, deep=True)
            if not isinstance(key, str | int):
                issues.append(
                    ConfigIssue(
                        dotted(loc),
                        "mapping keys must be strings",
                        line=key_node.start_mark.line + 1,
                    )
                )
                continue
            key = str(key)
            if key in out:
                issues.append(
                    ConfigIssue(
                        dotted((*loc, key)),
                        f"duplicate key {key!r}; each key may appear once",
                        line=key_node.start_mark.line + 1,
                    )
                )
                continue
            out[key] = _construct(value_node, (*loc, key), lines, issues)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(item, (*loc, i), lines, issues) for i, item in enumerate(node.value)]
    return yaml.SafeLoader("").construct_object(node, deep=True)


def _interpolate(
    value: Any, loc: Loc, env: Mapping[str, str], issues: list[ConfigIssue], doc: _Document
) -> Any:
    if isinstance(value, dict):
        return {k: _interpolate(v, (*loc, k), env, issues, doc) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, (*loc, i), env, issues, doc) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$${":
            return "${"
        expression = match.group(1)
        name, has_default, fallback = expression.partition(":-")
        if not _NAME_RE.match(name):
            issues.append(
                ConfigIssue(
                    dotted(loc),
                    f"${{{expression}}} is not a valid reference; write ${{NAME}} or "
                    "${NAME:-default} with NAME of letters, digits and underscores",
                    line=doc.line_of(loc),
                )
            )
            return ""
        current = env.get(name)
        if current:
            return current
        if has_default:
            return fallback
        if current is None:
            issues.append(
                ConfigIssue(
                    dotted(loc),
                    f"environment variable {name} is not set; export it, or write "
                    f"${{{name}:-default}} to give a fallback",
                    line=doc.line_of(loc),
                )
            )
        return ""

    return _VAR_RE.sub(replace, value)


def _model_at(root: type[_PydanticModel], loc: Loc) -> type[_PydanticModel] | None:
    """The pydantic model class found by walking ``loc`` from ``root`` (for error hints)."""
    model: Any = root
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        fields = getattr(model, "model_fields", None)
        if fields is None:
            return None
        info = fields.get(part)
        if info is None:
            # A dict key (deployment id, origin host): stay on the dict's value model.
            continue
        model = _inner_model(info.annotation)
    return model if isinstance(model, type) and issubclass(model, _PydanticModel) else None


def _inner_model(annotation: Any) -> Any:
    args = getattr(annotation, "__args__", None)
    if isinstance(annotation, type) and issubclass(annotation, _PydanticModel):
        return annotation
    for arg in args or ():
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def validation_issues(
    exc: ValidationError, *, root: type[_PydanticModel] = SbConfig, doc: _Document | None = None
) -> list[ConfigIssue]:
    """Turn a pydantic error into one :class:`ConfigIssue` per problem, with dotted paths."""
    issues: list[ConfigIssue] = []
    for error in exc.errors():
        loc: Loc = tuple(p for p in error["loc"] if p != "[key]")
        ctx = error.get("ctx") or {}
        cause = ctx.get("error")
        if isinstance(cause, RuleViolation):
            for sub, message in cause.problems:
                full = (*loc, *sub)
                issues.append(
                    ConfigIssue(dotted(full), message, line=doc.line_of(full) if doc else None)
                )
            continue
        kind = error["type"]
        message = error["msg"]
        if message.startswith("Value error, "):
            message = message[len("Value error, ") :]
        elif message.startswith("Assertion failed, "):
            message = message[len("Assertion failed, ") :]
        if kind == "extra_forbidden":
            parent = _model_at(root, loc[:-1])
            allowed = ", ".join(parent.model_fields) if parent else ""
            message = f"unknown field {loc[-1]!r}" + (
                f"; allowed fields: {allowed}" if allowed else ""
            )
        elif kind == "missing":
            message = "required field is missing"
        elif kind == "string_pattern_mismatch" and "[key]" in error["loc"]:
            message = f"invalid id {loc[-1]!r}: use 1-128 letters, digits, '.', '_' or '-'"
        elif kind == "string_pattern_mismatch":
            message = "must be 1-128 letters, digits, '.', '_' or '-'"
        issues.append(ConfigIssue(dotted(loc), message, line=doc.line_of(loc) if doc else None))
    return issues


def load_config_text(
    text: str,
    *,
    source: str = "<config>",
    base_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
    path: Path | None = None,
) -> CompiledConfig:
    """Parse, interpolate, validate and compile configuration text.

    Args:
        text: YAML document.
        source: Name used in messages (usually the file path).
        base_dir: Directory that relative paths (catalog_file, store_path, tls files) resolve
            against; ``None`` leaves them as written.
        env: Environment for ``${VAR}``; defaults to ``os.environ``.
        path: File the text was read from, recorded in the result.

    Raises:
        ConfigError: ``invalid_config`` with every problem found, each with its dotted path
            and, where known, its line; ``empty_config`` for a document with nothing in it.
    """
    doc = _parse_yaml(text, source)
    if doc.data is None:  # nothing but whitespace or comments
        raise ConfigError(
            [
                ConfigIssue(
                    "",
                    "the file is empty: declare proxy: (listeners, model_host) and origins: "
                    "(see examples/ or `sbproxy config schema`)",
                    line=1,
                )
            ],
            source=source,
            code="empty_config",
        )
    if not isinstance(doc.data, dict):
        raise ConfigError(
            [ConfigIssue("", "the top level must be a mapping (proxy:, origins:)", line=1)],
            source=source,
        )
    issues: list[ConfigIssue] = []
    data = _interpolate(doc.data, (), os.environ if env is None else env, issues, doc)
    if issues:
        raise ConfigError(issues, source=source)
    context = {"base_dir": str(base_dir)} if base_dir is not None else None
    try:
        config = SbConfig.model_validate(data, context=context)
    except ValidationError as exc:
        # A journal URL that is the only problem gets its own code (a script tells it from
        # the rest); with others beside it, the file is just invalid.
        kinds = {error["type"] for error in exc.errors()}
        code = INVALID_JOURNAL_URL if kinds == {INVALID_JOURNAL_URL} else None
        raise ConfigError(validation_issues(exc, doc=doc), source=source, code=code) from None
    try:
        return compile_config(config, source=path)
    except ConfigError as exc:
        located = [
            replace(issue, line=_line_for_path(doc, issue.path)) if issue.line is None else issue
            for issue in exc.issues
        ]
        raise ConfigError(located, source=source) from None


def _line_for_path(doc: _Document, path: str) -> int | None:
    for loc, line in sorted(doc.lines.items(), key=lambda kv: -len(kv[0])):
        if dotted(loc) == path:
            return line
    return None


def load_config(path: str | Path, *, env: Mapping[str, str] | None = None) -> CompiledConfig:
    """Load ``sb.yml`` from disk (see :func:`load_config_text`), through its path (a symlink is
    followed, as a Kubernetes ConfigMap mount needs), read once: the result's
    ``content_sha256`` is the digest of exactly the bytes it was compiled from.

    Raises:
        ConfigError: ``invalid_config`` when the file is missing, unreadable, too large, not
            UTF-8 or invalid.
    """
    file = Path(path)
    source = str(file)
    try:
        size = file.stat().st_size
        if size > _MAX_CONFIG_BYTES:
            raise ConfigError(
                [ConfigIssue("", f"file is {size} bytes; the limit is {_MAX_CONFIG_BYTES}")],
                source=source,
            )
        data = file.read_bytes()
        # Universal newlines, as read_text() gives them.
        text = data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except FileNotFoundError:
        raise ConfigError([ConfigIssue("", "file not found")], source=source) from None
    except IsADirectoryError:
        raise ConfigError([ConfigIssue("", "is a directory, not a file")], source=source) from None
    except PermissionError:
        raise ConfigError([ConfigIssue("", "permission denied")], source=source) from None
    except UnicodeDecodeError:
        raise ConfigError([ConfigIssue("", "is not UTF-8 text")], source=source) from None
    compiled = load_config_text(
        # Relative paths resolve against the directory the path names, not where its symlinks
        # lead: in a ConfigMap mount (sb.yml -> ..data/sb.yml -> ..<timestamp>/sb.yml) the
        # siblings are linked the same way, and ..<timestamp> is replaced at every update.
        text,
        source=source,
        base_dir=Path(os.path.abspath(file)).parent,  # noqa: PTH100 - keep symlinks unresolved
        env=env,
        path=file,
    )
    return replace(compiled, content_sha256=hashlib.sha256(data).hexdigest())
