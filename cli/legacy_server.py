"""``lmcache_server HOST PORT [OPTIONS]``: the cache server under the command name and
positional arguments that LMCache's deployments use (the vLLM production stack's Helm chart
and operator run ``/opt/venv/bin/lmcache_server 0.0.0.0 <port>``).

It runs our ``lmcache server --host HOST --port PORT [OPTIONS]``, which speaks lmcache's
wire protocol (the ``lm://`` backend of this package), not LMCache's ``lmcache.v1.protocol``:
engines that point ``LMCACHE_REMOTE_URL=lm://...`` at it must run this lmcache too, and
the image puts our own probe (:mod:`lmcache.cli.health_probe`) at the path of LMCache's
``examples/kubernetes/health_probe.py``, which the production stack runs.
"""

from __future__ import annotations

import sys
from typing import Sequence

USAGE = "usage: lmcache_server HOST PORT [lmcache server options, e.g. --capacity 8GiB]"


def translate(argv: Sequence[str]) -> list[str]:
    """The ``lmcache`` arguments for ``lmcache_server``'s: ``HOST PORT [OPTIONS]`` becomes
    ``server --host HOST --port PORT [OPTIONS]``. :class:`ValueError` (its message one line,
    naming the problem and the usage) if HOST or PORT is missing or PORT is not a port."""
    if len(argv) < 2 or argv[0].startswith("-") or argv[1].startswith("-"):
        raise ValueError(f"expected HOST and PORT; {USAGE}")
    host, port = argv[0], argv[1]
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"PORT must be a number from 0 to 65535, not {port!r}; {USAGE}")
    return ["server", "--host", host, "--port", port, *argv[2:]]


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``lmcache_server`` console script (exit code 2 on bad arguments)."""
    argv = sys.argv[1:] if argv is None else argv
    if list(argv[:1]) in (["-h"], ["--help"]):
        sys.stdout.write(f"{USAGE}\nRuns `lmcache server --host HOST --port PORT [OPTIONS]`; its options: "
                         "`lmcache server --help`.\n")
        return
    try:
        args = translate(argv)
    except ValueError as exc:
        sys.stderr.write(f"lmcache_server: error: {exc}\n")
        raise SystemExit(2) from None
    from .main import app

    app(args=args, prog_name="lmcache_server")


if __name__ == "__main__":
    main()
