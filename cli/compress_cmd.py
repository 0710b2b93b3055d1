"""``lmcache compress`` / ``lmcache decompress``: re-encode a tier's stored chunks in place."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from lmcache.units import format_size

from ._target import DEFAULT_TIMEOUT, ConfigOpt, JsonOpt, TimeoutOpt, TokenOpt, UrlOpt, open_target
from ._util import confirm, note, out, print_json

app = typer.Typer(add_completion=False)

TierReq = Annotated[str, typer.Option("--tier", "-t", metavar="NAME", help="The tier to re-encode (a byte tier: disk, ...).")]
KeyOpt = Annotated[list[str] | None, typer.Option("--key", "-k", help="Only this key (repeatable).", show_default=False)]
NsOpt = Annotated[str | None, typer.Option("--namespace", "-n", help="Only keys of this namespace.")]
ModelOpt = Annotated[str | None, typer.Option("--model", "-m", help="Only keys of this model.")]
DryOpt = Annotated[bool, typer.Option("--dry-run", help="List what would be re-encoded; change nothing.")]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]


def _run(codec: str, verb: str, tier: str, key: list[str] | None, namespace: str | None, model: str | None,
         dry_run: bool, yes: bool, url: str | None, token: str | None, config: Any, timeout: float, as_json: bool) -> None:
    with open_target(url, token, config, timeout, write=not dry_run, tier=tier) as target:
        plan = target.recode(tier, codec, keys=key or None, namespace=namespace, model=model, dry_run=True)
        n = len(plan["recoded"])
        if dry_run:
            if as_json:
                print_json(plan)
            else:
                out().print(f"Would {verb} {n} entries ({format_size(plan['bytes_before'])}) of tier {tier} with {plan['codec']}.")
            return
        if n:
            confirm(f"{verb.capitalize()} {n} entries of tier {tier} with {plan['codec']}?", yes=yes,
                    what=f"{verb} {n} entries")
        result = target.recode(tier, codec, keys=key or None, namespace=namespace, model=model)
    if as_json:
        print_json(result)
        return
    done = result["recoded"]
    if done:
        before, after = result["bytes_before"], result["bytes_after"]
        ratio = f" ({before / after:.2f}x)" if after else ""
        out().print(f"Re-encoded {len(done)} entries of tier {tier} with {result['codec']}: "
                    f"{format_size(before)} -> {format_size(after)}{ratio}.")
    else:
        out().print("Nothing to re-encode.")
    for s in result["skipped"][:10]:
        note(f"skipped {s['key']}: {s['reason']}")


@app.command("compress")
def compress(
    tier: TierReq,
    codec: Annotated[str, typer.Option("--codec", help="A codec or chain, e.g. zstd, shuffle+zstd, int8+zstd.")],
    key: KeyOpt = None,
    namespace: NsOpt = None,
    model: ModelOpt = None,
    dry_run: DryOpt = False,
    yes: YesOpt = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
    config: ConfigOpt = None,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT,
    as_json: JsonOpt = False,
) -> None:
    """Re-encode stored chunks of a tier with a codec, in place (each replaced atomically).

    A lossy codec (int8, int4, fp8) changes the KV that later hits return, within its documented bound. Asks first unless --yes.
    """
    _run(codec, "compress", tier, key, namespace, model, dry_run, yes, url, token, config, timeout, as_json)


@app.command("decompress")
def decompress(
    tier: TierReq,
    key: KeyOpt = None,
    namespace: NsOpt = None,
    model: ModelOpt = None,
    dry_run: DryOpt = False,
    yes: YesOpt = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
    config: ConfigOpt = None,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT,
    as_json: JsonOpt = False,
) -> None:
    """Store chunks of a tier raw again (codec 'raw'), in place. Asks first unless --yes."""
    _run("raw", "decompress", tier, key, namespace, model, dry_run, yes, url, token, config, timeout, as_json)
