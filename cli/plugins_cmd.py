"""``lmcache plugins``: every registered backend, codec, connector and policy."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from ._util import out, print_json

app = typer.Typer(add_completion=False)

KINDS = ("backend", "codec", "connector", "policy", "layout", "service", "channel", "baseline", "launcher")


def plugin_rows() -> list[dict[str, Any]]:
    """One row per registered target, from a freshly built plugin manager (so the
    ``LMCACHE_*PLUGIN*`` environment variables of this process apply)."""
    from lmcache.plugin_manager import Registries, create_plugin_manager, plugin_source

    regs = Registries(create_plugin_manager())
    rows = []
    for registry in (regs.backends, regs.codecs, regs.connectors, regs.policies, regs.layouts, regs.services, regs.channels, regs.baselines,
                     regs.launchers):
        for e in registry.entries():
            dist, version = plugin_source(e.plugin)
            if isinstance(e.target, str):
                target = e.target
            elif isinstance(e.target, type):
                target = f"{e.target.__module__}:{e.target.__qualname__}"
            else:  # an instance (a layout)
                target = f"{type(e.target).__module__}:{type(e.target).__qualname__}({e.name!r})"
            rows.append(
                {
                    "kind": e.kind,
                    "name": e.name,
                    "target": target,
                    "plugin": e.plugin,
                    "distribution": dist,
                    "version": version,
                    "hooks": regs.hooks_of(e.plugin),
                    "extra": e.extra,
                    "requires": e.requires,
                    "description": e.description,
                }
            )
    return rows


@app.command("plugins")
def plugins(
    kind: Annotated[
        str | None, typer.Option("--kind", help=f"Only this kind: {', '.join(KINDS)}.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list.")] = False,
) -> None:
    """List every registered backend, codec, connector and eviction policy.

    Each with the package (and version) that provides it and the hooks it registered through. In --json, 'kind' is the type, 'distribution' the package, 'version' its version, and 'requires' the pip requirement named when the plugin's module is missing.
    """
    if kind is not None and kind not in KINDS:
        raise typer.BadParameter(f"must be one of {', '.join(KINDS)}; got {kind!r}", param_hint="'--kind'")
    rows = plugin_rows()
    if kind is not None:
        rows = [r for r in rows if r["kind"] == kind]
    if as_json:
        print_json(rows)
        return
    o = out()
    if not rows:
        o.print("No plugins registered.")
        return
    t = Table(caption="hooks are shown without their 'lmcache_' prefix; --json also names each plugin module",
              caption_justify="left")
    for col in ("type", "name", "package", "version", "hooks", "target"):
        t.add_column(col, overflow="fold", no_wrap=col != "hooks")
    for r in rows:
        t.add_row(
            r["kind"], r["name"], r["distribution"], r["version"] or "-",
            ", ".join(h.removeprefix("lmcache_") for h in r["hooks"]), r["target"],
        )
    o.print(t)
