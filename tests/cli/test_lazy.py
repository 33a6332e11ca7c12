"""The lazy command tree: verbs import on use, and collection resumes before any verb runs."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import click
import pytest

from sbproxy.cli import cli
from sbproxy.cli._lazy import LazyGroup, defer_collection, resume_collection


@pytest.fixture
def deferred() -> Iterator[None]:
    """Collection paused as the console script pauses it; restored (and unfrozen) after."""
    was_enabled = gc.isenabled()
    defer_collection()
    try:
        yield
    finally:
        resume_collection()
        gc.unfreeze()
        if not was_enabled:
            gc.disable()


def _leaf_paths(group: click.Group, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None, name
        if isinstance(command, LazyGroup):
            yield from _leaf_paths(command, (*prefix, name))
        else:
            yield (*prefix, name)


def _resolve(path: tuple[str, ...]) -> click.Command:
    group: click.Command = cli
    ctx = click.Context(cli)
    for name in path:
        assert isinstance(group, click.Group)
        _, command, _ = group.resolve_command(ctx, [name])
        assert command is not None
        ctx = click.Context(command, parent=ctx)
        group = command
    return group


def test_every_verb_resumes_collection_once_resolved(deferred: None) -> None:
    paths = list(_leaf_paths(cli))
    assert ("models", "pull") in paths and ("serve",) in paths
    for path in paths:
        defer_collection()
        assert not gc.isenabled()
        _resolve(path)
        assert gc.isenabled(), f"sbproxy {' '.join(path)} would run with collection paused"


def test_resume_freezes_what_the_imports_built(deferred: None) -> None:
    before = gc.get_freeze_count()
    _resolve(("models", "pull"))
    assert gc.isenabled()
    assert gc.get_freeze_count() > before


def test_resolving_without_the_console_script_leaves_collection_alone() -> None:
    assert gc.isenabled()
    before = gc.get_freeze_count()
    _resolve(("models", "pull"))
    _resolve(("jobs",))
    assert gc.isenabled()
    assert gc.get_freeze_count() == before


def test_bare_models_group_resumes_before_listing(
    deferred: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sbproxy.cli import models_cmd

    seen: list[bool] = []
    monkeypatch.setattr(
        models_cmd.list_command, "callback", lambda **_: seen.append(gc.isenabled())
    )
    cli.main(["models"], standalone_mode=False)
    assert seen == [True]


GROUPS = ["sbproxy", "sbproxy models", "sbproxy jobs"]


def _lazy_groups() -> list[tuple[str, LazyGroup]]:
    from sbproxy.cli.jobs_cmd import jobs_group
    from sbproxy.cli.models_cmd import models_group

    groups = [("sbproxy", cli), ("sbproxy models", models_group), ("sbproxy jobs", jobs_group)]
    assert all(isinstance(group, LazyGroup) for _, group in groups)
    return groups


@pytest.mark.parametrize("path", GROUPS)
def test_each_listed_short_help_is_the_commands_own(path: str) -> None:
    (group,) = [group for name, group in _lazy_groups() if name == path]
    ctx = click.Context(group)
    for name, lazy in group.lazy_commands.items():
        command = group.get_command(ctx, name)
        assert command is not None, name
        # Unshortened: the first sentence of the command's help, which click shortens.
        assert lazy.short_help == command.get_short_help_str(limit=10_000), name


@pytest.mark.parametrize("width", [40, 80, 120])
@pytest.mark.parametrize("path", GROUPS)
def test_help_lists_verbs_as_if_each_were_imported(path: str, width: int) -> None:
    (group,) = [group for name, group in _lazy_groups() if name == path]
    unloaded = LazyGroup(name=group.name, lazy_commands=group.lazy_commands)
    eager = click.Group(name=group.name)
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None
        eager.add_command(command, name)
        if name not in group.lazy_commands:  # defined in the group's own module
            unloaded.add_command(command, name)

    def commands_section(of: click.Group) -> str:
        formatter = click.HelpFormatter(width=width)
        of.format_commands(click.Context(of), formatter)
        return formatter.getvalue()

    listed = commands_section(unloaded)
    assert listed == commands_section(eager)
    assert set(unloaded.commands) == set(group.commands) - set(group.lazy_commands)
