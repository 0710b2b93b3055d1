"""The consoles and option parsers of the ``lmcache`` command, shared with the benchmarks
and demos that plug into it (:mod:`lmcache.benchmarks`, :mod:`lmcache.demos`): data goes
to :func:`out` (stdout), progress and diagnostics to :func:`err` (stderr), results through
:func:`emit` (a table, ``--json`` or ``--plot``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import typer
from rich.console import Console

from lmcache.errors import LMCacheError
from lmcache.units import parse_size


# --------------------------------------------------------------------------- output


def _console(stderr: bool) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    # Rich falls back to 80 columns when not writing to a terminal; the tables are wider.
    width = None if stream.isatty() or os.environ.get("COLUMNS") else 160
    return Console(file=stream, stderr=stderr, width=width, highlight=False)


def out() -> Console:
    """A console on the current stdout (built per call so test runners can swap it)."""
    return _console(stderr=False)


def err() -> Console:
    return _console(stderr=True)


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, for the benches' ``--plot``; a
    clear error when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise LMCacheError("--plot needs matplotlib; install it with: pip install 'lmcache[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, dpi: int | None = None) -> None:
    """The one tail of every plot: lay out, write ``path`` (its folder made), close."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, **({"dpi": dpi} if dpi else {}))
    pyplot().close(fig)


def need_pyplot(plot_path: Any) -> None:
    """Fail before any work when ``--plot`` is given and matplotlib is missing."""
    if plot_path is not None:
        pyplot()


def print_json(data: Any) -> None:
    """Machine-readable output: plain JSON on stdout, nothing else."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


def emit(data: dict[str, Any], as_json: bool, table: Callable[[dict[str, Any]], None],
         plot_path: Path | None = None, plot: Callable[[dict[str, Any], Path], None] | None = None) -> None:
    """The one tail of every benchmark: draw ``plot_path`` (recorded as ``data["plot"]``),
    then print ``data`` as JSON or as ``table(data)`` (and where the plot went)."""
    drawn = plot_path is not None and plot is not None
    if drawn:
        plot(data, plot_path)
        data["plot"] = str(plot_path)
    if as_json:
        print_json(data)
    else:
        table(data)
        if drawn:
            out().print(f"Plot written to {plot_path}.")


# --------------------------------------------------------------------------- options


def size_option(value: str, option: str, auto: bool = True) -> int | None:
    """Parse a ``--*-capacity`` value: ``"auto"`` (``None``) or a size like ``"512MiB"``."""
    if auto and value.strip().lower() == "auto":
        return None
    try:
        n = parse_size(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=f"'{option}'") from None
    if n <= 0:
        raise typer.BadParameter("must be larger than 0", param_hint=f"'{option}'")
    return n


def csv_option(value: str, hint: str, choices: Any = None, conv: Callable[[str], Any] = str) -> list[Any]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    try:
        got = [conv(v) for v in items]
    except ValueError:
        raise typer.BadParameter(f"not a comma-separated list: {value!r}", param_hint=hint) from None
    if not got:
        raise typer.BadParameter("give at least one", param_hint=hint)
    for v in got:
        if choices is not None and v not in choices:
            raise typer.BadParameter(f"{v!r} is not one of {', '.join(choices)}", param_hint=hint)
        if conv is int and not 1 <= v <= 64:
            raise typer.BadParameter(f"must be between 1 and 64, got {v}", param_hint=hint)
    return got
