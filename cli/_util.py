"""Shared pieces of the ``lmcache`` command: consoles, error handling, option parsing.

Data goes to stdout (``out``), diagnostics and progress to stderr (``err``); those two and
``print_json``/``size_option`` live in :mod:`lmcache.cli.console`, shared with the benchmarks and demos. Errors that
lmcache raises on purpose (:class:`lmcache.errors.LMCacheError`), usage errors and
operating-system errors print one line and exit non-zero; ``LMCACHE_DEBUG=1`` shows the
traceback instead.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Sequence

import typer
from typer.core import TyperGroup

from .console import err, need_pyplot, out, print_json, pyplot, size_option  # noqa: F401 (shared)
from lmcache.errors import LMCacheError
from lmcache.redact import redact_text
from lmcache.units import parse_duration

PROG = "lmcache"


def debug_enabled() -> bool:
    return os.environ.get("LMCACHE_DEBUG", "").lower() in ("1", "true", "yes")


def error_line(message: str) -> None:
    """One line on stderr; a credential in it (a URL's password, an option's token) reads ``***``."""
    sys.stderr.write(f"{PROG}: error: {' '.join(redact_text(str(message)).split())}\n")
    sys.stderr.flush()


class CLIError(LMCacheError):
    """A known problem the command reports in one line (exit code 1)."""


def note(message: str) -> None:
    """A diagnostic line on stderr (``lmcache: message``)."""
    sys.stderr.write(f"{PROG}: {message}\n")
    sys.stderr.flush()


def stdin_is_tty() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (AttributeError, ValueError):  # closed or replaced stdin
        return False


def confirm(question: str, *, yes: bool, what: str) -> None:
    """Ask before something destructive unless ``yes``; with no terminal to ask on,
    refuse with a one-line error that names ``--yes``. ``what`` completes "refusing to
    ..." (e.g. "evict 12 entries")."""
    if yes:
        return
    if not stdin_is_tty():
        raise CLIError(f"refusing to {what} without confirmation: stdin is not a terminal; pass --yes")
    if not typer.confirm(question, default=False, err=True):
        raise typer.Abort()


def progress(*, transient: bool = True):
    """A rich progress bar on stderr, drawn only when stderr is a terminal."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err(),
        transient=transient,
        disable=not sys.stderr.isatty(),
    )


def duration_option(value: str, option: str) -> float:
    """Parse a ``--older-than``-style value such as ``"1h"`` or ``"90s"``."""
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=f"'{option}'") from None


class LMCacheGroup(TyperGroup):
    """The root command group: turns known errors into one line on stderr."""

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.TyperException as exc:  # click's usage errors and friends
            if type(exc).__name__ == "NoArgsIsHelpError":
                msg = exc.format_message()
                if msg.strip():
                    sys.stderr.write(msg.rstrip() + "\n")
                sys.exit(exc.exit_code)
            if debug_enabled():
                raise
            msg = exc.format_message()
            ctx = getattr(exc, "ctx", None)
            if ctx is not None:
                msg = f"{msg} (see '{ctx.command_path} --help')"
            error_line(msg)
            sys.exit(exc.exit_code)
        except typer.Abort:
            error_line("aborted")
            sys.exit(1)
        except LMCacheError as exc:
            if debug_enabled():
                raise
            error_line(str(exc))
            sys.exit(1)
        except OSError as exc:
            if debug_enabled():
                raise
            error_line(str(exc))
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)
