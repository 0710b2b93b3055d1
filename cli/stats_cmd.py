"""``lmcache stats``: counters of every tier, the memory pool and the write queue."""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated, Any

import typer
from rich.table import Table

from lmcache.units import format_size

from ._target import DEFAULT_TIMEOUT, ConfigOpt, JsonOpt, TimeoutOpt, TokenOpt, UrlOpt, open_target
from ._util import note, out, print_json
from .tiers_cmd import hit_rate

app = typer.Typer(add_completion=False)


def _rate(now: dict[str, Any], before: dict[str, Any] | None, field: str, dt: float) -> float | None:
    if before is None or dt <= 0:
        return None
    return (now[field] - before[field]) / dt


def render(stats: dict[str, Any], before: dict[str, Any] | None = None, dt: float = 0.0) -> None:
    o = out()
    t = Table(title=None)
    t.add_column("tier", no_wrap=True)
    for col in ("hits", "misses", "hit rate", "bytes in", "bytes out", "evictions", "entries", "used"):
        t.add_column(col, justify="right", no_wrap=True)
    if before is not None:
        t.add_column("hits/s", justify="right")
        t.add_column("in/s", justify="right")
        t.add_column("out/s", justify="right")
    for name, s in stats["tiers"].items():
        row = [
            name, str(s["hits"]), str(s["misses"]), hit_rate(s), format_size(s["bytes_in"]),
            format_size(s["bytes_out"]), str(s["evictions"]), str(s["entries"]), format_size(s["used_bytes"]),
        ]
        if before is not None:
            prev = before["tiers"].get(name)
            rates = [_rate(s, prev, f, dt) for f in ("hits", "bytes_in", "bytes_out")] if prev else [None] * 3
            row += [
                "-" if rates[0] is None else f"{rates[0]:.1f}",
                "-" if rates[1] is None else f"{format_size(rates[1])}/s",
                "-" if rates[2] is None else f"{format_size(rates[2])}/s",
            ]
        t.add_row(*row)
    o.print(t)
    pool, h = stats.get("pool"), stats.get("hierarchy")
    if pool:
        o.print(f"memory pool: {format_size(pool['used'])} of {format_size(pool['capacity'])} in use ({pool['live']} objects)")
    if h:
        o.print(
            f"write queue: {h.get('pending_writes', 0)} pending, {h['dropped_writes']} dropped; "
            f"promotions: {h['promotions']}; chunks skipped for lack of memory: {h['skipped_no_memory']}"
        )


@app.command("stats")
def stats(
    watch: Annotated[
        float | None,
        typer.Option("--watch", "-w", min=0.05, metavar="SECONDS", help="Print again every SECONDS (Ctrl-C stops).",
                     show_default=False),
    ] = None,
    count: Annotated[
        int | None, typer.Option("--count", min=1, help="With --watch: stop after this many prints.", show_default=False)
    ] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    config: ConfigOpt = None,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT,
    as_json: JsonOpt = False,
) -> None:
    """Show hits, misses, hit rate, bytes in/out and evictions per tier.

    Also the memory pool and the write queue of a running instance. With --watch, print again every SECONDS, with per-second rates; with --json, one JSON object per line. Offline (--config), counters start at zero: only usage is meaningful.
    """
    if count is not None and watch is None:
        raise typer.BadParameter("--count needs --watch", param_hint="'--count'")
    with open_target(url, token, config, timeout) as target:
        if not getattr(target, "live", True) and watch is not None:
            note("offline: counters of tiers opened from a config stay at zero")
        before: dict[str, Any] | None = None
        t_before = 0.0
        n = 0
        try:
            while True:
                snap = target.stats()
                now = time.monotonic()
                if as_json:
                    if watch is None:
                        print_json(snap)
                    else:
                        sys.stdout.write(json.dumps({"time": time.time(), **snap}) + "\n")
                        sys.stdout.flush()
                else:
                    if watch is not None:
                        o = out()
                        if o.is_terminal:
                            o.clear()
                        o.print(time.strftime("%H:%M:%S"))
                    render(snap, before, now - t_before)
                n += 1
                if watch is None or (count is not None and n >= count):
                    break
                before, t_before = snap, now
                time.sleep(watch)
        except KeyboardInterrupt:
            return
