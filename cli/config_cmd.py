"""``lmcache config show``, ``lmcache config validate`` and ``lmcache config convert``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from lmcache.redact import redact
from lmcache.units import format_size

from ._target import DEFAULT_TIMEOUT, JsonOpt, TimeoutOpt, TokenOpt, UrlOpt, config_path, open_target
from ._util import note, out, print_json

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Show the effective config, check a config file, or convert an LMCache one.")

_SIZE_KEYS = {"capacity", "memory_pool_size", "staging_size"}


def _fmt(key: str, value: Any) -> str:
    if value is None:
        return "null" if key != "memory_pool_size" else "auto"
    if key in _SIZE_KEYS and isinstance(value, int) and not isinstance(value, bool):
        return format_size(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(k, v)}" for k, v in value.items()) + "}"
    return str(value)


def _source(src: str) -> str:
    if ", " in src:  # tiers made from several LMCache keys
        return ", ".join(_source(part) for part in src.split(", "))
    kind, _, detail = src.partition(":")
    if kind == "file":  # the file is named above the table
        return "file"
    return f"{kind} ({detail})" if detail else kind


def report_rows(report: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(key, value, source)`` rows: one per key, one per tier, one per api field."""
    rows = []
    values, sources = report["values"], report["sources"]
    for key, value in values.items():
        if key == "tiers":
            for i, t in enumerate(value):
                rows.append((f"tiers[{i}]", _fmt("tier", t), _source(sources.get("tiers", "default"))))
        elif key == "api":
            for sub, v in value.items():
                rows.append((f"api.{sub}", _fmt(sub, v), _source(sources.get(f"api.{sub}", "default"))))
        else:
            rows.append((key, _fmt(key, value), _source(sources.get(key, "default"))))
    return rows


@app.command("show")
def show(
    config: Annotated[
        Path | None,
        typer.Option("--config", "-c", metavar="FILE", show_default=False,
                     help="The config file (default: $LMCACHE_CONFIG_FILE; without one: defaults and environment)."),
    ] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT,
    as_json: JsonOpt = False,
) -> None:
    """Show the effective config and where each value came from (file, env, default, override).

    Offline, the config is loaded as an engine would load it: the file (--config or $LMCACHE_CONFIG_FILE), then LMCACHE_<KEY> environment variables. With --url, the running instance's own config. Credentials (tokens, secret keys, the password in a URL) are shown as ***.
    """
    if url is None and config is None:
        import os

        url = os.environ.get("LMCACHE_API_URL") or None
    if url is not None:
        with open_target(url, token, config, timeout) as target:
            report = target.config_report()
    else:
        from lmcache.config import load_config

        path = config_path(config)
        if path is None:
            note("no config file (--config or $LMCACHE_CONFIG_FILE): showing defaults and environment")
        report = load_config(path, too_big=too_big).report()
    report = {**report, "values": redact(report["values"])}  # an instance of an older version may not mask them
    if as_json:
        print_json(report)
        return
    o = out()
    if report.get("file"):
        o.print(f"config file: {escape(report['file'])}")
    t = Table()
    t.add_column("key", no_wrap=True)
    t.add_column("value", overflow="fold")
    t.add_column("source", overflow="fold")
    for row in report_rows(report):
        t.add_row(*(escape(c) for c in row))
    o.print(t)


def too_big(exc: Exception) -> None:
    """A config meant for a bigger machine is shown, converted or validated with a warning:
    only an engine, which allocates the memory pool, refuses it."""
    note(f"warning: {exc}; an engine refuses to start with it on this machine")


