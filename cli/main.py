"""The ``lmcache`` command.

One module per command group, joined here with ``add_typer``. Data goes to stdout and
diagnostics to stderr; known errors print one line (``lmcache: error: ...``) and exit
non-zero, with the traceback only when ``LMCACHE_DEBUG=1``.
"""

from __future__ import annotations

import platform
from typing import Annotated

import typer

from . import bench, demo, plugins_cmd
from ._util import LMCacheGroup, print_json

app = typer.Typer(
    cls=LMCacheGroup,
    name="lmcache",
    help="lmcache: a KV-cache layer for LLM inference.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(demo.app)
app.add_typer(bench.app, name="bench")
app.add_typer(plugins_cmd.app)


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
