"""The ``lmcache`` command.

One module per command group, joined here with ``add_typer``; more commands plug in as
entry points of the group ``lmcache.commands`` (:mod:`lmcache.cli.plugged`): ``bench``
(:mod:`lmcache.benchmarks.commands`) and ``demo`` (:mod:`lmcache.demos.commands`) among
them, so that the command imports neither the benchmarks nor the demos. Data goes to
stdout and diagnostics to stderr; known errors print one line (``lmcache: error: ...``)
and exit non-zero, with the traceback only when ``LMCACHE_DEBUG=1``.
"""

from __future__ import annotations

import platform
from typing import Annotated

import typer

from . import (compress_cmd, config_cmd, controller_cmd, dashboard_cmd, evict_cmd, ls_cmd, pin_cmd, plugin_cmd,
               plugins_cmd, server_cmd, stats_cmd, tiers_cmd)
from ._util import print_json
from .plugged import RootGroup

app = typer.Typer(
    cls=RootGroup,
    name="lmcache",
    help="lmcache: a KV-cache layer for LLM inference.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)
app.add_typer(plugins_cmd.app)
app.add_typer(plugin_cmd.app, name="plugin")
app.add_typer(tiers_cmd.app)
app.add_typer(ls_cmd.app)
app.add_typer(evict_cmd.app)
app.add_typer(pin_cmd.app)
app.add_typer(stats_cmd.app)
app.add_typer(compress_cmd.app)
app.add_typer(config_cmd.app, name="config")
app.command("server")(server_cmd.server_cmd)
app.add_typer(controller_cmd.app)
app.add_typer(dashboard_cmd.app)


def _print_version(value: bool) -> None:
    if value:
        from lmcache import __version__

        typer.echo(f"lmcache {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool,
        typer.Option("--version", "-V", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """lmcache: a KV-cache layer for LLM inference."""


@app.command("version")
def version(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON object.")] = False,
) -> None:
    """Print the version of lmcache (and of Python)."""
    from lmcache import __version__

    if as_json:
        print_json({"lmcache": __version__, "python": platform.python_version()})
    else:
        typer.echo(f"lmcache {__version__}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
