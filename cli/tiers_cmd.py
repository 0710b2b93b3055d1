"""``lmcache tiers``: each tier's backend, entries, bytes used / capacity, hit rate,
evictions."""

from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from lmcache.units import format_size

from ._target import DEFAULT_TIMEOUT, ConfigOpt, JsonOpt, TimeoutOpt, TokenOpt, UrlOpt, open_target
from ._util import out, print_json

app = typer.Typer(add_completion=False)


def hit_rate(t: dict[str, Any]) -> str:
    r = t.get("hit_rate")
    return "-" if r is None else f"{100 * r:.1f}%"


def used_of(t: dict[str, Any]) -> str:
    cap = t["capacity_bytes"]
    pct = f" ({100 * t['used_bytes'] / cap:.0f}%)" if cap else ""
    return f"{format_size(t['used_bytes'])} / {format_size(cap)}{pct}"


@app.command("tiers")
def tiers(
    url: UrlOpt = None,
    token: TokenOpt = None,
    config: ConfigOpt = None,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT,
    as_json: JsonOpt = False,
) -> None:
    """Show each tier: backend, entries, bytes used / capacity, hit rate, evictions.

    Against a running instance (--url) or offline on the persisted tiers of a config (--config; counters then start at zero).
    """
    with open_target(url, token, config, timeout) as target:
        rows = target.tiers()
    if as_json:
        print_json(rows)
        return
    o = out()
    if not rows:
        o.print("No tiers.")
        return
    t = Table()
    t.add_column("tier", no_wrap=True)
    t.add_column("backend", no_wrap=True)
    t.add_column("entries", justify="right")
    t.add_column("used / capacity", justify="right", no_wrap=True)
    t.add_column("hit rate", justify="right")
    t.add_column("hits", justify="right")
    t.add_column("misses", justify="right")
    t.add_column("evictions", justify="right")
    t.add_column("pinned", justify="right")
    for r in rows:
        t.add_row(
            r["name"], r["backend"], str(r["entries"]), used_of(r), hit_rate(r), str(r["hits"]),
            str(r["misses"]), str(r["evictions"]), str(r.get("pinned", 0)),
        )
    o.print(t)
    for r in rows:  # a store that did not answer: its zeros mean "unknown", say so
        if r.get("available") is False:
            o.print(f"tier {r['name']}: unreachable ({r.get('last_error') or 'no answer'}); its numbers are not known")