@app.command("validate")
def validate(
    file: Annotated[Path, typer.Argument(metavar="FILE", help="The YAML config file to check.", show_default=False)],
    as_json: JsonOpt = False,
) -> None:
    """Check a config file: every key and value, and each tier's backend, codec, policy and backend keys (nothing is opened or written).

    The file is checked on its own: LMCACHE_<KEY> environment variables are not applied. Exits 0 if it is valid; otherwise prints one line naming the key and the file and exits 1.
    """
    from lmcache.config import load_config
    from lmcache.hierarchy import check_tier

    cfg = load_config(file, environ={}, too_big=too_big)
    tiers = []
    for i, tcfg in enumerate(cfg.tiers):
        parts = check_tier(i, tcfg, source=cfg.source)
        tiers.append(
            {
                "name": tcfg.name,
                "backend": tcfg.backend,
                "class": f"{parts.backend_cls.__module__}:{parts.backend_cls.__qualname__}",
                "capacity": tcfg.capacity,
                "codec": tcfg.codec,
                "policy": tcfg.policy,
                "persistent": not parts.backend_cls.holds_memory_objects,
            }
        )
    if as_json:
        print_json({"file": str(file), "valid": True, "tiers": tiers})
        return
    desc = ", ".join(f"{t['name']} ({t['backend']}, {format_size(t['capacity'])})" for t in tiers)
    out().print(escape(f"{file}: valid; tiers: {desc}"))


def _size(n: int) -> str | int:
    """A capacity as the shortest exact size string (``5GiB``), else bytes."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return n


def converted(cfg: Any) -> dict[str, Any]:
    """The keys ``cfg`` got from its sources (not its defaults), in our format: what
    ``lmcache config convert`` writes. Tiers keep only what differs from a tier's defaults."""
    values = cfg.to_dict()
    out_: dict[str, Any] = {}
    for path in cfg.sources:
        head, _, sub = path.partition(".")
        if head == "tiers":
            out_["tiers"] = [
                {k: _size(v) if k == "capacity" else v for k, v in t.items()
                 if (k, v) not in (("codec", "raw"), ("policy", "lru"), ("name", t["backend"]))}
                for t in values["tiers"]
            ]
        elif sub:
            out_.setdefault(head, {})[sub] = values[head][sub]
        elif head in values:
            out_[head] = values[head]
    return out_


@app.command("convert")
def convert(
    file: Annotated[Path, typer.Argument(metavar="FILE", help="An LMCache (LMCache/LMCache) YAML config file.",
                                         show_default=False)],
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", metavar="OUT", show_default=False,
                     help="Write the converted config here, credentials included (default: stdout)."),
    ] = None,
    show_secrets: Annotated[
        bool, typer.Option("--show-secrets", help="On stdout, print credentials as they are instead of ***."),
    ] = False,
) -> None:
    """Translate an LMCache config file (local_cpu, max_local_cpu_size, remote_url, ...) into lmcache's format (YAML).

    The file is read on its own (LMCACHE_<KEY> environment variables are not applied) and checked as load_config checks it. Keys that have no effect here are listed on stderr, one per line. The output loads to the same config. On stdout, credentials (secret keys, tokens, the password in a URL) read *** unless --show-secrets; --output writes them, in a file only its owner can read. See docs/migrating.md.
    """
    import logging

    import yaml

    from lmcache.config import Config, _read_yaml, load_config
    from lmcache.settings import keys
    from lmcache.upstream import no_effect_keys

    quiet = logging.getLogger("lmcache.config")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the no-effect keys are listed below, once
    try:
        cfg = load_config(file, environ={}, too_big=too_big)
    finally:
        quiet.setLevel(level)
    data = converted(cfg)
    masked = redact(data)
    secret = masked != data
    text = f"# converted from {file} by `lmcache config convert`\n" + yaml.safe_dump(
        data if output is not None or show_secrets else masked, sort_keys=False, default_flow_style=False)
    for key, why in no_effect_keys(_read_yaml(file), keys(Config)).items():
        note(f"no effect here: {key} ({why})")
    if output is None:
        sys.stdout.write(text)
        if secret and not show_secrets:
            note("credentials read *** above: write them with -o FILE (readable by its owner only), "
                 "or print them with --show-secrets")
    else:
        _write(output, text, private=secret)
        note(f"wrote {output}" + (" (it holds credentials: readable by its owner only)" if secret else ""))


def _write(path: Path, text: str, *, private: bool) -> None:
    """``text`` into ``path``; with ``private`` (credentials in it) a regular file is made
    owner-only before anything is written, an existing one included."""
    import os
    import stat

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o666)
    with open(fd, "w", encoding="utf-8") as f:
        if private and stat.S_ISREG(os.fstat(fd).st_mode):
            os.fchmod(fd, 0o600)
        f.write(text)
