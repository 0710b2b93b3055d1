"""Commands that plug into ``lmcache``: entry points of the group ``lmcache.commands``.

A package adds a command the way lmcache's own benchmarks and demos do (pyproject.toml)::

    [project.entry-points."lmcache.commands"]
    bench = "lmcache.benchmarks.commands:app"

The target is a ``typer.Typer``; it is imported only when its
command runs or ``lmcache --help`` lists it, so a plugged command costs nothing at start.
A name the command already has keeps its own meaning (the entry point is ignored); a
target that cannot be imported is one line naming the entry point and the error, when
that command is run.
"""

from __future__ import annotations

import importlib.metadata as md
from typing import Any

import typer

from ._util import CLIError, LMCacheGroup

GROUP = "lmcache.commands"


def entry_points() -> dict[str, md.EntryPoint]:
    """The plugged commands by name (the first of a name wins, in the metadata's order)."""
    found: dict[str, md.EntryPoint] = {}
    for ep in md.entry_points(group=GROUP):
        found.setdefault(ep.name, ep)
    return found


def _broken(name: str, ep: md.EntryPoint, exc: BaseException) -> Any:
    where = f"entry point {ep.name} = {ep.value} of the group {GROUP}"
    why = f"{type(exc).__name__}: {exc}"
    app = typer.Typer(name=name, add_completion=False)

    @app.command(help=f"(cannot be loaded: {why})", context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []})
    def fail() -> None:
        raise CLIError(f"command {name!r} cannot be loaded ({where}): {why}")

    return typer.main.get_command(app)


def load(name: str, ep: md.EntryPoint) -> Any:
    """The command of one entry point (its ``typer.Typer`` as a click command), named ``name``."""
    try:
        target = ep.load()
        if not isinstance(target, typer.Typer):
            raise TypeError(f"{ep.value} is a {type(target).__name__}, not a typer.Typer")
        cmd = typer.main.get_command(target)
    except Exception as exc:  # a broken plugin must not take the other commands down
        return _broken(name, ep, exc)
    cmd.name = name
    return cmd


class RootGroup(LMCacheGroup):
    """The root group: lmcache's own commands and those plugged in by entry points (listed
    first, by name); an own command's name is never taken by a plugged one."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._eps: dict[str, md.EntryPoint] | None = None
        self._plugged: dict[str, Any] = {}

    def _entry_points(self) -> dict[str, md.EntryPoint]:
        if self._eps is None:
            self._eps = entry_points()
        return self._eps

    def list_commands(self, ctx: Any) -> list[str]:
        own = super().list_commands(ctx)
        return sorted(n for n in self._entry_points() if n not in own) + own

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        cmd = super().get_command(ctx, cmd_name)
        if cmd is not None:
            return cmd
        ep = self._entry_points().get(cmd_name)
        if ep is None:
            return None
        if cmd_name not in self._plugged:
            self._plugged[cmd_name] = load(cmd_name, ep)
        return self._plugged[cmd_name]
