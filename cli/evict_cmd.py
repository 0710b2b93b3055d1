"""``lmcache evict``: remove entries by key, by bytes to free, by age, or all."""

from __future__ import annotations

from collections import Counter
from typing import Annotated, Any

import typer
from rich.table import Table

from lmcache.units import format_size

from ._target import DEFAULT_TIMEOUT, ConfigOpt, JsonOpt, TierOpt, TimeoutOpt, TokenOpt, UrlOpt, open_target
from ._util import confirm, duration_option, note, out, print_json, progress, size_option

app = typer.Typer(add_completion=False)

BATCH = 500


def _summary(entries: list[dict[str, Any]]) -> str:
    n = len(entries)
    size = sum(e["size"] for e in entries)
    tiers = sorted({e["tier"] for e in entries})
    where = f" from tier{'s' if len(tiers) > 1 else ''} {', '.join(tiers)}" if tiers else ""
    return f"{n} entr{'y' if n == 1 else 'ies'} ({format_size(size)}){where}"


def _report_skipped(skipped: list[dict[str, Any]]) -> None:
    if not skipped:
        return
    reasons = Counter(s["reason"] for s in skipped)
    parts = ", ".join(f"{n} {why}" for why, n in reasons.most_common())
    note(f"skipped {len(skipped)}: {parts}")


def _table(entries: list[dict[str, Any]]) -> Table:
    t = Table()
    t.add_column("key", overflow="fold")
    t.add_column("tier", no_wrap=True)
    t.add_column("size", justify="right", no_wrap=True)
    for e in entries:
        t.add_row(e["key"], e["tier"], format_size(e["size"]))
    return t


@app.command("evict")
def evict(
    tier: TierOpt = None,
    key: Annotated[
        list[str] | None, typer.Option("--key", "-k", metavar="KEY", help="Evict this key (repeatable).")
    ] = None,
    nbytes: Annotated[
        str | None,
        typer.Option("--bytes", "-b", metavar="SIZE", help="Free this much (e.g. 2GiB) from --tier, in its eviction policy's order."),
    ] = None,
    older_than: Annotated[
        str | None, typer.Option("--older-than", metavar="AGE", help="Evict entries stored longer ago than this (e.g. 1h, 2d).")
    ] = None,
    all_: Annotated[bool, typer.Option("--all", "-a", help="Evict every entry (of --tier, if given).")] = False,
    namespace: Annotated[str | None, typer.Option("--namespace", "-n", help="Only keys of this namespace.")] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Only keys of this model.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would be evicted; change nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
    config: ConfigOpt = None,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT,
    as_json: JsonOpt = False,
) -> None:
    """Evict entries: by --key, by --bytes to free, by --older-than, or --all.

    --bytes and --older-than combine (free up to SIZE among entries older than AGE); --namespace and --model narrow --bytes, --older-than and --all. Pinned entries and entries a reader holds are never evicted (they are reported as skipped). Asks before evicting unless --yes.
    """
    if key and (nbytes or older_than or all_ or namespace or model):
        raise typer.BadParameter("--key cannot be combined with --bytes, --older-than, --all, --namespace or --model",
                                 param_hint="'--key'")
    if all_ and (nbytes or older_than):
        raise typer.BadParameter("--all cannot be combined with --bytes or --older-than", param_hint="'--all'")
    if not (key or nbytes or older_than or all_):
        raise typer.BadParameter("say what to evict: --key, --bytes, --older-than or --all",
                                 param_hint="'--key' / '--bytes' / '--older-than' / '--all'")
    n = size_option(nbytes, "--bytes", auto=False) if nbytes is not None else None
    age = duration_option(older_than, "--older-than") if older_than is not None else None
    if key:
        from lmcache.keys import CacheKey

        for k in key:
            try:
                CacheKey.parse(k)
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint="'--key'") from None

    with open_target(url, token, config, timeout, write=not dry_run, tier=tier) as target:
        plan = target.plan_evict(
            tier, keys=key or None, bytes=n, older_than=age, all=all_, namespace=namespace, model=model
        )
        victims, skipped = plan["evict"], plan["skipped"]
        if dry_run:
            if as_json:
                print_json({"evicted": victims, "skipped": skipped, "bytes": plan["bytes"], "dry_run": True})
            elif victims:
                out().print(_table(victims))
                out().print(f"Would evict {_summary(victims)}.")
            else:
                out().print("Nothing to evict.")
            _report_skipped(skipped)
            return
        done: list[dict[str, Any]] = []
        if victims:
            confirm(f"Evict {_summary(victims)}?", yes=yes, what=f"evict {_summary(victims)}")
            with progress() as bar:
                task = bar.add_task("evicting", total=len(victims))
                for i in range(0, len(victims), BATCH):
                    batch = victims[i : i + BATCH]
                    ok, no = target.evict_entries([(v["tier"], v["key"]) for v in batch])
                    done += ok
                    skipped += no
                    bar.advance(task, len(batch))
    if as_json:
        print_json({"evicted": done, "skipped": skipped, "bytes": sum(e["size"] for e in done), "dry_run": False})
    else:
        out().print(f"Evicted {_summary(done)}." if done else "Nothing to evict.")
    _report_skipped(skipped)
