"""``lmcache pin`` / ``lmcache unpin``: keep entries of a running instance from eviction."""

from __future__ import annotations

from typing import Annotated

import typer

from ._target import DEFAULT_TIMEOUT, ConfigOpt, JsonOpt, TierOpt, TimeoutOpt, TokenOpt, UrlOpt, open_target
from ._util import note, out, print_json

app = typer.Typer(add_completion=False)

KeysArg = Annotated[list[str], typer.Argument(metavar="KEY...", help="Keys as 'lmcache ls' prints them.", show_default=False)]


def _check_keys(keys: list[str]) -> None:
    from lmcache.keys import CacheKey

    for k in keys:
        try:
            CacheKey.parse(k)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="'KEY'") from None


@app.command("pin")
def pin(
    keys: KeysArg,
    tier: TierOpt = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    config: ConfigOpt = None,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT,
    as_json: JsonOpt = False,
) -> None:
    """Pin entries of a running instance so that they are never evicted.

    A key stays pinned until 'lmcache unpin' (or until the instance stops), in every tier that holds it, or only in --tier.
    """
    _check_keys(keys)
    with open_target(url, token, config, timeout, live_only="pin") as target:
        results = [target.pin(k, tier) for k in keys]
    if as_json:
        print_json(results)
        return
    for r in results:
        out().print(f"pinned {r['key']} in {', '.join(r['pinned'])}")


@app.command("unpin")
def unpin(
    keys: KeysArg,
    tier: TierOpt = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    config: ConfigOpt = None,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT,
    as_json: JsonOpt = False,
) -> None:
    """Unpin entries pinned with 'lmcache pin' (in every tier, or only in --tier)."""
    _check_keys(keys)
    with open_target(url, token, config, timeout, live_only="unpin") as target:
        results = [target.unpin(k, tier) for k in keys]
    if as_json:
        print_json(results)
        return
    for r in results:
        if r["unpinned"]:
            out().print(f"unpinned {r['key']} in {', '.join(r['unpinned'])}")
        else:
            note(f"{r['key']} was not pinned")
