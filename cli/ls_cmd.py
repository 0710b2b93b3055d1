"""``lmcache ls``: the entries of a tier (or of every tier)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from lmcache.units import format_duration, format_size

from ._target import DEFAULT_TIMEOUT, ConfigOpt, JsonOpt, TierOpt, TimeoutOpt, TokenOpt, UrlOpt, open_target
from ._util import note, out, print_json, progress

app = typer.Typer(add_completion=False)

PAGE = 1000


def fetch_entries(target: Any, tier: str | None, namespace: str | None, model: str | None,
                  limit: int | None) -> tuple[list[dict[str, Any]], int]:
    """Up to ``limit`` entries (all if ``None``), page by page; and how many match."""
    rows: list[dict[str, Any]] = []
    offset = 0
    total = 0
    with progress() as bar:
        task = None
        while True:
            want = PAGE if limit is None else min(PAGE, limit - len(rows))
            if want <= 0:
                break
            page = target.keys(tier, namespace=namespace, model=model, offset=offset, limit=want)
            total = page["total"]
            if task is None:
                task = bar.add_task("listing entries", total=total if limit is None else min(total, limit))
            rows.extend(page["entries"])
            bar.update(task, completed=len(rows))
            if page["next_offset"] is None or not page["entries"]:
                break
            offset = page["next_offset"]
    return rows, total


@app.command("ls")
def ls(
    tier: TierOpt = None,
    namespace: Annotated[str | None, typer.Option("--namespace", "-n", help="Only keys of this namespace.")] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Only keys of this model.")] = None,
    limit: Annotated[int, typer.Option("--limit", "-l", min=0, help="Show at most this many entries (0: all).")] = 100,
    url: UrlOpt = None,
    token: TokenOpt = None,
    config: ConfigOpt = None,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT,
    as_json: JsonOpt = False,
) -> None:
    """List cached entries: key, tier, size, codec, age, pinned.

    Keys are the canonical strings lmc1:<namespace>:<model>:<kv signature>:<hash>; they are listed per tier, sorted. Give a key to 'lmcache evict --key' or 'lmcache pin'.
    """
    with open_target(url, token, config, timeout, tier=tier) as target:
        rows, total = fetch_entries(target, tier, namespace, model, None if limit == 0 else limit)
    if len(rows) < total:
        note(f"showing {len(rows)} of {total} entries; --limit 0 shows all")
    if as_json:
        print_json(rows)
        return
    o = out()
    if not rows:
        o.print("No entries.")
        return
    t = Table()
    t.add_column("key", overflow="fold")
    t.add_column("tier", no_wrap=True)
    t.add_column("size", justify="right", no_wrap=True)
    t.add_column("codec", no_wrap=True)
    t.add_column("age", justify="right", no_wrap=True)
    t.add_column("pinned", no_wrap=True)
    for r in rows:
        age = "-" if r["age_s"] is None else format_duration(r["age_s"])
        t.add_row(r["key"], r["tier"], format_size(r["size"]), r["codec"] or "-", age, "yes" if r["pinned"] else "")
    o.print(t)
